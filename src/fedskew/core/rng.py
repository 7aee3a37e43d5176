"""Addressed randomness.

Every random draw in fedskew comes from a generator derived from an address
(seed, round, client, purpose) instead of a global stream consumed in execution
order. Results then do not depend on which engine runs the clients, in which
order, or in how many processes, and a resumed run continues exactly.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a generator is made: partitions need numpy only
    import torch

SERVER = -1  # client address used for server-side draws


def _purpose_key(purpose: str) -> int:
    # crc32 is stable across processes and Python versions, unlike hash().
    return zlib.crc32(purpose.encode("utf-8"))


def address_entropy(seed: int, round_: int, client: int, purpose: str) -> list[int]:
    # SeedSequence entropy must be non-negative: shift the client and round addresses by 1
    # so that SERVER (-1) and "before training" (-1) stay representable.
    return [int(seed), int(round_) + 1, int(client) + 1, _purpose_key(purpose)]


def derive_seed(seed: int, round_: int = -1, client: int = SERVER, purpose: str = "") -> int:
    """A 63-bit integer seed for the address (seed, round, client, purpose)."""
    ss = np.random.SeedSequence(address_entropy(seed, round_, client, purpose))
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(
    seed: int, round_: int = -1, client: int = SERVER, purpose: str = ""
) -> np.random.Generator:
    """A NumPy generator for one address."""
    return np.random.default_rng(
        np.random.SeedSequence(address_entropy(seed, round_, client, purpose))
    )


def torch_rng(
    seed: int, round_: int = -1, client: int = SERVER, purpose: str = "", device: str = "cpu"
) -> torch.Generator:
    """A torch generator for one address."""
    import torch

    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, round_, client, purpose))
    return gen
