"""Experiment tracking: each round's metrics, the config and the summary of a run also go
to TensorBoard, MLflow or Weights & Biases (``fedskew run --track NAME``), besides the run
folder, which stays the record. Each backend is an optional extra (``fedskew[NAME]``)."""

from fedskew.runs.tracking.session import (
    TrackingSession,
    check_available,
    check_saved_trackers,
    prepare,
)

__all__ = ["TrackingSession", "check_available", "check_saved_trackers", "prepare"]
