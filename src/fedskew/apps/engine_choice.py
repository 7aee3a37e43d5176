"""The entry point a configuration's engine names: the in-process loop or Flower's
simulation. The command line and ``fedskew.run`` both start runs here, so the engine a
configuration names is the engine that runs it (``fedskew.run(engine="flower-sim")`` once
ran in-process and recorded flower-sim)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedskew.config import ExperimentConfig
from fedskew.core.errors import UsageError


def run_on_its_engine(
    cfg: ExperimentConfig,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    resume: Path | None = None,
    on_start: Callable[[int], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run (or continue) ``cfg`` on the engine it names; the run folder and summary."""
    if cfg.engine == "flower":  # only a deployed ServerApp runs this engine
        if resume is not None:
            raise UsageError(
                "this run was deployed on a Flower federation: continue it there with "
                f"flwr run flower <connection> --run-config 'resume=\"{resume}\"'"
            )
        raise UsageError(
            "engine 'flower' is a deployment's: submit the app with fedskew deploy "
            "(docs/flower.md), or choose inprocess or flower-sim"
        )
    if cfg.engine == "flower-sim":
        return flower_simulation()(cfg, on_round=on_round, on_start=on_start, resume=resume)
    from fedskew.runs.loop import run

    return run(cfg, on_round=on_round, resume=resume, on_start=on_start)


def flower_simulation():
    """The Flower simulation entry point, or a one-line error when Flower is missing."""
    try:
        from fedskew.apps.flower import run_simulation
    except ImportError as exc:
        raise UsageError(
            f"--engine flower-sim needs Flower: pip install 'fedskew[flower]' ({exc})"
        ) from None
    return run_simulation
