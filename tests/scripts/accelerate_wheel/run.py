"""Runs accelerate's multi-process test scripts (from the installed wheel, imports rewritten
to accelerate_c) through `accelerate-c launch`, and reports every function's outcome.

    python tests/scripts/accelerate_wheel/run.py [--nproc 2] [--reference] [--only "f1;f2"] test_ops.py ...

A function passes when it passes on every rank. After a failure the job stops (the ranks'
collectives may be out of step) and the functions left are run in a new launch.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from specs import functions  # noqa: E402

DRIVER = os.path.join(HERE, "driver.py")


def _launcher() -> list:
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "accelerate_c.commands.main"]


def _merge(out: str, world: int) -> dict:
    per_rank = {}
    for r in range(world):
        try:
            with open(os.path.join(out, f"rank{r}.json")) as f:
                per_rank[r] = json.load(f)
        except (OSError, ValueError):
            per_rank[r] = {"order": [], "results": {}}
    names = []
    for r in range(world):
        for n in per_rank[r]["order"]:
            if n not in names:
                names.append(n)
    merged = {}
    for n in names:
        ranks = {r: per_rank[r]["results"].get(n) for r in range(world)}
        statuses = {r: (v["status"] if v else "no report") for r, v in ranks.items()}
        if all(s == "pass" for s in statuses.values()):
            status = "pass"
        elif all(s == "skip" for s in statuses.values()):
            status = "skip"
        else:
            status = "fail"
        errors = {r: v.get("error") for r, v in ranks.items() if v and v.get("error")}
        tbs = {r: v.get("traceback") for r, v in ranks.items() if v and v.get("traceback")}
        if any(s == "no report" for s in statuses.values()):
            errors.update({r: "no report (stuck or killed)" for r, s in statuses.items() if s == "no report"})
        merged[n] = {"status": status, "ranks": statuses, "errors": errors, "tracebacks": tbs,
                     "seconds": max((v or {}).get("seconds", 0) for v in ranks.values())}
    return merged


def run_script(script: str, nproc: int = 2, only=None, reference: bool = False, timeout: float = 300,
               collective_timeout: float = 60, max_launches: int = 40, log=None) -> dict:
    """{function: {"status": pass|fail|skip|not run, "ranks": ..., "errors": ...}} in order."""
    todo = list(only) if only else functions(script)
    results = {}
    launches = 0
    while todo and launches < max_launches:
        launches += 1
        out = tempfile.mkdtemp(prefix="wheel_run_")
        only_file = os.path.join(out, "only.json")
        with open(only_file, "w") as f:
            json.dump(todo, f)
        cmd = [*_launcher(), "launch", "--num_processes", str(nproc), "--cpu", "--main_process_port", "0",
               DRIVER, script, "--out", out, "--only", only_file, "--timeout", str(collective_timeout)]
        if reference:
            cmd.append("--reference")
        env = dict(os.environ)
        env.pop("WORLD_SIZE", None)
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            tail = proc.stdout[-2000:] + proc.stderr[-4000:]
            rc = proc.returncode
        except subprocess.TimeoutExpired as e:
            tail, rc = f"launch timed out after {timeout}s: {e}", -1
        merged = _merge(out, nproc)
        shutil.rmtree(out, ignore_errors=True)
        if log is not None:
            log(f"[{script} x{nproc}] launch {launches}: rc={rc}, {len(merged)} functions, {time.time() - t0:.1f}s")
        if not merged:  # died before the first function: the set-up (or the import) failed
            for n in todo:
                results[n] = {"status": "fail", "ranks": {}, "errors": {"launch": tail}, "tracebacks": {},
                              "seconds": 0}
            todo = []
            break
        results.update(merged)
        todo = [n for n in todo if n not in merged]
    for n in todo:
        results[n] = {"status": "not run", "ranks": {}, "errors": {}, "tracebacks": {}, "seconds": 0}
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scripts", nargs="+")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--only", default=None)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--tracebacks", action="store_true")
    args = ap.parse_args()
    everything = {}
    for script in args.scripts:
        res = run_script(script, args.nproc, args.only.split(";") if args.only else None, args.reference,
                         log=lambda m: print(m, file=sys.stderr, flush=True))
        everything[script] = res
        for name, r in res.items():
            line = f"{script}::{name}: {r['status'].upper()} ({r['seconds']}s)"
            if r["status"] != "pass" and r["errors"]:
                first = next(iter(r["errors"].items()))
                line += f"  [rank {first[0]}] {first[1].splitlines()[0][:300] if first[1] else ''}"
            print(line, flush=True)
            if args.tracebacks and r["status"] == "fail":
                for rk, tb in r["tracebacks"].items():
                    print(f"--- rank {rk}\n{tb}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=1)


if __name__ == "__main__":
    main()
