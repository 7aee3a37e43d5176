"""The worker-pool engine: the clients of each exchange run in N worker processes.

On a small machine, N processes with one torch thread each train small models faster
than one process with N threads (a small convolution does not split well over threads).
Results are identical to the in-process engine: every client's work depends only on its
message, its state, its id and the round (randomness is addressed, not streamed), and
each worker loads the weights it needs from the message or the state, as any engine's
clients must.

The parent keeps every client's state and sends it with each task; a worker keeps
nothing between tasks but its data, its scratch model and the algorithm's client logic,
built once from the experiment configuration (sent at start-up, with the worker's torch
thread count and, on the CPU, where to find the dataset). On the CPU the parent puts the
dataset's tensors into shared memory once and every worker maps them
(``fedskew.engines.shared_data``): the dataset takes its memory once, not once per worker.
Workers are started with ``spawn`` (forking a process whose torch already runs threads can
deadlock), ignore Ctrl-C (the parent ends them), and take tasks one at a time: a free
worker gets the next client of the exchange.

On CUDA each worker takes one GPU (worker i: cuda:i mod the visible GPUs), so N workers
spread a round's clients over the machine's GPUs; messages and states cross the pipes as
host arrays, and each worker's client runtime moves them to its GPU and back. CUDA workers
load the dataset themselves and put it on their GPU.

Wire format, both ways, no pickle: an 8-byte little-endian header length, a JSON header
(envelope, message kind, numbers, strings, and for each array its name, dtype, shape and
storage order), then the raw bytes of each array in header order. Arrays keep their
memory layout (``channels_last`` and other dense stride orders), so a client computes on
exactly what the in-process engine would hand it.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing as mp
import os
import re
import signal
import struct
import sys
import traceback
from collections import deque
from collections.abc import Mapping
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch

from fedskew.config import ExperimentConfig, TrainingWork
from fedskew.core.denormals import LEGACY_DENORMALS, apply_denormals
from fedskew.core.device import cuda_count
from fedskew.core.errors import FedskewError
from fedskew.core.machine import available_memory_bytes
from fedskew.data.datasets import Dataset
from fedskew.engines.base import ServerSideClientStates, refuse_unmet
from fedskew.engines.client_runtime import ClientRuntime, runtime_from_config_json
from fedskew.engines.shared_data import (
    SHM_DIR,
    AttachedData,
    SharedDataset,
    dataset_nbytes,
    shared_memory_available,
)
from fedskew.engines.together import TOGETHER
from fedskew.training.protocol import ClientState, Expected, Message

log = logging.getLogger("fedskew")
_LENGTH = struct.Struct("<Q")
POLL_SECONDS = 1.0  # how often a waiting parent checks that its busy workers are alive
STOP_SECONDS = 5.0  # how long an idle worker may take to leave after the stop frame

# torch dtype -> (wire name, NumPy dtype of the bytes). bfloat16 has no NumPy dtype: its
# bits travel as int16 and are viewed back.
_DTYPES: dict[torch.dtype, tuple[str, np.dtype]] = {
    torch.float64: ("float64", np.dtype(np.float64)),
    torch.float32: ("float32", np.dtype(np.float32)),
    torch.float16: ("float16", np.dtype(np.float16)),
    torch.bfloat16: ("bfloat16", np.dtype(np.int16)),
    torch.int64: ("int64", np.dtype(np.int64)),
    torch.int32: ("int32", np.dtype(np.int32)),
    torch.int16: ("int16", np.dtype(np.int16)),
    torch.int8: ("int8", np.dtype(np.int8)),
    torch.uint8: ("uint8", np.dtype(np.uint8)),
    torch.bool: ("bool", np.dtype(np.bool_)),
    torch.complex64: ("complex64", np.dtype(np.complex64)),
    torch.complex128: ("complex128", np.dtype(np.complex128)),
}
_BY_NAME: dict[str, tuple[torch.dtype, np.dtype]] = {
    name: (dtype, np_dtype) for dtype, (name, np_dtype) in _DTYPES.items()
}


# ---------------------------------------------------------------------------- codec


def _storage_order(t: torch.Tensor) -> list[int] | None:
    """The dimension order in which a dense, non-contiguous tensor lies in memory
    (channels_last: N, H, W, C), or None: send it in the default order."""
    if t.dim() < 2 or t.is_contiguous():
        return None
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    # Views with gaps or repeats (slices, expand) are not dense in any order.
    return order if t.permute(order).is_contiguous() else None


def _pack_array(name: str, t: torch.Tensor, specs: list[dict], chunks: list[Any]) -> None:
    if t.dtype not in _DTYPES:
        raise FedskewError(
            f"array '{name}' has dtype {t.dtype}, which the worker engine cannot carry "
            f"(supported: {', '.join(_BY_NAME)})"
        )
    wire, _ = _DTYPES[t.dtype]
    data = t.detach().cpu().resolve_conj().resolve_neg()
    order = _storage_order(data)
    if order is not None:
        data = data.permute(order)
    data = data.contiguous()
    if data.dtype == torch.bfloat16:
        data = data.view(torch.int16)
    raw = data.numpy().reshape(-1).view(np.uint8)
    specs.append(
        {"name": name, "dtype": wire, "shape": list(t.shape), "order": order, "nbytes": raw.size}
    )
    chunks.append(raw)


def _unpack_array(spec: dict, buf: memoryview, offset: int) -> torch.Tensor:
    dtype, np_dtype = _BY_NAME[spec["dtype"]]
    shape = [int(s) for s in spec["shape"]]
    order = spec["order"]
    stored = shape if order is None else [shape[d] for d in order]
    count = int(np.prod(stored, dtype=np.int64))
    if count == 0:
        t = torch.empty(stored, dtype=dtype)  # nothing to read; NumPy would give odd strides
    else:
        # .copy(): the tensor must own writable memory, not the received frame.
        arr = np.frombuffer(buf, dtype=np_dtype, count=count, offset=offset)
        t = torch.from_numpy(arr.reshape(stored).copy())
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
    return t if order is None else t.permute(_inverse(order))


def _inverse(order: list[int]) -> list[int]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return inverse


def _scalar(name: str, value: Any) -> bool | int | float:
    if isinstance(value, (bool, int, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        raise FedskewError(f"scalar '{name}' is a {type(value).__name__}, not a number") from None


def encode_frame(
    meta: Mapping[str, Any],
    message: Message | None = None,
    state: ClientState | None = None,
) -> bytes:
    """One frame: an envelope (JSON-able values), optionally a message and a state."""
    specs: list[dict] = []
    chunks: list[Any] = []
    header: dict[str, Any] = {"meta": dict(meta)}
    if message is not None:
        start = len(specs)
        for name, t in message.arrays.items():
            _pack_array(name, t, specs, chunks)
        header["message"] = {
            "kind": message.kind,
            "arrays": specs[start:],
            "scalars": {k: _scalar(k, v) for k, v in message.scalars.items()},
            "strings": {k: str(v) for k, v in message.strings.items()},
        }
    if state is not None:
        start = len(specs)
        for name, t in state.arrays.items():
            _pack_array(name, t, specs, chunks)
        header["state"] = {
            "arrays": specs[start:],
            "scalars": {k: _scalar(k, v) for k, v in state.scalars.items()},
        }
    text = json.dumps(header).encode("utf-8")
    return b"".join([_LENGTH.pack(len(text)), text, *chunks])


def decode_frame(data: bytes) -> tuple[dict[str, Any], Message | None, ClientState | None]:
    """(envelope, message or None, state or None) from a frame of :func:`encode_frame`."""
    buf = memoryview(data)
    (length,) = _LENGTH.unpack_from(buf, 0)
    offset = _LENGTH.size + length
    header = json.loads(bytes(buf[_LENGTH.size : offset]).decode("utf-8"))

    def arrays(specs: list[dict]) -> dict[str, torch.Tensor]:
        nonlocal offset
        out: dict[str, torch.Tensor] = {}
        for spec in specs:
            out[spec["name"]] = _unpack_array(spec, buf, offset)
            offset += int(spec["nbytes"])
        return out

    message = state = None
    if "message" in header:
        m = header["message"]
        message = Message(
            m["kind"], arrays=arrays(m["arrays"]), scalars=m["scalars"], strings=m["strings"]
        )
    if "state" in header:
        s = header["state"]
        state = ClientState(arrays=arrays(s["arrays"]), scalars=s["scalars"])
    if offset != len(data):
        raise FedskewError(f"a worker frame has {len(data) - offset} bytes past its arrays")
    return header["meta"], message, state


def one_line(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its text."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ---------------------------------------------------------------------------- worker


def worker_device(spec: str, index: int) -> str:
    """The device option of worker ``index`` for the run's ``spec``: with CUDA (cuda, or
    auto where a GPU is visible) worker i gets cuda:i mod the number of visible GPUs, so
    that N workers spread over the GPUs; cpu and cuda:N are kept as they are."""
    count = cuda_count()
    if spec in ("auto", "cuda") and count > 0:
        return f"cuda:{index % count}"
    return spec


def _leave() -> None:
    # A worker holds no files or buffers that need the interpreter's orderly teardown,
    # which takes seconds with torch loaded; the parent waits for this exit in close().
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _send_or_go(conn: Connection, frame: bytes) -> None:
    """Send ``frame``, or end the worker quietly where the parent is gone: a run killed
    while its workers start (Ctrl-C, a compare stopping its runs) left each of them printing
    a BrokenPipeError traceback."""
    try:
        conn.send_bytes(frame)
    except (EOFError, OSError):
        _leave()


def worker_main(conn: Connection, config_json: str, setup_json: str = "{}") -> None:
    """A worker process: build the runtime, then answer tasks until told to stop.

    ``setup_json``: what is the worker's own, as JSON: ``threads`` (its torch threads) and
    ``data`` (where its dataset lies in shared memory, ``fedskew.engines.shared_data``;
    absent: the worker loads the dataset itself)."""
    # Ctrl-C reaches the whole process group; the parent decides when workers end.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A fault (say a write into the read-only shared dataset) prints where it happened.
    faulthandler.enable()
    try:
        setup = json.loads(setup_json)
        torch.set_num_threads(int(setup.get("threads", 1)))
        attached = AttachedData(setup["data"]) if setup.get("data") else None
        runtime = runtime_from_config_json(
            config_json,
            "worker configuration",
            dataset=None if attached is None else attached.dataset,
        )
    except BaseException as exc:
        _send_or_go(conn, encode_frame({"error": f"start-up failed: {one_line(exc)}"}))
        return
    # The process is the run's own: its denormal handling is set for its lifetime, so that
    # each handler finds it set (ClientRuntime.handle then only checks it).
    denormals = apply_denormals(runtime.denormals or LEGACY_DENORMALS)
    ready = {
        "ready": True,
        "threads": torch.get_num_threads(),
        "data": data_kind(runtime, attached),
        "denormals": denormals,
        "together": runtime.clients_together,
    }
    _send_or_go(conn, encode_frame(ready))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            return
        try:
            meta, msg, state = decode_frame(data)
            if meta.get("stop"):
                _leave()
            if "batch" in meta:
                # The frames of the batch's clients follow: read them all before anything can
                # fail, so that none is left in the pipe to be taken for the next task.
                tasks = [conn.recv_bytes() for _ in range(int(meta["batch"]))]
                outs = handle_batch(runtime, int(meta["round"]), tasks)
            else:
                if msg is None or state is None:
                    raise FedskewError("a task without a message or a state")
                cid = int(meta["client"])
                reply = runtime.handle(cid, int(meta["round"]), msg, state)
                outs = [encode_frame({"client": cid}, reply, state)]
        except (EOFError, OSError):  # the parent is gone mid-batch
            return
        except Exception as exc:
            if not isinstance(exc, FedskewError):
                # A bug, not a user error: its traceback goes to the terminal, the parent
                # stops the run with the one line.
                traceback.print_exc()
            outs = [encode_frame({"error": one_line(exc)})]
        try:
            for out in outs:
                conn.send_bytes(out)
        except (EOFError, OSError):
            return


def handle_batch(runtime: ClientRuntime, rnd: int, tasks: list[bytes]) -> list[bytes]:
    """A batch of clients' tasks, trained together where the algorithm allows it (one after
    another otherwise, as in-process); one reply frame per client, in the batch's order."""
    messages: dict[int, Message] = {}
    states: dict[int, ClientState] = {}
    for task in tasks:
        meta, msg, state = decode_frame(task)
        if msg is None or state is None:
            raise FedskewError("a task without a message or a state")
        cid = int(meta["client"])
        messages[cid], states[cid] = msg, state
    replies = runtime.handle_together(rnd, messages, states) if len(messages) > 1 else None
    if replies is None:
        replies = {cid: runtime.handle(cid, rnd, messages[cid], states[cid]) for cid in messages}
    return [encode_frame({"client": cid}, replies[cid], states[cid]) for cid in messages]


