"""`make bench`: runs every benchmark, one after the other, then prints one table of all their
targets (benchmarks/summary.py).

    python benchmarks/run_all.py                 # the make-bench settings (~20 min on 2 cores)
    python benchmarks/run_all.py --full          # each benchmark at its own defaults (~25 min)
    python benchmarks/run_all.py --only bench_step,bench_kernels
    python benchmarks/run_all.py --quick         # each benchmark's smoke test, where it has one

The make-bench settings use fewer repeats than each benchmark's own defaults, to stay near twenty
minutes on a 2-core machine: medians of 3 (the step benchmarks) are fine for a regression check,
while a claim should come from the benchmark run on its own (its docstring says how). Every
benchmark prints its own tables as it goes and appends its targets to
<results>/<benchmark>.jsonl (ACCELERATE_C_BENCH_RESULTS); this runner adds its exit status and
time. A benchmark that fails (a correctness check, a crash) does not stop the others; the exit
status is 1 when any failed. A MISS is not a failure.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _targets import ENV  # noqa: E402
from summary import STATUS_SUFFIX, summarize  # noqa: E402

# benchmark -> its arguments under `make bench` (None: its own defaults)
MAKE_BENCH = {
    "bench_kernels": ["--repeats", "5"],
    "bench_safetensors": ["--repeats", "3"],
    "bench_checkpoint": [],
    "bench_step": ["--repeats", "3", "--steps", "6", "--fp16-repeats", "9"],
    "bench_overhead": ["--repeats", "5"],
    "bench_ddp": ["--repeats", "3", "--steps", "4"],
    "bench_sharding": ["--repeats", "2", "--steps", "2"],
    "bench_chunk_collectives": ["--repeats", "3"],
    "bench_collectives": ["--repeats", "3"],
    "bench_trainer": ["--repeats", "3", "--steps", "6", "--threads", "1"],  # 1 thread: steady on shared cores
}
QUICK = {"bench_kernels": ["--quick"], "bench_safetensors": ["--repeats", "1", "--mb", "40"],
         "bench_checkpoint": ["--repeats", "1", "--layers", "1", "--width", "512"],
         "bench_step": ["--quick"], "bench_overhead": ["--repeats", "1", "--steps", "50", "--warmup", "5"],
         "bench_ddp": ["--quick"],
         "bench_sharding": ["--worlds", "2", "--repeats", "1", "--steps", "1", "--layers", "2", "--d-model", "384"],
         "bench_chunk_collectives": ["--worlds", "2", "--buckets", "2", "--repeats", "1"],
         "bench_collectives": ["--worlds", "2", "--max-mb", "32", "--repeats", "1"],
         "bench_trainer": ["--repeats", "1", "--steps", "3", "--warmup", "1"]}
TIMEOUT_S = 3600  # a benchmark that hangs is stopped, recorded as failed, and the others run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(os.path.dirname(HERE), "build", "bench-results"),
                    help="directory for the result lines (emptied first; default build/bench-results)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--full", action="store_true", help="every benchmark at its own defaults")
    mode.add_argument("--quick", action="store_true", help="every benchmark's smoke test")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(MAKE_BENCH)}")
    args = ap.parse_args(argv)
    names = list(MAKE_BENCH)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        bad = [n for n in names if n not in MAKE_BENCH]
        if bad or not names:
            ap.error(f"--only: unknown benchmark(s) {bad}; choose from {', '.join(MAKE_BENCH)}")
    shutil.rmtree(args.results, ignore_errors=True)
    os.makedirs(args.results)
    env = dict(os.environ, **{ENV: os.path.abspath(args.results)})
    t_all = time.perf_counter()
    for name in names:
        extra = [] if args.full else (QUICK if args.quick else MAKE_BENCH)[name]
        cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), *extra]
        print(f"\n######## {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.call(cmd, env=env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"{name}: stopped after {TIMEOUT_S} s", flush=True)
            rc = 124
        with open(os.path.join(args.results, name + STATUS_SUFFIX), "w") as f:
            json.dump({"exit": rc, "seconds": time.perf_counter() - t0, "cmd": " ".join(cmd)}, f)
    failed = summarize(args.results)
    print(f"(all benchmarks: {(time.perf_counter() - t_all) / 60:.1f} min)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
