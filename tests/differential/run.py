"""The differential harness's driver: draws cases, runs them in batches per world size, reports.

    python tests/differential/run.py --cases 200 --seed 1      # cases 1..200
    python tests/differential/run.py --seconds 3600            # soak: new seeds until time is up
    python tests/differential/run.py --replay 1234             # one case, with its traceback
    python tests/differential/run.py --cases 100 --comm shm    # accelerate_c over shared memory
    python tests/differential/run.py --cases 40 --comm shm --hosts 2  # ranks split over 2 "hosts"
    python tests/differential/run.py --cases 600 --adam                # the ~10% of them that can draw Adam

Cases of one world size share one launched process group (a launch costs seconds here); a case
that raises ends its batch and the rest are relaunched. Every failure prints the one-line
command that replays it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from differential.cases import REGRESSIONS, SHARDINGS, describe, lookup  # noqa: E402

BATCH = 150  # cases per launch: a launch costs 10-20 s here, a case 0.01-0.2 s


def _command(world: int, cases_path: str, out_path: str) -> list[str]:
    worker = os.path.join(HERE, "worker.py")
    if world == 1:
        return [sys.executable, worker, cases_path, out_path]
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    return [launcher, "launch", "--num_processes", str(world), "--cpu", "--main_process_port", "0", worker,
            cases_path, out_path]


def _run_batch(world: int, cases: list[dict], workdir: str, timeout: float) -> dict[int, list[str]]:
    """{seed: errors} for every case of the batch (relaunching after a case that raised)."""
    results: dict[int, list[str]] = {}
    todo = list(cases)
    while todo:
        fd, cases_path = tempfile.mkstemp(suffix=".json", dir=workdir)
        with os.fdopen(fd, "w") as f:
            json.dump(todo, f)
        out_path = cases_path + ".out"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        try:
            proc = subprocess.run(_command(world, cases_path, out_path), capture_output=True, text=True,
                                  timeout=timeout, env=env)
            tail = (proc.stdout + proc.stderr)[-3000:]
            rc = proc.returncode
        except subprocess.TimeoutExpired as e:
            tail = f"timed out after {timeout:.0f} s\n" + str(e.stdout or "")[-1000:] + str(e.stderr or "")[-2000:]
            rc = -1
        done = _read(out_path)
        for rank_file in sorted(p for p in os.listdir(workdir) if p.startswith(os.path.basename(out_path) + ".rank")):
            for seed, errs in _read(os.path.join(workdir, rank_file)).items():
                done.setdefault(seed, []).extend(errs)
        crashed = any(f.startswith(os.path.basename(out_path) + ".rank") for f in os.listdir(workdir))
        results.update(done)
        rest = [c for c in todo if c["seed"] not in results]
        if rc != 0 and rest and not crashed:
            # the case running when the batch died is the first without a result
            results.setdefault(rest[0]["seed"], []).append(f"the process group exited with {rc}:\n{tail}")
            rest = rest[1:]
        elif rc != 0 and not rest and not crashed:
            seed = todo[-1]["seed"]
            if not results.get(seed):
                results[seed] = [f"the process group exited with {rc} after its last case:\n{tail}"]
        todo = rest
    return results


RESUMED: set = set()  # seeds whose subject saved, detoured and loaded its state (the resume axis)


def _read(path: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out.setdefault(rec["seed"], []).extend(rec["errors"])
                if rec.get("resumed"):
                    RESUMED.add(rec["seed"])
    return out


def cases_of(seeds, world=None, sharding=None, resume=False, adam=False) -> list[dict]:
    """The cases of these seeds (drawn for `world` processes and `sharding` when given; resume:
    every case that can resumes after its first step when it drew no other; adam: only the seeds
    whose case draws Adam, with AC_DIFF_ADAM=1 set so that every case that can does)."""
    if adam:
        os.environ["AC_DIFF_ADAM"] = "1"  # read by draw(); report() names it in the replay command
    cases = [lookup(s, world, sharding, resume) for s in seeds]
    return [c for c in cases if c["optimizer"] == "adamw"] if adam else cases


def run_seeds(seeds, world=None, sharding=None, resume=False, adam=False, **kw) -> list[tuple[dict, list[str]]]:
    """Runs cases_of(seeds, ...)."""
    return run_cases(cases_of(seeds, world, sharding, resume, adam), **kw)


def run_cases(cases, timeout: float = 900.0, log=print) -> list[tuple[dict, list[str]]]:
    """Runs these cases; returns [(case, errors)] for the failing ones."""
    by_world: dict[int, list[dict]] = {}
    for c in cases:
        by_world.setdefault(c["world"], []).append(c)
    failures = []
    with tempfile.TemporaryDirectory(prefix="ac-diff-") as workdir:
        for world in sorted(by_world):
            group = by_world[world]
            for i in range(0, len(group), BATCH):
                batch = group[i:i + BATCH]
                results = _run_batch(world, batch, workdir, timeout)
                for c in batch:
                    errs = results.get(c["seed"], ["no result"])
                    if errs:
                        failures.append((c, errs))
                        log(report(c, errs))
    return failures


def report(case: dict, errors: list[str]) -> str:
    lines = [f"FAILED case {case['seed']}: {describe(case)}"]
    lines += ["  " + e for e in errors[:8]]
    comm, hosts = os.environ.get("ACCELERATE_C_COMM"), os.environ.get("AC_DIFF_HOSTS")
    lines.append(f"  replay: {sys.executable} tests/differential/run.py --replay {case['seed']} --world {case['world']}"
                 f" --sharding {case['sharding']}" + (f" --comm {comm}" if comm else "")
                 + (f" --hosts {hosts}" if hosts else "") + (" --resume" if case.get("resume") else "")
                 + (" --adam" if os.environ.get("AC_DIFF_ADAM") == "1" else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=100, help="how many cases (default 100)")
    ap.add_argument("--seed", type=int, default=1, help="the first case's seed (default 1)")
    ap.add_argument("--seconds", type=float, help="soak: run batches of new seeds until this much time has passed")
    ap.add_argument("--replay", type=int, nargs="+", help="run just these seeds")
    ap.add_argument("--world", type=int, choices=(1, 2, 3), help="draw every case for this many processes")
    ap.add_argument("--sharding", choices=SHARDINGS, help="draw every case with this sharding strategy (on 2+ processes)")
    ap.add_argument("--regressions", action="store_true", help="run the cases of the defects found so far")
    ap.add_argument("--comm", choices=("gloo", "shm"),
                    help="how accelerate_c's CPU collectives travel (ACCELERATE_C_COMM; the torch references stay on "
                         "gloo): the shared-memory axis")
    ap.add_argument("--hosts", type=int, help="with --comm shm: the ranks say they are on this many hosts (rank r on "
                    "host r %% hosts), so shared memory carries each host's part and gloo joins the hosts")
    ap.add_argument("--resume", action="store_true",
                    help="every case that can (not under join_uneven_inputs) saves, detours and loads its state after "
                         "a step (its drawn one, else the first)")
    ap.add_argument("--adam", action="store_true",
                    help="only the seeds whose case draws Adam (AC_DIFF_ADAM=1: every case fp32 end to end does; "
                         "the optimizer step through accelerate_c's one-pass kernel, or torch's for amsgrad)")
    args = ap.parse_args(argv)
    if args.comm:
        os.environ["ACCELERATE_C_COMM"] = args.comm  # inherited by every launch
    if args.hosts:
        os.environ["AC_DIFF_HOSTS"] = str(args.hosts)  # worker.py sets each rank's host id from it
    if args.adam:
        os.environ["AC_DIFF_ADAM"] = "1"  # before any draw (the replay's description too)
    start = time.monotonic()
    if args.regressions:
        failures = run_cases([dict(c) for c in REGRESSIONS.values()])
        total = len(REGRESSIONS)
    elif args.replay:
        for s in args.replay:
            print(describe(lookup(s, args.world, args.sharding, args.resume)))
        cases = cases_of(args.replay, args.world, args.sharding, args.resume, args.adam)
        failures, total = run_cases(cases), len(cases)
    elif args.seconds:
        seed, total, failures = args.seed if args.seed != 1 else int(time.time()) % 10_000_000 * 1000, 0, []
        while time.monotonic() - start < args.seconds:
            chunk = range(seed, seed + 3 * BATCH)
            cases = cases_of(chunk, args.world, args.sharding, args.resume, args.adam)
            failures += run_cases(cases)
            total += len(cases)
            seed += len(chunk)
            print(f"soak: {total} cases, {len(failures)} failed, {time.monotonic() - start:.0f} s", flush=True)
    else:
        cases = cases_of(range(args.seed, args.seed + args.cases), args.world, args.sharding, args.resume,
                         args.adam)
        failures, total = run_cases(cases), len(cases)
    print(f"differential: {total - len(failures)} passed, {len(failures)} failed in {time.monotonic() - start:.0f} s"
          f" ({len(RESUMED)} resumed mid-run)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
