"""What the user of ``fedskew deploy`` reads of a ServerApp: the log Flower streams from the
ServerApp's process, captured here with the ServerApp run in this process (tests of the
deployment's log lines and of the run-config fuzzer)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from logging import ERROR

from flwr.supercore.exit import ExitCode
from flwr.supercore.exit.exit_code import EXIT_CODE_HELP
from flwr.supercore.logger import console_handler, log


def flower_log(call: Callable[[], None]) -> tuple[str, BaseException | None]:
    """Run ``call`` (a ServerApp's main) as Flower's flwr-serverapp process does, and return
    the log that ``flwr log`` would stream of it, and the exception it raised, if any.

    flwr-serverapp (flwr/superlink/runtime/run_serverapp.py, Flower 1.42) logs a ServerApp's
    exception through Flower's logger with ``exc_info`` (its traceback), then, in
    ``flwr_exit``, the exit code and its help: the same two calls are made here, through
    Flower's own console handler, whose output is what the log uploader sends."""
    buffer = io.StringIO()
    fedskew_log = logging.getLogger("fedskew")
    handlers = list(fedskew_log.handlers)
    fedskew_log.handlers = []  # as in a fresh ServerApp process: it takes Flower's handlers
    stream = console_handler.stream
    console_handler.stream = buffer
    raised: BaseException | None = None
    try:
        try:
            call()
        except Exception as ex:
            raised = ex
            log(ERROR, "%s raised an exception", "ServerApp", exc_info=ex)
            code = int(ExitCode.SERVERAPP_EXCEPTION)
            log(ERROR, f"Exit Code: {code}\n{EXIT_CODE_HELP.get(code, '')}\n\nFor more ...")
    finally:
        console_handler.stream = stream
        fedskew_log.handlers = handlers
    return buffer.getvalue(), raised
