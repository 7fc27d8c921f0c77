"""Sums the fuzz runs into the tables of docs/security.md: per target and engine, the runs, the
executions (C) or examples (Python), the seconds and the runs stopped by a finding; then per target
against the goal (10^7 executions per C target, 20 minutes per Python target).

Three sources, added up:
  tests/fuzz/earlier_totals.json  the campaigns of 2026-12-03, whose per-run log was not kept (totals only)
  tests/fuzz/kept_runs.log        the per-run lines of later campaigns, committed with the totals
  tests/c/bin/fuzz/runs.log       this checkout's runs not kept yet (git-ignored; one line per run,
                                  written by tests/c/fuzz.sh and tests/fuzz/run_py.py)

    python tests/fuzz/totals.py [runs.log]
    python tests/fuzz/totals.py --keep   # first moves runs.log's lines to kept_runs.log (commit it)
"""
import argparse
import collections
import json
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
LOG = os.path.join(os.path.dirname(HERE), "c", "bin", "fuzz", "runs.log")
KEPT = os.path.join(HERE, "kept_runs.log")
EARLIER = os.path.join(HERE, "earlier_totals.json")
LINE = re.compile(r"^(\S+) (\S+) (\S+) (\d+|\?) (?:execs|examples) (\d+) s rc=(\d+)")
C_GOAL, PY_GOAL_S = 10 ** 7, 20 * 60
C_TARGETS = ("safetensors", "shard", "shm_header", "dlpack")
# a Python target's time includes its byte-level atheris variant where it has one
PY_TARGETS = {"config": ("py:config",), "config_bytes": ("py:config_bytes",),
              "deepspeed": ("py:deepspeed", "py:deepspeed_bytes"),
              "training_args": ("py:training_args", "py:training_args_bytes"), "load_state": ("py:load_state",),
              "model_index": ("py:model_index",), "zero_load_state": ("py:zero_load_state",)}


def read_log(path: str, tot=None) -> dict:
    """{(target, engine): [runs, executions, seconds, runs stopped by a finding]}, added to `tot`."""
    tot = collections.OrderedDict() if tot is None else tot
    if not os.path.exists(path):
        return tot
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            _, target, engine, n, secs, rc = m.groups()
            row = tot.setdefault((target, engine), [0, 0, 0, 0])
            row[0] += 1
            row[1] += int(n) if n != "?" else 0
            row[2] += int(secs)
            row[3] += int(rc) != 0
    return tot


def keep(log: str) -> int:
    """Appends the run lines of `log` to KEPT and empties `log`; the number of lines moved."""
    if not os.path.exists(log):
        return 0
    with open(log) as f:
        lines = [line for line in f if LINE.match(line)]
    with open(KEPT, "a") as f:
        f.writelines(lines)
    open(log, "w").close()
    return len(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", nargs="?", default=LOG)
    ap.add_argument("--keep", action="store_true", help="move the log's lines to kept_runs.log first")
    a = ap.parse_args()
    if a.keep:
        print(f"{keep(a.log)} run lines moved from {os.path.relpath(a.log)} to {os.path.relpath(KEPT)}\n")
    with open(EARLIER) as f:
        earlier = {(r[0], r[1]): r[2:] for r in json.load(f)["rows"]}
    later = read_log(a.log, read_log(KEPT))

    print("Per target and engine (earlier record + kept runs + this log):\n")
    print("| target | engine | runs | executions / examples | seconds | runs that found something |")
    print("| --- | --- | --- | --- | --- | --- |")
    for key in sorted(set(earlier) | set(later)):
        row = [x + y for x, y in zip(earlier.get(key, [0] * 4), later.get(key, [0] * 4))]
        print(f"| {key[0]} | {key[1]} | {row[0]} | {row[1]:,} | {row[2]:,} | {row[3]} |")

    def summed(keys, col):
        a = sum(v[col] for (t, _e), v in earlier.items() if t in keys)
        b = sum(v[col] for (t, _e), v in later.items() if t in keys)
        return a, b

    print("\nPer target, against the goal:\n")
    print("| target | 2026-12-03 record | runs since (kept + this log) | total | goal met |")
    print("| --- | --- | --- | --- | --- |")
    for t in C_TARGETS:
        a, b = summed((t,), 1)
        print(f"| `{t}` | {a / 1e6:.1f} M | {b / 1e6:.1f} M | {(a + b) / 1e6:.1f} M executions | "
              f"{'yes' if a + b >= C_GOAL else '**no**'} |")
    for t, keys in PY_TARGETS.items():
        a, b = summed(keys, 2)
        n = sum(summed(keys, 1))
        print(f"| `{t}` | {a / 60:.1f} min | {b / 60:.1f} min | {(a + b) / 60:.1f} min ({n:,} examples) | "
              f"{'yes' if a + b >= PY_GOAL_S else '**no**'} |")


if __name__ == "__main__":
    main()