def share(dataset: Dataset) -> SharedDataset | None:
    """The dataset in shared memory, or None where there is no room for it: the workers
    then load their own copies."""
    if not shared_memory_available(dataset_nbytes(dataset)):
        log.warning("no room for the dataset in %s: each worker loads its own copy", SHM_DIR)
        return None
    try:
        return SharedDataset.create(dataset)
    except OSError as exc:  # filled up meanwhile, or refused
        log.warning(
            "the dataset could not go into %s (%s): each worker loads its own copy",
            SHM_DIR, exc.strerror or exc,
        )  # fmt: skip
        return None


def data_kind(runtime: ClientRuntime, attached: AttachedData | None) -> str:
    """Where the worker's training and test tensors live: "shared" (views of the parent's
    shared memory), "copied" (shared memory was given, but the runtime holds copies) or
    "loaded" (the worker loaded the data itself)."""
    if attached is None:
        return "loaded"
    tensors = [runtime.data.x, runtime.data.y, *(runtime.test or ())]
    return "shared" if all(attached.holds(t) for t in tensors) else "copied"


# ---------------------------------------------------------------------------- parent

# What a worker holds besides the dataset: torch, the scratch model, batches (a FedAvg
# worker on Fashion-MNIST peaks near 500 MiB with ~220 MiB of data; benchmarks/scale.py).
WORKER_OVERHEAD_BYTES = 350 * 2**20


