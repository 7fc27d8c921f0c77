"""glibc's malloc settings for the whole process: off unless the user asks for them.

They stop a CPU training step from faulting the memory of torch's temporaries in again every
step (docs/performance.md: what they buy, what they cost). Being process-wide (inherited by
forked DataLoader workers, overriding a user's MALLOC_* / GLIBC_TUNABLES), they are applied
only on request: `HostMallocKwargs()` in `Accelerator(kwargs_handlers=[...])`, or
ACCELERATE_C_MALLOC_TUNING=1. The handler, when given, decides; the variable is checked either
way. Applied once asked, they stay for the life of the process.
"""
from __future__ import annotations

import os
import warnings

from . import _C

ENV = "ACCELERATE_C_MALLOC_TUNING"

# mallopt() parameter -> value, in the order they are applied
SETTINGS = {
    "M_MMAP_THRESHOLD": 32 << 20,  # blocks up to 32 MiB (glibc's ceiling) come from the heap
    "M_TRIM_THRESHOLD": 1 << 30,  # up to 1 GiB of free heap top is kept, not given back
    "M_TOP_PAD": 64 << 20,  # the heap grows 64 MiB at a time
}

# the same settings through glibc's environment variables, read once at process start (what a
# launcher or a benchmark sets to give torch alone, or every contender, the same)
GLIBC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": SETTINGS["M_MMAP_THRESHOLD"],
    "MALLOC_TRIM_THRESHOLD_": SETTINGS["M_TRIM_THRESHOLD"],
    "MALLOC_TOP_PAD_": SETTINGS["M_TOP_PAD"],
}


def env_requested() -> bool:
    """ACCELERATE_C_MALLOC_TUNING: unset, "" or "0" (the default): no; "1": yes; anything else
    raises, naming the variable and the value."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 (the default: glibc's own malloc settings) or 1 "
                         "(apply accelerate_c's malloc settings to the whole process; docs/performance.md)")
    return value == "1"


def requested(handler=None) -> bool:
    """Whether the Accelerator applies the settings: the handler's `enabled` when one is given,
    else the environment variable (which is validated in both cases)."""
    from_env = env_requested()
    return bool(handler.enabled) if handler is not None else from_env


def apply(handler=None) -> bool:
    """Applies the settings when requested(handler); returns whether they were applied. Where
    the C library is not glibc an explicit request warns and changes nothing."""
    if not requested(handler):
        return False
    if _C.tune_host_malloc(*SETTINGS.values()):
        return True
    how = "HostMallocKwargs(enabled=True)" if handler is not None else f"{ENV}=1"
    warnings.warn(f"{how}: the C library is not glibc, so its malloc settings were left as they are", stacklevel=3)
    return False
