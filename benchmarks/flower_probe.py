"""`fedskew run` with a probe on Flower's Ray backend, for benchmarks/flower_round_time.py.

    python benchmarks/flower_probe.py FACTS.json run --engine flower-sim ...

Runs the fedskew command line unchanged, and when Flower has built its pool of Ray actors
writes to FACTS.json what the simulation got: the client resources fedskew passed to Flower
(CPUs and GPUs per virtual client), the number of actors Flower started (the clients that
train at the same time), the resources Ray detected on this machine, and the versions of
Flower and Ray. Nothing in the run changes.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path


def install(out: Path) -> None:
    import ray
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    build = RayBackend.build

    def probed_build(self: RayBackend, app_fn) -> None:  # type: ignore[no-untyped-def]
        build(self, app_fn)
        cluster = ray.cluster_resources()
        facts = {
            "flwr": version("flwr"),
            "ray": version("ray"),
            "client_resources": dict(self.client_resources),
            "actors": self.num_workers,
            "ray_cpus": cluster.get("CPU", 0.0),
            "ray_gpus": cluster.get("GPU", 0.0),
        }
        out.write_text(json.dumps(facts, indent=1))

    RayBackend.build = probed_build  # type: ignore[method-assign]


def main() -> int:
    install(Path(sys.argv[1]))
    from fedskew.apps.cli import main as fedskew_main

    return fedskew_main(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
