"""Sums tests/c/bin/fuzz/runs.log (one line per fuzz run, written by tests/c/fuzz.sh and
tests/fuzz/run_py.py) into the tables of docs/security.md: per target and engine, the runs, the
executions (C) or examples (Python) and the seconds; then per target, with the earlier record
(tests/fuzz/earlier_totals.json: the campaigns whose log was not kept) added, against the goal
(10^7 executions per C target, 20 minutes per Python target).

    python tests/fuzz/totals.py [runs.log]
"""
import collections
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LOG = os.path.join(os.path.dirname(HERE), "c", "bin", "fuzz", "runs.log")
EARLIER = os.path.join(HERE, "earlier_totals.json")
LINE = re.compile(r"^(\S+) (\S+) (\S+) (\d+|\?) (?:execs|examples) (\d+) s rc=(\d+)")
C_GOAL, PY_GOAL_S = 10 ** 7, 20 * 60
C_TARGETS = ("safetensors", "shard", "shm_header", "dlpack")
# a Python target's time includes its byte-level atheris variant where it has one
PY_TARGETS = {"config": ("py:config",), "config_bytes": ("py:config_bytes",),
              "deepspeed": ("py:deepspeed", "py:deepspeed_bytes"),
              "training_args": ("py:training_args", "py:training_args_bytes"), "load_state": ("py:load_state",),
              "model_index": ("py:model_index",), "zero_load_state": ("py:zero_load_state",)}


def read_log(path: str) -> collections.OrderedDict:
    tot = collections.OrderedDict()
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


def table(tot) -> None:
    print("| target | engine | runs | executions / examples | seconds | runs that found something |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (target, engine), (runs, n, secs, bad) in sorted(tot.items()):
        print(f"| {target} | {engine} | {runs} | {n:,} | {secs:,} | {bad} |")


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else LOG
    log = read_log(path)
    with open(EARLIER) as f:
        earlier = {(r[0], r[1]): r[2:] for r in json.load(f)["rows"]}
    print(f"Runs in {os.path.relpath(path)}:\n")
    table(log)

    def summed(keys, col):
        a = sum(v[col] for (t, _e), v in earlier.items() if t in keys)
        b = sum(v[col] for (t, _e), v in log.items() if t in keys)
        return a, b

    print("\nPer target, against the goal (earlier record + this log):\n")
    print("| target | earlier | this log | total | goal met |")
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
