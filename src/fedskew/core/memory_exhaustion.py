"""Memory exhaustion, said in one line: what was asked and what the machine has.

A run asked for more memory than there is (100,000 clients' states, a model of tens of
gigabytes, a huge batch) ends in Python's ``MemoryError``, NumPy's "Unable to allocate", or
PyTorch's allocator error (CPU or CUDA), each with a traceback from deep inside the library.
The command line turns any of them into one line with the size asked for, where it is known,
and the memory available on the machine (or the GPU).
"""

from __future__ import annotations

import re

# PyTorch CPU: "you tried to allocate 524288 bytes"; CUDA: "Tried to allocate 20.00 GiB";
# NumPy: "Unable to allocate 25.0 GiB for an array with shape (...)".
_ASKED = (
    re.compile(r"tried to allocate (\d+) bytes", re.I),
    re.compile(r"tried to allocate ([\d.]+ [KMGT]i?B)", re.I),
    re.compile(r"unable to allocate ([\d.]+ [KMGT]i?B)", re.I),
)
_CPU_ALLOCATOR = ("can't allocate memory", "DefaultCPUAllocator", "std::bad_alloc")


def is_memory_exhaustion(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    if type(exc).__name__ == "OutOfMemoryError":  # torch.cuda's, without importing torch
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in _CPU_ALLOCATOR)


def asked(text: str) -> str | None:
    """The allocation the error names, as text ("2.0 GiB"), or None."""
    for pattern in _ASKED:
        m = pattern.search(text)
        if m:
            value = m.group(1)
            return f"{int(value) / 2**30:.2f} GiB" if value.isdigit() else value
    return None


def available_memory() -> str:
    """The machine's available and total memory, from /proc/meminfo where there is one."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info = dict(line.split(":", 1) for line in fh if ":" in line)
        kib = {k: int(info[k].split()[0]) for k in ("MemAvailable", "MemTotal")}
    except (OSError, ValueError, KeyError):
        return "the machine's free memory is unknown"
    return f"{kib['MemAvailable'] / 2**20:.1f} GiB available of {kib['MemTotal'] / 2**20:.1f} GiB"


def memory_line(exc: BaseException) -> str:
    """One line for a memory error: the request, what there is, and what to change."""
    size = asked(str(exc))
    what = f"an allocation of {size}" if size else "an allocation"
    where = "GPU" if type(exc).__name__ == "OutOfMemoryError" else "host"
    have = available_memory() if where == "host" else "see nvidia-smi for the GPU's memory"
    return (
        f"out of {where} memory: {what} failed ({have}); use fewer clients, a smaller model "
        "or batch, or a machine with more memory"
    )
