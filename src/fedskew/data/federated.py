"""FederatedData: the dataset's tensors held once, plus one index array per client.

The tensors and the clients' index tensors live on the run's device (``fedskew.assembly.prepare``
puts them there once); a batch is gathered there, with no copy from host memory per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ClientData:
    """One client's training data: indices into tensors held once for all clients."""

    x: torch.Tensor  # all training inputs, already normalised
    y: torch.Tensor  # all training labels (int64)
    indices: torch.Tensor  # this client's rows (int64)
    num_classes: int

    def __post_init__(self) -> None:
        self._labels: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        """Where this client's data (and so its batches) live."""
        return self.indices.device

    @property
    def labels(self) -> torch.Tensor:
        if self._labels is None:
            self._labels = self.y.index_select(0, self.indices)
        return self._labels

    def class_counts(self) -> torch.Tensor:
        return torch.bincount(self.labels, minlength=self.num_classes)

    def batch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the given positions (0..len-1) of this client's data.

        ``rows`` may be in host memory (a permutation drawn by an addressed CPU generator):
        it is moved to the data's device first (nothing happens when it is there already)."""
        idx = self.indices.index_select(0, rows.to(self.indices.device))
        return gather_rows(self.x, idx), self.y.index_select(0, idx)


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for a 1-D index: the same values, shape and strides (so the layers that
    read the batch run the same kernels), gathered with ``index_select`` over rows that lie
    whole in memory: ``x`` itself when it is contiguous, its NHWC view when it is a
    channels_last batch of images (plain ``index_select`` would return the default layout
    there). Advanced indexing computes every element's offset: about 3x slower for a
    64-image Fashion-MNIST batch on a 2-core CPU (benchmarks/round_profile.py). Other
    layouts, and an empty index (advanced indexing gives its empty result other strides),
    take advanced indexing itself."""
    if idx.numel() > 0:
        if _contiguous_strides(x.shape, x.stride()):
            return x.index_select(0, idx)
        if x.dim() == 4:
            nhwc = x.permute(0, 2, 3, 1)
            if _contiguous_strides(nhwc.shape, nhwc.stride()):
                return nhwc.index_select(0, idx).permute(0, 3, 1, 2)
    return x[idx]


def _contiguous_strides(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` is exactly the row-major stride of ``shape`` (size-1 dimensions
    included, unlike ``Tensor.is_contiguous``)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride), strict=True):
        if step != expected:
            return False
        expected *= size
    return True


class FederatedData:
    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        partition: list[np.ndarray],
        num_classes: int,
        local_test: list[np.ndarray] | None = None,
    ) -> None:
        self.x = x
        self.y = y
        self.partition = partition
        self.num_classes = num_classes
        # Each client's held-out rows (fedskew.data.local_test); None: no local split.
        self.local_test = local_test
        self._clients: dict[int, ClientData] = {}
        self._tests: dict[int, ClientData] = {}

    @property
    def num_clients(self) -> int:
        return len(self.partition)

    def forget_clients(self) -> None:
        """Drop the clients' cached data, after ``x`` or ``y`` was replaced."""
        self._clients.clear()
        self._tests.clear()

    def sizes(self) -> list[int]:
        return [len(p) for p in self.partition]

    def client(self, cid: int) -> ClientData:
        # Built on first use, so 10,000 mostly idle clients cost only their index arrays.
        return self._view(self._clients, self.partition, cid)

    def client_test(self, cid: int) -> ClientData | None:
        """Client ``cid``'s local test split, or None when the run has none."""
        if self.local_test is None:
            return None
        return self._view(self._tests, self.local_test, cid)

    def _view(self, cache: dict[int, ClientData], parts: list[np.ndarray], cid: int) -> ClientData:
        data = cache.get(cid)
        if data is None:
            idx = torch.from_numpy(np.ascontiguousarray(parts[cid], dtype=np.int64))
            idx = idx.to(self.x.device)
            data = cache[cid] = ClientData(self.x, self.y, idx, self.num_classes)
        return data

    def class_counts(self) -> np.ndarray:
        """(clients, classes) matrix of training samples."""
        labels = self.y.cpu().numpy()
        counts = np.zeros((self.num_clients, self.num_classes), dtype=np.int64)
        for k, idx in enumerate(self.partition):
            counts[k] = np.bincount(labels[idx], minlength=self.num_classes)
        return counts


def sample_clients(seed: int, rnd: int, num_clients: int, per_round: int) -> list[int]:
    """The clients of round ``rnd``: a pure function of the seed, so every algorithm
    and every engine sees the same clients."""
    from fedskew.core.rng import numpy_rng

    if per_round >= num_clients:
        return list(range(num_clients))
    chosen = numpy_rng(seed, rnd, -1, "client-sampling").choice(
        num_clients, per_round, replace=False
    )
    return sorted(int(c) for c in chosen)
