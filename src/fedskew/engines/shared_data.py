"""A run's dataset in shared memory: written once by the parent, mapped by every worker.

Worker processes used to build their data from the run's configuration, each holding its
own copy of the training and test tensors. On the CPU the parent now writes those tensors
once into a file under ``/dev/shm`` (memory, not disk), and each worker maps that file
read-only and builds its tensors as views of the mapping: the dataset takes its memory
once, however many workers there are.

What a worker needs to find its tensors travels in its start-up configuration as JSON:
the file, its size, and for each tensor its dtype, shape, strides and byte offset (no
pickle). The tensors keep their exact strides (``channels_last`` included), so a worker
computes on tensors laid out as the parent's, as a worker that loaded the data itself did.

Nothing in training writes into the dataset tensors (batches are gathered copies; the test
set is read in slices by evaluation): a worker maps the file read-only, so a write there
would fail loudly instead of changing other workers' data. The parent's own views (see
:meth:`SharedDataset.views`) are a private copy-on-write mapping: a write in the parent
stays in the parent.

The file is removed as soon as every worker has mapped it (the memory stays until the last
mapping goes), when the engine closes, and when its start-up fails. Between its creation
and that removal it is registered with multiprocessing's resource tracker, a separate
process that removes it if the parent is killed before it could.
"""

from __future__ import annotations

import mmap
import os
import secrets
import warnings
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedskew.core.errors import FedskewError
from fedskew.data.datasets import Dataset

SHM_DIR = Path("/dev/shm")
PREFIX = "fedskew-data-"
ALIGN = 64  # each tensor starts on a cache line, as torch's own allocations do
TENSORS = ("x_train", "y_train", "x_test", "y_test")
# os.pwrite writes at most this much at once (Linux caps one write near 2 GiB).
_WRITE_CHUNK = 1 << 30


def shared_memory_available(nbytes: int = 0) -> bool:
    """Whether this machine has a shared-memory file system with room for ``nbytes`` (a
    container's /dev/shm is often small: 64 MiB under Docker's default)."""
    if not (SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK)):
        return False
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return False
    # Room for the tensors, their alignment and the partition's indices, with a margin.
    return stat.f_bavail * stat.f_frsize >= nbytes + nbytes // 8 + 2**20


def dataset_nbytes(dataset: Dataset) -> int:
    """Bytes of the dataset's tensors (inputs and labels, training and test)."""
    return sum(_tensor(dataset, name).nbytes for name in TENSORS)


def _tensor(dataset: Dataset, name: str) -> torch.Tensor:
    return getattr(dataset, name)


