"""Machine-readable target results, for `make bench`'s final table (benchmarks/summary.py).

Every benchmark calls `target(...)` for each of its targets (and `info(...)` for ratios it
prints without a target); with ACCELERATE_C_BENCH_RESULTS set to a directory, each call appends
one JSON line to DIR/<benchmark>.jsonl:

    {"bench": "bench_step", "run": "<pid>-<time>", "what": "...", "value": 1.004, "unit": "x",
     "goal": 0.99, "status": "PASS", "limit": "...", "note": "..."}

`status` is PASS / MISS (value >= goal) or INFO (no goal). `limit` is the physical limit the
benchmark measured beside the ratio (a memory or disk bandwidth, the loopback all-reduce), as
text, "" where there is none. Without the variable nothing is written. Standard library only.
"""
from __future__ import annotations

import json
import os
import time
from typing import List, Optional

ENV = "ACCELERATE_C_BENCH_RESULTS"
# tells this run's lines from an earlier run's; inherited by the benchmark's child processes
# (a worker rank, a fresh process for one part), so that their lines count as the same run
_RUN = os.environ.setdefault("ACCELERATE_C_BENCH_RUN", f"{os.getpid()}-{time.time():.0f}")


def fmt(value: float, unit: str) -> str:
    """A value as the tables print it: '1.004x', '83%', or the number and its unit."""
    if unit == "x":
        return f"{value:.3f}x"
    if unit == "%":
        return f"{100 * value:.0f}%"
    return f"{value:.3g} {unit}".rstrip()


def record(bench: str, what: str, value: float, goal: Optional[float], *, unit: str = "x", limit: str = "",
           note: str = "") -> str:
    """Appends one result line (when ACCELERATE_C_BENCH_RESULTS is set); returns its status."""
    status = "INFO" if goal is None else ("PASS" if value >= goal else "MISS")
    out_dir = os.environ.get(ENV)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        row = {"bench": bench, "run": _RUN, "what": what, "value": float(value), "unit": unit, "goal": goal,
               "status": status, "limit": limit, "note": note}
        with open(os.path.join(out_dir, f"{bench}.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    return status


def target(bench: str, what: str, value: float, goal: float, **kw) -> bool:
    """A target (value >= goal is a PASS); returns whether it passed."""
    return record(bench, what, value, goal, **kw) == "PASS"


def info(bench: str, what: str, value: float, **kw) -> None:
    """A ratio the benchmark reports without a target."""
    record(bench, what, value, None, **kw)


def load(out_dir: str) -> List[dict]:
    """Every result line under out_dir, keeping only each benchmark's latest run."""
    rows: List[dict] = []
    if not os.path.isdir(out_dir):
        return rows
    for name in sorted(os.listdir(out_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(out_dir, name)) as f:
            lines = [json.loads(ln) for ln in f if ln.strip()]
        if lines:
            last = lines[-1]["run"]
            rows += [r for r in lines if r["run"] == last]
    return rows
