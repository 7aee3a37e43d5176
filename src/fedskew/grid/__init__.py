"""The parts of ``fedskew compare`` (fedskew.apps.compare gathers them): ``plan`` reads a compare
file into a grid of planned runs, ``launch`` runs them, ``status`` says where they stand,
``tables`` writes the grid folder's compare.json and the tables of its finished runs."""
