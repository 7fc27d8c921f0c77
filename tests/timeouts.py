"""How long a test waits before it calls a subprocess or a collective hung.

Every test names the seconds its wait needs on this project's 2-core machine when it is idle;
`wait_s` stretches them for a machine that is slower or busy (the suite must pass with other
processes keeping every core busy, e.g. `stress-ng --cpu 2`, and beside itself in pytest-xdist
workers). These are limits for detecting a
hang, never a measure of speed: no test asserts on elapsed time.

AC_TEST_TIME_SCALE overrides the factor (e.g. 10 under a sanitizer or an emulator).
"""
from __future__ import annotations

import os


def _factor() -> float:
    given = os.environ.get("AC_TEST_TIME_SCALE", "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"AC_TEST_TIME_SCALE={given!r}: expected a number of times (e.g. 3)") from None
        if not value > 0:
            raise ValueError(f"AC_TEST_TIME_SCALE={given!r}: must be > 0")
        return value
    # 3x the idle 2-core time, for a hog on every core (a stress-ng --cpu 2 run beside the suite,
    # with other work, did not hit any of these waits; the factor is a margin, not a measured
    # slowdown); fewer cores are slower still
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # under pytest-xdist (make test: 2 workers) the other workers' tests share the cores too
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return 3.0 * max(1.0, 2.0 / cpus) * max(1, workers)


FACTOR = _factor()


def wait_s(seconds: float) -> float:
    """`seconds` (the idle 2-core need) scaled to this machine."""
    return seconds * FACTOR
