"""Checkpoints without pickle: named tensors in a NumPy ``.npz`` plus a JSON index.

A checkpoint says which run it belongs to (algorithm, configuration hash) and holds the
finished round with its metrics line, a digest of the metrics lines up to it, the server
logic's state (its global model and the attributes it names in ``checkpoint_fields``) and
every client's ``ClientState``. Values are tensors, NumPy arrays, numbers, strings, None,
and dicts/lists of those; anything else is refused, so nothing arrives through pickle on
load. What a resume reads back is checked against the run in ``fedskew.runs.saved_state``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.core.durable import refuse_non_regular, replace_durably
from fedskew.core.errors import FedskewError
from fedskew.training.interface import ServerLogic
from fedskew.training.protocol import ClientState

FORMAT = "fedskew-checkpoint-2"  # 2: the run's algorithm, config hash and round record


class _Packer:
    """Turns nested values into a JSON skeleton with array references."""

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def pack(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = f"a{len(self.arrays)}"
            t = value.detach().cpu()
            if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: keep the bits
                self.arrays[key] = t.view(torch.int16).numpy().copy()
                return {"__tensor__": key, "dtype": "bfloat16"}
            self.arrays[key] = t.numpy().copy()
            return {"__tensor__": key}
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise TypeError("object arrays cannot be checkpointed")
            key = f"a{len(self.arrays)}"
            self.arrays[key] = value
            return {"__ndarray__": key}
        if isinstance(value, dict):
            items = [[self.pack(k), self.pack(v)] for k, v in value.items()]
            return {"__dict__": items}
        if isinstance(value, (list, tuple)):
            return {"__list__": [self.pack(v) for v in value]}
        if isinstance(value, np.generic):
            return value.item()
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot checkpoint a value of type {type(value).__name__}")


def _unpack(node: Any, arrays: Any) -> Any:
    if isinstance(node, dict):
        if "__tensor__" in node:
            arr = arrays[node["__tensor__"]]
            t = torch.from_numpy(np.array(arr))
            return t.view(torch.bfloat16) if node.get("dtype") == "bfloat16" else t
        if "__ndarray__" in node:
            return np.array(arrays[node["__ndarray__"]])
        if "__dict__" in node:
            return {_unpack(k, arrays): _unpack(v, arrays) for k, v in node["__dict__"]}
        if "__list__" in node:
            return [_unpack(v, arrays) for v in node["__list__"]]
        raise ValueError("unknown node in checkpoint index")
    return node


def server_state(server: ServerLogic) -> dict[str, Any]:
    fields = ("global_arrays", *server.checkpoint_fields)
    return {name: getattr(server, name) for name in fields}


def load_server_state(server: ServerLogic, state: dict[str, Any]) -> None:
    """Put back the fields of :func:`server_state`: only those, so that a name saved in a
    file never replaces anything else of the server (its methods)."""
    for name in ("global_arrays", *server.checkpoint_fields):
        setattr(server, name, state[name])


@dataclass
class Checkpoint:
    """What a checkpoint holds: which run and round it belongs to, the server's state, every
    client's state, and the metrics line of its round (so that a kill between the checkpoint
    and the metrics line loses nothing)."""

    round: int
    server: dict[str, Any]
    clients: dict[int, ClientState]
    algorithm: str = ""
    config_hash: str = ""
    record: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # fedskew.runs.saved_state.metrics_digest of the metrics lines of rounds 1..round; None
    # in checkpoints written before it was kept (and by callers that pass none).
    metrics_digest: str | None = None


def save_checkpoint(
    path: Path,
    rnd: int,
    server: ServerLogic,
    client_states: Mapping[int, ClientState],
    extra: dict[str, Any] | None = None,
    *,
    algorithm: str = "",
    config_hash: str = "",
    record: dict[str, Any] | None = None,
    metrics_digest: str | None = None,
) -> None:
    """Write durably: a kill or power cut while writing leaves the previous checkpoint."""
    packer = _Packer()
    index = {
        "format": FORMAT,
        "round": rnd,
        "algorithm": algorithm,
        "config_hash": config_hash,
        "record": packer.pack(record),
        "metrics_digest": metrics_digest,
        "server": packer.pack(server_state(server)),
        "clients": packer.pack(
            {cid: {"arrays": s.arrays, "scalars": s.scalars} for cid, s in client_states.items()}
        ),
        "extra": packer.pack(extra or {}),
    }
    header = np.frombuffer(json.dumps(index).encode("utf-8"), dtype=np.uint8)
    replace_durably(path, lambda fh: np.savez(fh, __index__=header, **packer.arrays))


def read_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in ``path``; one-line FedskewError for a missing, torn, corrupt or
    foreign file (nothing is unpickled)."""
    refuse_non_regular(Path(path), "checkpoint")
    try:
        with np.load(path, allow_pickle=False) as data:
            index = json.loads(bytes(data["__index__"]).decode("utf-8"))
            if not isinstance(index, dict) or index.get("format") != FORMAT:
                found = index.get("format") if isinstance(index, dict) else None
                raise ValueError(f"format {found!r}, expected {FORMAT!r}")
            if type(index["round"]) is not int:
                raise ValueError(f"its round {index['round']!r} is not a whole number")
            ckpt = Checkpoint(
                round=index["round"],
                server=_unpack(index["server"], data),
                clients={
                    _client_id(cid): _client_state(s)
                    for cid, s in _unpack(index["clients"], data).items()
                },
                algorithm=str(index["algorithm"]),
                config_hash=str(index["config_hash"]),
                record=_unpack(index["record"], data),
                extra=_unpack(index["extra"], data),
                metrics_digest=index.get("metrics_digest"),
            )
            if not isinstance(ckpt.metrics_digest, str | None):
                raise ValueError("its metrics digest is not a string")
    except FileNotFoundError:
        raise FedskewError(f"cannot read checkpoint {path}: no such file") from None
    except Exception as exc:  # zipfile, zlib, NumPy and JSON each fail their own way
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
        raise FedskewError(
            f"{path} is not a fedskew checkpoint, or it is damaged ({type(exc).__name__}: {detail})"
        ) from None
    if not isinstance(ckpt.server, dict) or "global_arrays" not in ckpt.server:
        raise FedskewError(
            f"{path} is not a fedskew checkpoint, or it is damaged (no global model)"
        )
    return ckpt


