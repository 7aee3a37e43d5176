"""Where a run computes: the device option, its validation, and the CUDA execution settings.

``device`` is ``auto`` (CUDA when this process sees a CUDA device, else the CPU), ``cpu``,
``cuda`` (the current CUDA device, normally the first visible one) or ``cuda:N``. It is
resolved in each process that trains or evaluates (the run loop, a worker process, a Flower
node), so ``auto`` means "this process's GPU if it has one".

The execution settings only matter on CUDA:

* ``tf32``: whether float32 matrix products and convolutions may use TF32 tensor cores (10-bit
  mantissa products, faster on Ampere and later). Off by default, so that ``fp32`` means fp32
  on every device; PyTorch's own default leaves it on for cuDNN convolutions.
* ``deterministic``: ``torch.use_deterministic_algorithms(True)`` and cuDNN's benchmark mode
  off. cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) for reproducible
  products, read once per process at its first cuBLAS call: importing ``fedskew`` sets it
  (unless the user set it), so any CUDA work after that import is covered. A process that used
  CUDA before importing fedskew gets a one-line error for a deterministic run, not PyTorch's
  at the first matrix product.

On the CPU, fedskew's training is deterministic already (one thread or many), and neither
setting changes a CPU result. The third switch, ``denormals`` (flush denormal floats to zero,
the default, or keep them), acts on the CPU only: see fedskew.core.denormals.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch

import fedskew.core.cuda_environment as cuda_environment
from fedskew.core.cuda_environment import CUBLAS_DETERMINISTIC, CUBLAS_VALUE, CUBLAS_VARIABLE
from fedskew.core.denormals import LEGACY_DENORMALS, apply_denormals, denormals_state
from fedskew.core.errors import UsageError
from fedskew.core.option_values import DEVICE_TEXT, check_device_spec  # noqa: F401 (re-exported)


def cuda_count() -> int:
    """CUDA devices this process sees (0 on a CPU build of torch or without a GPU)."""
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (RuntimeError, AssertionError):  # a driver that fails to initialise
        return 0


def resolve_device(spec: str) -> torch.device:
    """The device ``spec`` names in this process; a one-line UsageError when it asks for CUDA
    and this process has none (or not that many)."""
    spec = check_device_spec(spec)
    count = cuda_count()
    if spec == "cpu" or (spec == "auto" and count == 0):
        return torch.device("cpu")
    if count == 0:
        build = "a CPU-only build" if torch.version.cuda is None else "no visible CUDA device"
        raise UsageError(
            f"device {spec}: no CUDA device is available (torch {torch.__version__}, {build}); "
            "use --device cpu or auto"
        )
    if spec in ("auto", "cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    index = int(spec.split(":", 1)[1])
    if index >= count:
        raise UsageError(
            f"device {spec}: this process sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
        )
    return torch.device("cuda", index)


def device_name(device: torch.device) -> str:
    """A person's name for the device: the GPU's model for CUDA, "cpu" otherwise."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_name(index)
    return device.type


def device_facts(device: torch.device) -> dict[str, object]:
    """What a run folder records about the device a process computes on."""
    facts: dict[str, object] = {"device": str(device), "device_name": device_name(device)}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        facts["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        facts["cuda"] = torch.version.cuda
        facts["cudnn"] = torch.backends.cudnn.version()
    return facts


# TF32 through PyTorch's fp32_precision switches ("tf32", "ieee", or "none": inherit), not
# the legacy allow_tf32 flags: once a user has set the new switches, reading a legacy flag
# raises ("mix of the legacy and new APIs"), while the new ones read and set alike after
# either API (the legacy setters keep them in step). cuBLAS products and cuDNN convolutions.
_TF32_SWITCHES = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)


def tf32_state() -> tuple[str, str]:
    """The fp32 precision of CUDA matrix products and of cuDNN convolutions, as set now."""
    return tuple(switch.fp32_precision for switch in _TF32_SWITCHES)  # type: ignore[return-value]


def set_tf32_state(state: tuple[str, str]) -> None:
    """Set what :func:`tf32_state` reads (a state it read puts the switches back)."""
    for switch, precision in zip(_TF32_SWITCHES, state, strict=True):
        switch.fp32_precision = precision


@dataclass(frozen=True)
class ExecutionSettings:
    """The process-wide torch switches a run sets: TF32 and deterministic algorithms (how,
    not what, it computes) and the CPU's handling of denormal floats (fedskew.core.denormals;
    part of what it computes, like the precision)."""

    tf32: bool
    deterministic: bool
    # None: leave the process's denormal handling as it is (a client runtime scopes its own).
    denormals: str | None = LEGACY_DENORMALS

    @classmethod
    def current(cls) -> ExecutionSettings:
        state = denormals_state()
        return cls(
            tf32=tf32_state()[0] == "tf32",
            deterministic=torch.are_deterministic_algorithms_enabled(),
            # A pool left mixed by other code is put back as torch's default.
            denormals="flush" if state == "flush" else "keep",
        )


def apply_settings(settings: ExecutionSettings) -> None:
    """Set the TF32, determinism and denormal switches of this process (see the module
    docstring); the denormal one in this thread and its torch thread pool."""
    if settings.denormals is not None:
        apply_denormals(settings.denormals)
    if settings.deterministic:
        check_cublas_deterministic()
        torch.backends.cudnn.benchmark = False
    precision = "tf32" if settings.tf32 else "ieee"
    set_tf32_state((precision, precision))
    torch.backends.cudnn.deterministic = settings.deterministic
    torch.use_deterministic_algorithms(settings.deterministic)


def check_cublas_deterministic() -> None:
    """A one-line UsageError when cuBLAS cannot give this process reproducible products: the
    variable holds another value, or CUDA was in use before ``fedskew`` set it (cuBLAS reads
    it once). Checked before a deterministic run starts, not at its first matrix product.
    Without CUDA there is no cuBLAS, and nothing to check."""
    if cuda_count() == 0:
        return
    value = os.environ.get(CUBLAS_VARIABLE)
    if value not in CUBLAS_DETERMINISTIC:
        raise UsageError(
            f"deterministic: {CUBLAS_VARIABLE}={value!r} does not make cuBLAS reproducible; "
            f"unset it or set it to {CUBLAS_VALUE} (or :16:8)"
        )
    if cuda_environment.CUDA_BEFORE_IMPORT:
        raise UsageError(
            f"deterministic: this process used CUDA before importing fedskew, without "
            f"{CUBLAS_VARIABLE}; set {CUBLAS_VARIABLE}={CUBLAS_VALUE} in the environment or "
            "import fedskew before any CUDA work"
        )


@contextmanager
def settings_applied(settings: ExecutionSettings) -> Iterator[None]:
    """``settings`` for the duration of the block, the previous switches put back after it
    (a run inside a longer Python session must not leave them changed)."""
    before = ExecutionSettings.current()
    tf32 = tf32_state()
    cudnn_deterministic = torch.backends.cudnn.deterministic
    apply_settings(settings)
    try:
        yield
    finally:
        apply_settings(before)
        set_tf32_state(tf32)
        torch.backends.cudnn.deterministic = cudnn_deterministic


def to_device(arrays: Mapping[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """The same named tensors on ``device`` (the very tensors where they are there already)."""
    return {k: v.to(device, non_blocking=True) for k, v in arrays.items()}


def to_cpu(arrays: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same named tensors in host memory (a message or checkpoint must be device-free)."""
    return {k: v.cpu() for k, v in arrays.items()}
