"""One table of every benchmark target: what, the ratio measured, the goal, the physical limit
measured beside it, PASS / MISS (INFO: a ratio with no target). Reads the result lines the
benchmarks wrote under a results directory (benchmarks/_targets.py) and, where
benchmarks/run_all.py ran them, each benchmark's exit status and time.

    python benchmarks/summary.py build/bench-results
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _targets import fmt, load  # noqa: E402

STATUS_SUFFIX = ".status.json"


def load_status(out_dir: str) -> Dict[str, dict]:
    """{benchmark: {"exit": int, "seconds": float, "cmd": str}} as run_all.py left them."""
    out = {}
    if os.path.isdir(out_dir):
        for name in sorted(os.listdir(out_dir)):
            if name.endswith(STATUS_SUFFIX):
                with open(os.path.join(out_dir, name)) as f:
                    out[name[:-len(STATUS_SUFFIX)]] = json.load(f)
    return out


def goal_text(goal, unit: str) -> str:
    if goal is None:
        return "-"
    return f">= {goal:.2f}x" if unit == "x" else f">= {fmt(goal, unit)}"


def print_rows(headers: List[str], rows: List[List[str]], right=(2, 3), file=None) -> None:
    """A plain-text table: text columns left-aligned, the numbers (columns `right`) right-aligned."""
    cells = [headers] + rows
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, r in enumerate(cells):
        print("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip(),
              file=file)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=file)


def summarize(out_dir: str, file=None) -> int:
    """Prints the table; returns the number of benchmarks that failed (non-zero exit, or ran
    and recorded nothing)."""
    file = file or sys.stdout
    rows: List[dict] = load(out_dir)
    status = load_status(out_dir)
    by_bench: Dict[str, List[dict]] = {}
    for r in rows:
        by_bench.setdefault(r["bench"], []).append(r)
    table, notes, failed = [], [], []
    for bench in sorted(set(by_bench) | set(status), key=lambda b: (b not in status, b)):
        st = status.get(bench)
        for r in by_bench.get(bench, []):
            goal = goal_text(r["goal"], r["unit"])
            mark = ""
            if r.get("note"):
                if r["note"] not in notes:
                    notes.append(r["note"])
                mark = f" [{notes.index(r['note']) + 1}]"
            table.append([bench, r["what"] + mark, fmt(r["value"], r["unit"]), goal, r.get("limit") or "-",
                          r["status"]])
        if st is not None and (st["exit"] != 0 or bench not in by_bench):
            failed.append(bench)
            why = f"exit status {st['exit']}" if st["exit"] != 0 else "recorded no target"
            table.append([bench, f"ERROR: {why} (its output above says why)", "-", "-", "-", "ERROR"])
    counts = {k: sum(1 for r in table if r[-1] == k) for k in ("PASS", "MISS", "INFO", "ERROR")}
    print(f"\n== all benchmark targets ({out_dir}): {counts['PASS']} PASS, {counts['MISS']} MISS"
          + (f", {counts['ERROR']} benchmark(s) failed" if counts["ERROR"] else "")
          + (f", {counts['INFO']} without a target (INFO)" if counts["INFO"] else ""), file=file)
    if not table:
        print("(no results: run the benchmarks with ACCELERATE_C_BENCH_RESULTS set, or benchmarks/run_all.py)",
              file=file)
        return len(failed)
    print_rows(["benchmark", "target", "ratio", "goal", "limit (measured in the same run)", ""], table, file=file)
    for i, n in enumerate(notes, 1):
        print(f"[{i}] {n}", file=file)
    if status:
        total = sum(s["seconds"] for s in status.values())
        print("time: " + ", ".join(f"{b} {s['seconds']:.0f} s" for b, s in status.items())
              + f"; total {total / 60:.1f} min", file=file)
    print("A MISS is reported, not an error. Timings taken while other work shares the machine are noisy: "
          "take claims from a quiet machine.", file=file)
    file.flush()
    return len(failed)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="the results directory (ACCELERATE_C_BENCH_RESULTS of the runs)")
    args = ap.parse_args(argv)
    return 1 if summarize(args.results) else 0


if __name__ == "__main__":
    sys.exit(main())