def _client_id(cid: Any) -> int:
    if type(cid) is not int:
        raise ValueError(f"client id {cid!r} is not an integer")
    return cid


def _client_state(saved: Any) -> ClientState:
    """A client's saved state: {"arrays": {...}, "scalars": {...}} (their values are the
    business of fedskew.runs.saved_state)."""
    if not isinstance(saved, dict) or set(saved) != {"arrays", "scalars"}:
        raise ValueError("a client state is not its arrays and scalars")
    if not isinstance(saved["arrays"], dict) or not isinstance(saved["scalars"], dict):
        raise ValueError("a client state's arrays or scalars are not named")
    return ClientState(arrays=dict(saved["arrays"]), scalars=dict(saved["scalars"]))


def load_checkpoint(path: Path) -> tuple[int, dict[str, Any], dict[int, ClientState], dict]:
    """(finished round, server state, client states, extra) of :func:`read_checkpoint`."""
    ckpt = read_checkpoint(path)
    return ckpt.round, ckpt.server, ckpt.clients, ckpt.extra


def check_checkpoint(
    ckpt: Checkpoint, path: Path, algorithm: str, config_hash: str, rounds: int
) -> None:
    """Refuse a checkpoint that does not belong to this run: another algorithm or
    configuration, a round outside 1..rounds, or non-finite values (a diverged state must
    never be resumed). Whether its state fits the run is ``fedskew.runs.saved_state``'s."""
    if ckpt.algorithm != algorithm:
        raise FedskewError(
            f"{path} holds a {ckpt.algorithm or 'unnamed'} run, not {algorithm}; "
            "it belongs to another run"
        )
    if ckpt.config_hash != config_hash:
        raise FedskewError(f"{path} was written by a run with another configuration")
    if not 1 <= ckpt.round <= rounds:
        raise FedskewError(f"{path} holds round {ckpt.round}, outside this run's 1..{rounds}")
    where = _non_finite(ckpt.server) or _non_finite(
        {cid: s.arrays for cid, s in ckpt.clients.items()}
    )
    if where:
        raise FedskewError(f"{path}: non-finite values in {where}")


def _non_finite(value: Any, where: str = "") -> str | None:
    """The path of the first tensor holding NaN or Inf in a nested value, or None."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return where or "a tensor"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _non_finite(item, f"{where}/{key}" if where else str(key))
            if found:
                return found
    if isinstance(value, (list, tuple)):
        for number, item in enumerate(value):
            found = _non_finite(item, f"{where}[{number}]")
            if found:
                return found
    return None
