"""What users start: the Python API, the command line (``fedskew``), ``fedskew compare``
and ``fedskew report``, and the Flower app."""
