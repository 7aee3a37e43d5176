"""Checkpoints without pickle: named tensors in a NumPy ``.npz`` plus a JSON index.

A checkpoint holds the finished round, the server logic's state (its global model and
the attributes it names in ``checkpoint_fields``) and every client's ``ClientState``.
Values are tensors, NumPy arrays, numbers, strings, None, and dicts/lists of those;
anything else is refused, so nothing arrives through pickle on load.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.algorithm_interface import ServerLogic
from fedskew.errors import FedskewError
from fedskew.protocol import ClientState

FORMAT = "fedskew-checkpoint-1"


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
    for name, value in state.items():
        setattr(server, name, value)


def save_checkpoint(
    path: Path,
    rnd: int,
    server: Any,
    client_states: dict[int, ClientState],
    extra: dict[str, Any] | None = None,
) -> None:
    """Write atomically: a kill while writing leaves the previous checkpoint intact."""
    packer = _Packer()
    index = {
        "format": FORMAT,
        "round": rnd,
        "server": packer.pack(server_state(server)),
        "clients": packer.pack(
            {cid: {"arrays": s.arrays, "scalars": s.scalars} for cid, s in client_states.items()}
        ),
        "extra": packer.pack(extra or {}),
    }
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, __index__=np.frombuffer(json.dumps(index).encode("utf-8"), dtype=np.uint8),
                 **packer.arrays)  # fmt: skip
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> tuple[int, dict[str, Any], dict[int, ClientState], dict]:
    """(finished round, server state, client states, extra)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            index = json.loads(bytes(data["__index__"]).decode("utf-8"))
            if index.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} file")
            server = _unpack(index["server"], data)
            clients_raw = _unpack(index["clients"], data)
            extra = _unpack(index["extra"], data)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise FedskewError(f"cannot read checkpoint {path}: {exc}") from None
    clients = {
        int(cid): ClientState(arrays=dict(s["arrays"]), scalars=dict(s["scalars"]))
        for cid, s in clients_raw.items()
    }
    return int(index["round"]), server, clients, extra
