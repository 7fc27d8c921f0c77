"""Sums tests/c/bin/fuzz/runs.log (one line per fuzz run, written by tests/c/fuzz.sh and
tests/fuzz/run_py.py) into the table of docs/security.md: per target and engine, the runs, the
executions (C) or examples (Python) and the seconds.

    python tests/fuzz/totals.py [runs.log]
"""
import collections
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LOG = os.path.join(os.path.dirname(HERE), "c", "bin", "fuzz", "runs.log")
LINE = re.compile(r"^(\S+) (\S+) (\S+) (\d+|\?) (?:execs|examples) (\d+) s rc=(\d+)")


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else LOG
    tot = collections.OrderedDict()
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
    print("| target | engine | runs | executions / examples | seconds | runs that found something |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (target, engine), (runs, n, secs, bad) in sorted(tot.items()):
        print(f"| {target} | {engine} | {runs} | {n:,} | {secs:,} | {bad} |")


if __name__ == "__main__":
    main()