def _is_dense(t: torch.Tensor) -> bool:
    """Whether the tensor's elements fill one block of memory in some dimension order
    (contiguous, channels_last, a transpose...), so that its bytes are that block."""
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.size(d) > 1), key=t.stride):
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def _block(t: torch.Tensor) -> torch.Tensor:
    """The tensor's memory block as flat bytes (a view, no copy)."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset()).view(torch.uint8)


class SharedDataset:
    """The parent's side: the file, what workers need to map it, and its removal."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header
        self._tracked = True
        self._views: dict[str, torch.Tensor] | None = None

    @classmethod
    def create(cls, dataset: Dataset) -> SharedDataset:
        """Write the dataset's tensors into a new file under ``/dev/shm``."""
        tensors: dict[str, torch.Tensor] = {}
        for name in TENSORS:
            t = _tensor(dataset, name).detach()
            if t.device.type != "cpu":
                raise FedskewError(f"the dataset's {name} is on {t.device}, not in host memory")
            tensors[name] = t if _is_dense(t) else t.contiguous()
        natural = dataset.natural_partition
        if natural is not None:
            sizes = np.array([len(p) for p in natural], dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in natural])
            tensors["natural_partition"] = torch.from_numpy(flat)
            tensors["natural_offsets"] = torch.from_numpy(offsets)
        specs: list[dict[str, Any]] = []
        offset = 0
        for name, t in tensors.items():
            specs.append({
                "name": name, "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "stride": list(t.stride()),
                "offset": offset, "nbytes": t.nbytes,
            })  # fmt: skip
            offset += -(-t.nbytes // ALIGN) * ALIGN
        size = max(offset, 1)
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        # From here on the file exists: a kill of this process leaves its removal to the
        # resource tracker (a process of its own), any error removes it at once.
        resource_tracker.register(f"/{name}", "shared_memory")
        shared = cls(path, {})
        try:
            os.ftruncate(fd, size)
            for spec, t in zip(specs, tensors.values(), strict=True):
                if t.numel():
                    _write_all(fd, _block(t).numpy(), spec["offset"])
            shared.header = {
                "path": str(path),
                "size": size,
                "arrays": specs,
                "dataset": {
                    "name": dataset.name,
                    "num_classes": dataset.num_classes,
                    "input_shape": list(dataset.input_shape),
                    "class_names": list(dataset.class_names),
                    "source": dataset.source,
                },
            }
            # The parent's own views: private (copy-on-write), so nothing the parent
            # might write reaches the workers.
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE)
            shared._views = _views(mapping, specs)
        except BaseException:
            shared.unlink()
            raise
        finally:
            os.close(fd)
        return shared

    def views(self) -> dict[str, torch.Tensor]:
        """The parent's tensors over the shared memory (x_train, y_train, x_test, y_test):
        the parent can drop its own copies and use these."""
        assert self._views is not None
        return {name: self._views[name] for name in TENSORS}

    def unlink(self) -> None:
        """Remove the file (idempotent); mappings keep their memory until they go."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        if self._tracked:
            self._tracked = False
            resource_tracker.unregister(f"/{self.path.name}", "shared_memory")


def _write_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + _WRITE_CHUNK], offset + done)


def _views(buffer: Any, specs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        # A read-only mapping: torch warns that writing would be undefined (it would
        # fault, which is the point).
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for spec in specs:
            dtype = getattr(torch, str(spec["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise FedskewError(f"shared data: unknown dtype {spec['dtype']!r}")
            shape, stride = [int(s) for s in spec["shape"]], [int(s) for s in spec["stride"]]
            count = int(np.prod(shape, dtype=np.int64))
            if count == 0:
                out[spec["name"]] = torch.empty_strided(shape, stride, dtype=dtype)
                continue
            flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=int(spec["offset"]))
            out[spec["name"]] = flat.as_strided(shape, stride)
    return out


class AttachedData:
    """A worker's side: the dataset as views of the read-only mapping."""

    def __init__(self, header: dict[str, Any]) -> None:
        path = Path(str(header["path"]))
        if path.parent != SHM_DIR or not path.name.startswith(PREFIX):
            raise FedskewError(f"shared data: {path} is not a fedskew shared-memory file")
        size = int(header["size"])
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if os.fstat(fd).st_size != size:
                raise FedskewError(f"shared data: {path} has {os.fstat(fd).st_size} bytes, "
                                   f"not {size}")  # fmt: skip
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.size = size
        self.address = np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data
        tensors = _views(mapping, header["arrays"])
        meta = header["dataset"]
        natural = None
        if "natural_partition" in tensors:
            flat, offsets = tensors["natural_partition"].numpy(), tensors["natural_offsets"]
            bounds = offsets.tolist()
            # Index arrays, small beside the data: copied, so that they are ordinary
            # writable arrays as a loader returns them.
            natural = [flat[a:b].copy() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        self.dataset = Dataset(
            name=str(meta["name"]),
            x_train=tensors["x_train"],
            y_train=tensors["y_train"],
            x_test=tensors["x_test"],
            y_test=tensors["y_test"],
            num_classes=int(meta["num_classes"]),
            input_shape=tuple(int(s) for s in meta["input_shape"]),
            class_names=[str(c) for c in meta["class_names"]],
            source=str(meta["source"]),
            natural_partition=natural,
        )

    def holds(self, t: torch.Tensor) -> bool:
        """Whether the tensor's memory lies inside the mapping (no copy was made)."""
        if t.numel() == 0:
            return True
        start = t.data_ptr()
        return self.address <= start and start + t.nbytes <= self.address + self.size
