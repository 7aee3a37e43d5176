"""Running an experiment: the round loop, run folders, checkpoints, measurements and
experiment tracking."""
