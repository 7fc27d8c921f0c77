"""Shared helpers for the benchmarks: interleaved timed repeats, robust summaries, a table printer.

Kept dependency-free (standard library only) so every benchmark can import it:

    from _common import Contender, run_interleaved, Summary, print_table

A benchmark lists its contenders; `run_interleaved` runs one repeat of each in turn (A, B, C, A,
B, C, ...) so slow drifts of the machine (frequency, other tenants, page cache) hit all of them
alike, calls each contender's untimed `setup` right before its timed call, and returns the
seconds per repeat. `Summary.of` gives median and quartiles of those.
"""
from __future__ import annotations

import gc
import os
import platform
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

__all__ = [
    "Contender",
    "Summary",
    "run_interleaved",
    "quantile",
    "gbps",
    "verdict",
    "print_table",
    "cpu_model",
    "logical_cpus",
    "other_load",
    "load_sample",
    "other_load_between",
    "last_level_cache_bytes",
]


def quantile(xs: Sequence[float], q: float) -> float:
    """The q-quantile (0 <= q <= 1) with linear interpolation between order statistics
    (numpy's default), so the median of an even count is the mean of the middle two."""
    if not xs:
        raise ValueError("quantile of an empty sequence")
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Summary:
    """Median and quartiles of a list of timings (seconds)."""

    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float

    @classmethod
    def of(cls, xs: Sequence[float]) -> "Summary":
        return cls(len(xs), quantile(xs, 0.5), quantile(xs, 0.25), quantile(xs, 0.75), min(xs), max(xs))


@dataclass
class Contender:
    """One thing to time. `fn` is the timed call; `setup` (optional) runs untimed right before
    each call, e.g. to restore the input that `fn` modifies in place."""

    name: str
    fn: Callable[[], object]
    setup: Optional[Callable[[], object]] = None


def run_interleaved(
    contenders: Sequence[Contender],
    repeats: int,
    warmup: int = 1,
    timer: Callable[[], float] = time.perf_counter,
) -> Dict[str, List[float]]:
    """Runs `warmup` untimed rounds, then `repeats` timed rounds; each round runs every
    contender once. The order rotates from round to round (round r starts with contender r mod
    k), so no contender always runs first after the others or last before them. Returns {name:
    [seconds per repeat]}, index i of every list from the same round. The garbage collector is
    paused while timing so a collection cannot land inside one contender's call."""
    names = [c.name for c in contenders]
    if len(set(names)) != len(names):
        raise ValueError(f"contender names must be unique: {names}")
    times: Dict[str, List[float]] = {c.name: [] for c in contenders}
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        k = len(contenders)
        for r in range(warmup + repeats):
            for c in (contenders[(r + j) % k] for j in range(k)):
                if c.setup is not None:
                    c.setup()
                t0 = timer()
                c.fn()
                dt = timer() - t0
                if r >= warmup:
                    times[c.name].append(dt)
    finally:
        if was_enabled:
            gc.enable()
    return times


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], file=None) -> None:
    """Prints a plain-text table: first column left-aligned, the others right-aligned.
    Cells are printed with str(); format numbers before passing them."""
    file = file or sys.stdout
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        parts = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]
        return "  ".join(parts).rstrip()

    print(line(cells[0]), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells[1:]:
        print(line(r), file=file)
    file.flush()


RATE_HEADERS = ["contender", "steps/s med", "q1", "q3", "ms/step (1/med)", "step ms med", "q1", "q3"]


def rate_rows(names, rates: Dict[str, List[float]], per_step: Dict[str, List[float]]):
    """Rows for RATE_HEADERS: each contender's steps/s (median, quartiles over repeats) and its
    single steps' times (pooled over repeats)."""
    S = {n: Summary.of(rates[n]) for n in names}
    P = {n: Summary.of(per_step[n]) for n in names}
    return [[n, f"{S[n].median:.3f}", f"{S[n].q1:.3f}", f"{S[n].q3:.3f}", f"{1e3 / S[n].median:.1f}",
             f"{P[n].median * 1e3:.1f}", f"{P[n].q1 * 1e3:.1f}", f"{P[n].q3 * 1e3:.1f}"] for n in names]


def cpu_model() -> str:
    """The CPU's model name where Linux tells it, else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def logical_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def last_level_cache_bytes(default: int = 256 << 20) -> int:
    """Size of the largest CPU cache Linux reports (sysfs), else `default`. A benchmark that
    wants cold caches can write a scratch buffer of about twice this between repeats."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for d in os.listdir(base):
            try:
                with open(os.path.join(base, d, "size")) as f:
                    txt = f.read().strip()
            except OSError:
                continue
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1:], 1)
            best = max(best, int(txt.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or default


def load_sample():
    """A snapshot for other_load_between(); None where /proc is not available."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        v = [int(x) for x in lines[0].split()[1:]]
        ncpu = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    # /proc/stat: user nice system idle iowait irq softirq steal; busy counts steal too
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)
    # self: utime + stime, plus cutime + cstime of the children it waited for (benchmarks that
    # run contenders in child processes must not count them as other load)
    return busy, sum(v[:8]), sum(int(x) for x in fields[11:15]), ncpu


def other_load_between(a, b) -> Optional[float]:
    """CPUs' worth of work done between two load_sample()s by other processes (and taken by the
    hypervisor as steal): 1.0 = one core busy elsewhere on average. A benchmark should warn when
    this is well above 0, as its numbers were then shared with something else."""
    if a is None or b is None or b[1] <= a[1]:
        return None
    return max(0.0, (b[0] - a[0]) - (b[2] - a[2])) / (b[1] - a[1]) * b[3]


def other_load(seconds: float = 0.5) -> Optional[float]:
    """other_load_between() over a short sleep: how busy the machine is before starting."""
    a = load_sample()
    time.sleep(seconds)
    return other_load_between(a, load_sample())


def fsync_path(path) -> None:
    """fsyncs a file, or every file below a directory and the directory itself: what makes a
    contender's output durable inside the timed region when it does not fsync by itself."""
    targets = [path]
    if os.path.isdir(path):
        targets = [os.path.join(root, n) for root, _dirs, files in os.walk(path) for n in files] + [path]
    for t in targets:
        fd = os.open(t, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def bytes_table(title: str, times: dict, ours_name: str, nbytes: int, repeats: int) -> dict:
    """Prints one I/O table (ms median, quartiles, GB/s, their time / ours) and returns the
    summaries by contender."""
    s = {k: Summary.of(v) for k, v in times.items()}
    mine = s[ours_name].median
    rows = [[name, f"{x.median * 1e3:.0f}", f"{x.q1 * 1e3:.0f}-{x.q3 * 1e3:.0f}", f"{nbytes / x.median / 1e9:.2f}",
             f"{x.median / mine:.2f}x"] for name, x in s.items()]
    print(f"\n{title} (median of {repeats}; 'vs ours' = their time / our time, > 1: ours is faster)")
    print_table(["contender", "ms", "q1-q3 ms", "GB/s", "vs ours"], rows)
    return s


def launch_on(world: int, script: str, argv) -> int:
    """Runs `script --worker *argv` on `world` CPU processes through accelerate_c's launcher
    (a free port, none of this process's torchrun variables); returns the exit status."""
    import shutil
    import subprocess
    import sys

    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable)) or shutil.which("accelerate-c")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    cmd = [exe, "launch", "--num_processes", str(world), "--cpu", "--main_process_port", "0",
           os.path.abspath(script), "--worker", *[str(a) for a in argv]]
    return subprocess.call(cmd, env=env)