def worker_bytes(work: TrainingWork | None = None) -> int:
    """What one worker holds besides the dataset: the overhead measured with a small model
    (torch itself, mostly), plus the model's weights, gradients, momentum and a received
    copy (4x the parameters) and one batch's layer outputs and their gradients (2x), which
    grow with the model (an estimate, ``fedskew.models.cost``)."""
    if work is None:
        return WORKER_OVERHEAD_BYTES
    return WORKER_OVERHEAD_BYTES + 4 * work.model_bytes + 2 * work.activation_bytes


def affordable_workers(
    dataset_bytes: int, shared: bool = True, per_worker: int = WORKER_OVERHEAD_BYTES
) -> int:
    """How many workers fit in half of the memory available now (unbounded where that
    cannot be read): the dataset once in shared memory plus ``per_worker`` each, or
    (``shared`` False: workers that load the dataset themselves) a copy each."""
    available = available_memory_bytes()
    if available is None:
        return sys.maxsize
    budget = int(0.5 * available)
    if shared:
        return max(0, budget - dataset_bytes) // per_worker
    return budget // (dataset_bytes + per_worker)


_GUARD = re.compile(r"""__name__\s*==\s*["']__main__["']|["']__main__["']\s*==\s*__name__""")


def main_allows_spawn() -> bool:
    """Whether starting a worker process is safe from the main module: ``spawn`` runs the
    main script again in each worker (as ``__mp_main__``), and a script that starts a run
    outside an ``if __name__ == "__main__":`` guard would start it again there. Safe:
    interactive sessions and ``python -c`` (no script), packages' ``__main__`` modules
    (multiprocessing skips them), and scripts whose text holds the guard."""
    main = sys.modules.get("__main__")
    if main is None:
        return True
    spec_name = getattr(getattr(main, "__spec__", None), "name", None) or ""
    if spec_name == "__main__" or spec_name.endswith(".__main__"):
        return True
    path = getattr(main, "__file__", None)
    if not path:
        return True
    if os.path.splitext(os.path.basename(path))[0] == "__main__":
        return True
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            text = fh.read(1_000_000)
    except OSError:
        return False
    return _GUARD.search(text) is not None


