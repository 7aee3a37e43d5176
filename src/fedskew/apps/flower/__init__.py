"""fedskew as a Flower app: a ServerApp that drives any algorithm, a ClientApp that runs it.

An app on top of the run loop, like the command line: the same algorithm file runs here as
in the in-process engine. The ServerApp runs the run loop :func:`fedskew.runs.loop.run`
with a :class:`~fedskew.engines.flower_engine.FlowerEngine`; the
ClientApp routes each message to the algorithm's client handler, keeping the client's
state in the node's ``context.state``.

Start-up handshake: the ServerApp waits for the nodes, then sends each one a ``setup``
message carrying the experiment configuration (JSON); the node answers with the partition
id from its node config (``partition-id``), which becomes its fedskew client id. Every
node thus builds the same data partition from the same seed and takes its own part; a
node may point at its local copy of the data with the node config key ``data-dir``. The
setup has no fixed deadline: it waits while nodes keep answering (:func:`handshake`).

Paths: a deployed ServerApp writes only under the output root that the server operator sets
in ``$FEDSKEW_OUTPUT_ROOT``; paths in the run config are relative to it (:func:`path_in_root`).
``fedskew run --engine flower-sim`` writes where ``-o`` says: its user is its operator.

Entry points: ``server_app`` / ``client_app`` (named in the Flower app's pyproject for
``flwr run``), and :func:`run_simulation` for ``fedskew run --engine flower-sim`` (which
submits the same app to a SuperLink of its own in simulation mode).

The parts: ``run_config`` (the run config and the output root, no Flower import),
``app_config`` (the app's pyproject.toml), ``submit`` (``flwr run`` and the run's status:
``fedskew deploy``), ``server`` (the handshake and the ServerApp), ``client`` (the
ClientApp), ``simulation`` (``fedskew run --engine flower-sim``) and ``processes`` (ending
what a simulation left).
"""

from typing import Any

__all__ = ["client_app", "run_simulation", "server_app"]

_WHERE = {
    "client_app": "fedskew.apps.flower.client",
    "server_app": "fedskew.apps.flower.server",
    "run_simulation": "fedskew.apps.flower.simulation",
}


def __getattr__(name: str) -> Any:
    # Flower is imported only with the apps: run_config and app_config work without it.
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'fedskew.apps.flower' has no attribute {name!r}")
