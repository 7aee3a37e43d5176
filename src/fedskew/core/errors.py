"""User-facing errors: each carries a one-line message and the process exit code."""


class FedskewError(Exception):
    """An error caused by the user's input or environment, reported as one line."""

    exit_code = 1


class UsageError(FedskewError):
    """Bad option, unknown name or invalid value (exit code 2, like argparse)."""

    exit_code = 2


class DataError(FedskewError):
    """A dataset that cannot be found, downloaded or read."""

    exit_code = 1


class Diverged(FedskewError):
    """A run stopped by NaN or Inf in a client's reply or in the global model: a result of
    the method and its hyper-parameters (``round``, 1-based, is where it diverged), not a
    fault of fedskew or of the machine; a run folder records it apart from a failure."""

    def __init__(self, message: str, round: int) -> None:
        super().__init__(message)
        self.round = round


class Terminated(KeyboardInterrupt):
    """The interrupt a SIGTERM raises (the command line turns the signal into it); the exit
    status says which signal it was."""