class WorkerPoolEngine(ServerSideClientStates):
    """Carries an algorithm's messages to client handlers in N worker processes.

    An :class:`~fedskew.engines.base.Engine`; its ``close`` ends the workers and must be
    called (the run loop does it in a ``finally``).

    With ``client_sizes`` (training samples per client), an exchange hands out the largest
    clients first, so that a big client does not start last while the other workers idle;
    the order in which clients run does not change any result. ``threads``: torch threads
    per worker. ``dataset``: the run's dataset, as this process loaded it; on the CPU it
    goes into shared memory once and the workers map it (:attr:`worker_data` says
    "shared"), else each worker loads its own ("loaded"). :meth:`shared_tensors` gives
    this process the same tensors, so that it can drop its own copies.

    Workers are started with ``spawn``, which imports the main module again in each
    worker: a script that builds this engine (or calls ``run`` with ``workers`` >= 2) must
    do so under ``if __name__ == "__main__":``.
    """

    def __init__(
        self,
        cfg: ExperimentConfig,
        workers: int | None = None,
        client_sizes: list[int] | None = None,
        *,
        threads: int = 1,
        dataset: Dataset | None = None,
    ) -> None:
        count = cfg.workers if workers is None else workers
        if count < 1:
            raise FedskewError(f"the worker engine needs at least one worker, got {count}")
        if threads < 1:
            raise FedskewError(f"a worker needs at least one thread, got {threads}")
        super().__init__()
        self.worker_count = count
        self.client_sizes = client_sizes
        self.processes: list[Any] = []
        self.conns: list[Connection] = []
        self.worker_threads: list[int] = []  # as each worker reported them when ready
        self.worker_data: list[str] = []  # "shared", "loaded" (or "copied"): data_kind
        self._busy: dict[int, int] = {}  # worker index -> client it is working on
        self._closed = False
        self._shared: SharedDataset | None = None
        # Each worker resolves --clients-together for its own device (auto: together on a
        # GPU); where all of them train together, an exchange goes out as one batch of
        # clients per worker (_exchange_batches).
        config = {**cfg.to_dict(), "workers": 0, "engine": "inprocess", "quiet": True}
        devices = [worker_device(cfg.device, index) for index in range(count)]
        if any(d.startswith("cuda") for d in devices):
            self.worker_devices = tuple(devices)
        context = mp.get_context("spawn")
        try:
            on_host = not self.worker_devices and cfg.device in ("cpu", "auto")
            if dataset is not None and on_host:
                self._shared = share(dataset)
            setup = json.dumps(
                {"threads": threads, "data": None if self._shared is None else self._shared.header}
            )
            for index in range(count):
                parent_end, child_end = context.Pipe(duplex=True)
                worker_config = {**config, "device": devices[index]}
                process = context.Process(
                    target=worker_main,
                    args=(child_end, json.dumps(worker_config), setup),
                    name=f"fedskew-worker-{index}",
                    daemon=True,  # never outlive the parent, even if close() is skipped
                )
                process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)
            self._await_ready()
            if self._shared is not None:
                # Every worker has mapped it: the file can go, the memory stays mapped.
                self._shared.unlink()
        except BaseException:
            self.close()
            raise

    def shared_tensors(self) -> dict[str, torch.Tensor] | None:
        """This process's views of the dataset in shared memory (x_train, y_train, x_test,
        y_test; values and layout of the dataset given), or None where it is not shared."""
        return None if self._shared is None else self._shared.views()

    def _await_ready(self) -> None:
        waiting = set(range(len(self.processes)))
        threads: dict[int, int] = {}
        data: dict[int, str] = {}
        together: dict[int, str] = {}
        while waiting:
            ready = self._wait_any(waiting)
            for index in ready:
                meta, _, _ = self._receive(index, during="start-up")
                if "error" in meta:
                    raise FedskewError(f"worker {index}: {meta['error']}")
                threads[index] = int(meta.get("threads", 1))
                data[index] = str(meta.get("data", "loaded"))
                together[index] = str(meta.get("together", "off"))
                state = str(meta.get("denormals", "unknown"))
                self.client_denormals[state] = self.client_denormals.get(state, 0) + 1
                waiting.discard(index)
        self.worker_threads = [threads[i] for i in range(len(self.processes))]
        self.worker_data = [data[i] for i in range(len(self.processes))]
        modes = {together[i] for i in range(len(self.processes))}
        if len(modes) == 1 and modes <= set(TOGETHER):
            self.clients_together = modes.pop()

    def _wait_any(self, indices: set[int] | list[int]) -> list[int]:
        """Workers among ``indices`` with a frame to read (or that died); never blocks
        forever on a dead worker."""
        while True:
            handles: dict[Any, int] = {}
            for index in indices:
                handles[self.conns[index]] = index
                handles[self.processes[index].sentinel] = index
            ready = wait(list(handles), timeout=POLL_SECONDS)
            found = sorted({handles[h] for h in ready})
            if found:
                return found
            dead = [i for i in indices if not self.processes[i].is_alive()]
            if dead:
                return dead

    def _receive(self, index: int, during: str) -> tuple[dict, Message | None, ClientState | None]:
        conn = self.conns[index]
        try:
            # A worker that died after writing its frame still delivers it.
            if conn.poll():
                return decode_frame(conn.recv_bytes())
        except (EOFError, OSError):
            pass
        raise self._died(index, during)

    def _died(self, index: int, during: str) -> FedskewError:
        process = self.processes[index]
        process.join(timeout=1.0)
        return FedskewError(f"worker {index} died during {during} (exit code {process.exitcode})")

    def exchange(
        self, messages: Mapping[int, Message], expect: Expected | None = None
    ) -> dict[int, Message]:
        if self._closed:
            raise FedskewError("the worker engine is closed")
        try:
            replies = self._exchange(messages)
            refuse_unmet(self.round, replies, expect)
            return replies
        except BaseException:
            # A failed exchange leaves workers mid-task: end them all, the run is over.
            self.close()
            raise

    def _exchange(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        self.traffic.exchanges += 1
        if self.clients_together in TOGETHER and len(messages) > 1:
            return self._exchange_batches(messages)
        order = list(messages)
        if self.client_sizes is not None:
            sizes = self.client_sizes
            order.sort(key=lambda c: -sizes[c] if 0 <= c < len(sizes) else 0)
        pending = deque(order)
        idle = deque(range(len(self.processes)))
        replies: dict[int, Message] = {}
        while pending or self._busy:
            while pending and idle:
                index, cid = idle.popleft(), pending.popleft()
                msg = messages[cid]
                self.traffic.bytes_down += msg.nbytes()
                frame = encode_frame({"client": cid, "round": self.round}, msg, self.state_of(cid))
                self._busy[index] = cid
                try:
                    self.conns[index].send_bytes(frame)
                except OSError:
                    raise self._died(index, f"the task of client {cid}") from None
            for index in self._wait_any(list(self._busy)):
                cid = self._busy[index]
                meta, reply, state = self._receive(index, during=f"the task of client {cid}")
                if "error" in meta:
                    raise FedskewError(f"client {cid} failed in worker {index}: {meta['error']}")
                if reply is None or state is None or int(meta.get("client", -1)) != cid:
                    raise FedskewError(f"worker {index} answered client {cid} out of turn")
                del self._busy[index]
                self._states[cid] = state
                self.traffic.bytes_up += reply.nbytes()
                replies[cid] = reply
                idle.append(index)
        return {cid: replies[cid] for cid in messages}

    def batches(self, cids: list[int]) -> dict[int, list[int]]:
        """The clients each worker trains together: largest first, each to the worker with
        the fewest samples so far (the workers finish about together)."""
        sizes = self.client_sizes

        def size(cid: int) -> int:
            return sizes[cid] if sizes is not None and 0 <= cid < len(sizes) else 1

        load = [0] * len(self.processes)
        groups: dict[int, list[int]] = {i: [] for i in range(len(self.processes))}
        for cid in sorted(cids, key=lambda c: -size(c)):
            index = min(range(len(load)), key=lambda i: (load[i], i))
            groups[index].append(cid)
            load[index] += size(cid)
        return {i: g for i, g in groups.items() if g}

    def _exchange_batches(self, messages: Mapping[int, Message]) -> dict[int, Message]:
        """Each worker gets its batch of clients at once and trains them together."""
        pending = self.batches(list(messages))
        for index, cids in pending.items():
            frames = [encode_frame({"batch": len(cids), "round": self.round})]
            for cid in cids:
                self.traffic.bytes_down += messages[cid].nbytes()
                meta = {"client": cid, "round": self.round}
                frames.append(encode_frame(meta, messages[cid], self.state_of(cid)))
            self._busy[index] = cids[0]
            try:
                for frame in frames:
                    self.conns[index].send_bytes(frame)
            except OSError:
                raise self._died(index, f"the tasks of clients {cids}") from None
        replies: dict[int, Message] = {}
        while pending:
            for index in self._wait_any(list(pending)):
                cid = pending[index][0]
                meta, reply, state = self._receive(index, during=f"the task of client {cid}")
                if "error" in meta:
                    raise FedskewError(
                        f"clients {pending[index]} failed in worker {index}: {meta['error']}"
                    )
                if reply is None or state is None or int(meta.get("client", -1)) != cid:
                    raise FedskewError(f"worker {index} answered client {cid} out of turn")
                self._states[cid] = state
                self.traffic.bytes_up += reply.nbytes()
                replies[cid] = reply
                pending[index].pop(0)
                if pending[index]:
                    self._busy[index] = pending[index][0]
                else:
                    del pending[index], self._busy[index]
        return {cid: replies[cid] for cid in messages}

    def close(self) -> None:
        """End the workers: idle ones are asked to stop, busy ones are terminated."""
        if self._closed:
            return
        self._closed = True
        for index, (process, conn) in enumerate(zip(self.processes, self.conns, strict=True)):
            if index in self._busy or not process.is_alive():
                process.terminate()
                continue
            try:
                conn.send_bytes(encode_frame({"stop": True}))
            except OSError:
                process.terminate()
        for process in self.processes:
            process.join(timeout=STOP_SECONDS)
            if process.is_alive():
                process.terminate()
                process.join(timeout=STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        self._busy.clear()
        if self._shared is not None:
            self._shared.unlink()

    def __enter__(self) -> WorkerPoolEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
