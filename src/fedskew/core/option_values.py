"""The spellings of the options that name torch settings (device, precision, denormals),
checked without importing torch: ``fedskew.config`` declares and checks every option, and
``fedskew --help`` or ``fedskew list`` build on it, which should take a fraction of a second
rather than torch's import (about 1.5 s of CPU). The modules that apply the settings
(``device``, ``precision``, ``denormals``) import these names from here."""

from __future__ import annotations

import re

from fedskew.core.errors import UsageError

DEVICE_SPEC = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")
DEVICE_TEXT = "auto, cpu, cuda or cuda:N"

PRECISIONS = ("fp32", "bf16")

DENORMALS = ("flush", "keep")
# What a run folder written before the option existed ran with (torch's default).
LEGACY_DENORMALS = "keep"


def check_device_spec(value: object) -> str:
    """``value`` if it is a device option (auto, cpu, cuda, cuda:N), else a one-line error.

    Only the spelling is checked here: whether CUDA exists is the business of the process
    that resolves it (:func:`fedskew.core.device.resolve_device`)."""
    if not isinstance(value, str) or not DEVICE_SPEC.match(value.strip().lower()):
        raise UsageError(f"device must be {DEVICE_TEXT}, got {value!r}")
    return value.strip().lower()


def check_precision(value: object) -> str:
    """``value`` if it names a precision, else a one-line UsageError."""
    if value not in PRECISIONS:
        raise UsageError(f"precision must be one of {', '.join(PRECISIONS)}, got {value!r}")
    return str(value)


def check_denormals(value: object) -> str:
    """``value`` if it names a denormal policy, else a one-line UsageError."""
    if value not in DENORMALS:
        raise UsageError(f"denormals must be one of {', '.join(DENORMALS)}, got {value!r}")
    return str(value)
