"""Training-step throughput: accelerate_c vs accelerate 1.15 vs a plain torch loop, on the CPU
(default) or one CUDA GPU (--device cuda).

One process, one small GPT-style language model (benchmarks/models.py, ~14M parameters),
bf16 autocast, gradient accumulation 2, gradient clipping at 1.0, AdamW and an LR schedule.
One optimizer step = 2 micro-batches (forward, backward) + clip + optimizer.step +
scheduler.step + zero_grad, and everything the libraries run around them (autocast and
fp32-output wrappers, gradient hooks, data loader wrappers, accumulation bookkeeping) is
inside the timed region. The contenders run the same code a user would write:

  torch         autocast("cpu", bfloat16) forward; (loss / 2).backward(); on every 2nd
                micro-batch clip_grad_norm_(params, 1.0), opt.step(), sched.step(),
                opt.zero_grad(set_to_none=True); iterates the raw DataLoader
  accelerate    accelerate 1.15's Accelerator(mixed_precision="bf16",
                gradient_accumulation_steps=2): prepare(model, opt, loader, sched), then
                    with accelerator.accumulate(model):
                        loss = model(x, y); accelerator.backward(loss)
                        if accelerator.sync_gradients:
                            accelerator.clip_grad_norm_(model.parameters(), 1.0)
                        opt.step(); sched.step(); opt.zero_grad()
  accelerate_c  the same code with `from accelerate_c import Accelerator`

Every contender runs under the same process settings, in two tables (benchmarks/_settings.py):
  defaults  glibc's default malloc settings for all three (any MALLOC_* / GLIBC_TUNABLES
            glibc.malloc.* of the calling environment removed; accelerate_c's opt-in mallopt off)
  tuned     all three started with MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ and
            MALLOC_TOP_PAD_ set to the values accelerate_c's opt-in (HostMallocKwargs,
            ACCELERATE_C_MALLOC_TUNING=1) sets with mallopt; accelerate_c's own mallopt stays
            off, so it gets exactly what torch and accelerate get (docs/performance.md)
glibc reads those variables at process start and mallopt changes the whole process, so every
repeat of every contender is a fresh process (this script with --one-repeat) started with its
table's environment: it builds a fresh model, optimizer, scheduler and loader from the same
seed, prepares them, runs --warmup untimed optimizer steps, then --steps timed ones. Repeats are
interleaved across contenders and tables (in every repeat: each table, each contender, in
orders rotated from repeat to repeat), so slow drifts of the machine hit all of them alike. A
repeat's sample is steps / seconds; the tables give the median and quartiles over repeats,
and each contender's minor page faults per step (the tuning's effect shows there). Garbage
collection is paused while timing. Before timing, the three contenders train --check-steps
steps from the same seed and their losses are compared: accelerate_c must match plain torch
within bf16 tolerance, or the benchmark exits non-zero.

Targets (a MISS is reported, not an error):
  * defaults: median(accelerate_c) / median(accelerate) >= 0.99
  * tuned:    median(accelerate_c) / median(accelerate) >= 1.00
Printed without a target: accelerate_c / plain torch in both tables, with what makes the gap
(accelerate_c runs torch's own forward, backward and clip, and torch's AdamW update in one pass
over memory instead of nine, bit for bit torch's (accelerate_c/fused_adam.py); around them it adds
the library's per-step work; ACCELERATE_C_GRAD_BUFFERS=flat copies the gradients into flat buffers
and saves the clip's read pass: --breakdown shows the phases), and what the tuning buys each
contender (tuned / defaults).

Two more parts run after it, each in a fresh process: the fp16 gradient post-processing
that accelerate_c's C core replaces (benchmarks/_step_fp16.py says what it times and checks;
target >= 1.5x GradScaler + clip_grad_norm_), and clip_grad_norm_ in a real loop
(benchmarks/_step_clip.py; target: its pass >= 90% of an in-place scale's bandwidth).

Defaults: model preset "bench" (vocab 8192, d_model 384, 6 layers, 6 heads, tied head,
13.8M parameters), micro-batch 4 x 128 tokens: about 0.75 s per optimizer step and ~7 minutes
for the full run (both tables) on a quiet 2-core machine; --settings defaults (or tuned) runs
one table in half that. Other processes on the machine swamp differences
of a few percent: the benchmark measures and prints their load and warns when it is high.

--device cuda runs the same benchmark on the GPU (torch.cuda's current device; it exits with
status 2 and "CUDA is not available" where there is none). The model and every batch live on
the GPU: the torch contender moves its model there before building the optimizer and copies
each batch with .to(device), under torch.autocast("cuda", bfloat16); the Accelerators are
built with cpu=False (--device cpu passes cpu=True, which keeps them on the CPU even where a
GPU is visible), so their prepare() moves model and batches. The fp16 micro-benchmark uses
torch.amp.GradScaler("cuda") against accelerate_c's CUDA kernels on the flat buffers. CUDA runs
asynchronously, so every timer read (start and end of each timed region, every per-step and
per-phase mark) is preceded by torch.cuda.synchronize(): a timed region ends only when the GPU
has finished its work. The micro-batch defaults to 16 x 128 tokens on the GPU. Tolerances on
the GPU: losses within LOSS_RTOL_CUDA (bf16 GEMMs and attention kernels differ from the CPU's,
and some CUDA backward kernels accumulate with atomics, so runs are not bitwise reproducible);
the fp16 norm and gradients within FP16_RTOL_CUDA of the fp64 reference (accelerate_c's CUDA
norm kernel adds per-block partial sums with fp32 atomics: a few 1e-7 to 1e-6 relative, the
1e-5 that tests/test_cuda.py allows).

    .venv/bin/python benchmarks/bench_step.py              # the full run (several minutes)
    .venv/bin/python benchmarks/bench_step.py --quick      # smoke test, tiny model, < 60 s
    .venv/bin/python benchmarks/bench_step.py --breakdown  # + where each contender's step goes
    python benchmarks/bench_step.py --device cuda --quick  # on a GPU machine (seconds on an H200)
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from _common import (  # noqa: E402
    RATE_HEADERS,
    Summary,
    cpu_model,
    load_sample,
    logical_cpus,
    other_load,
    other_load_between,
    print_table,
    rate_rows,
    verdict,
)
from models import GPT, PRESETS, TokenDataset, make_tokens  # noqa: E402
import _settings  # noqa: E402
import _step_common  # noqa: E402
import _targets  # noqa: E402
from _step_clip import run_clip_benchmark  # noqa: E402
from _step_common import (  # noqa: E402
    ACCELERATE_ERROR,
    ACCUM,
    DATA_SEED,
    DEFAULT_BATCH,
    LOSS_RTOL,
    LOSS_RTOL_CUDA,
    MAX_NORM,
    accelerate,
    build,
    device_note,
    now,
    on_cuda,
    reset_singletons,
)
from _step_fp16 import run_fp16_benchmark  # noqa: E402

import accelerate_c  # noqa: E402
from accelerate_c import _C  # noqa: E402

# median(accelerate_c) / median(accelerate), per table (process setting)
TARGET_VS_ACCELERATE = {"defaults": 0.99, "tuned": 1.00}
BENCH = "bench_step"  # its name in the result lines (benchmarks/_targets.py)
CHILD_TIMEOUT_S = 1800  # a child process (one repeat, or the fp16 part) that hangs stops the benchmark


# ---- the loops ----------------------------------------------------------------------------
class Timers:
    """Accumulates seconds per named phase (only used by --breakdown)."""

    def __init__(self):
        self.t = defaultdict(float)
        self.last = now()

    def mark(self, name):
        t = now()  # on the GPU: synchronizes, so each phase is charged its own kernels
        self.t[name] += t - self.last
        self.last = t


def torch_loop(model, opt, sched, loader, record=None, timers=None):
    """Plain torch: yields after every optimizer step."""
    mark = timers.mark if timers is not None else (lambda name: None)
    cuda = on_cuda()
    it = iter(loader)
    while True:
        for _ in range(ACCUM):
            x, y = next(it)
            if cuda:
                x, y = x.to(_step_common.DEVICE), y.to(_step_common.DEVICE)
            mark("data")
            with torch.autocast(_step_common.DEVICE.type, dtype=torch.bfloat16):
                loss = model(x, y)
            mark("forward")
            (loss / ACCUM).backward()
            mark("backward")
            if record is not None:
                record.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        mark("clip")
        opt.step()
        mark("opt.step")
        sched.step()
        mark("sched.step")
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        yield


def accelerator_loop(accelerator, model, opt, sched, loader, record=None, timers=None):
    """The accelerate idiom (same code for accelerate and accelerate_c): yields after every
    optimizer step (every 2nd micro-batch)."""
    mark = timers.mark if timers is not None else (lambda name: None)
    for x, y in loader:
        mark("data")
        with accelerator.accumulate(model):
            mark("accumulate")
            loss = model(x, y)
            mark("forward")
            accelerator.backward(loss)
            mark("backward")
            if record is not None:
                record.append(loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
                mark("clip")
            opt.step()
            mark("opt.step")
            sched.step()
            mark("sched.step")
            opt.zero_grad()
            mark("zero_grad")
        mark("accumulate")
        if accelerator.sync_gradients:
            yield


def make_run(name, cfg, dataset, batch_size, record=None, timers=None):
    """Builds contender `name` from scratch; returns (generator of optimizer steps, keepalive)."""
    reset_singletons()
    threads = torch.get_num_threads()
    if name == "torch":
        model, opt, sched, loader = build(cfg, dataset, batch_size, device=_step_common.DEVICE if on_cuda() else None)
        return torch_loop(model, opt, sched, loader, record, timers), (model, opt, sched, loader)
    model, opt, sched, loader = build(cfg, dataset, batch_size)
    mod = accelerate if name == "accelerate" else accelerate_c
    accelerator = mod.Accelerator(mixed_precision="bf16", gradient_accumulation_steps=ACCUM,
                                  cpu=_step_common.DEVICE.type == "cpu")
    if accelerator.device.type != _step_common.DEVICE.type:
        raise SystemExit(f"{name}'s Accelerator picked {accelerator.device}, not {_step_common.DEVICE.type} "
                         "(ACCELERATE_USE_CPU set?)")
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    if torch.get_num_threads() != threads:  # keep every contender on the same thread count
        print(f"note: {name} changed torch threads {threads} -> {torch.get_num_threads()}; restored")
        torch.set_num_threads(threads)
    gen = accelerator_loop(accelerator, model, opt, sched, loader, record, timers)
    return gen, (accelerator, model, opt, sched, loader)


# ---- the step benchmark -----------------------------------------------------------------
def check_losses(names, cfg, dataset, batch_size, steps):
    """Trains every contender `steps` optimizer steps from the same seed; compares the
    per-micro-batch losses with plain torch's. Returns False if accelerate_c diverges."""
    losses = {}
    for name in names:
        rec = []
        gen, keep = make_run(name, cfg, dataset, batch_size, record=rec)
        for _ in range(steps):
            next(gen)
        gen.close()
        del gen, keep
        losses[name] = rec
    gc.collect()
    rtol = LOSS_RTOL_CUDA if on_cuda() else LOSS_RTOL
    ref = losses["torch"]
    print(f"loss trajectory, {steps} optimizer steps ({steps * ACCUM} micro-batches) from the same seed:")
    rows, ok = [], True
    for name in names:
        diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses[name], ref)]
        worst = max(diffs) if diffs else 0.0
        good = len(losses[name]) == len(ref) and worst <= rtol
        if not good and name == "accelerate_c":
            ok = False
        rows.append([name] + [f"{v:.5f}" for v in losses[name]] + [f"{worst:.1e}", "ok" if good else "DIVERGED"])
    print_table(["contender"] + [f"mb{i}" for i in range(len(ref))] + ["max rel diff", "vs torch"], rows)
    if not ok:
        print(f"ERROR: accelerate_c's losses diverge from plain torch's (rtol {rtol})", file=sys.stderr)
    elif any(r[-1] != "ok" for r in rows):
        print(f"warning: accelerate's losses differ from plain torch's beyond rtol {rtol}")
    print()
    return ok


def time_one_repeat(name, cfg, dataset, batch_size, steps, warmup):
    """One contender's repeat, in this process: --warmup untimed steps, then --steps timed ones.
    Returns (seconds of each timed step, minor page faults per timed step)."""
    gen, keep = make_run(name, cfg, dataset, batch_size)
    for _ in range(warmup):
        next(gen)
    gc.collect()
    gc.disable()
    times = []
    try:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t_prev = now()
        for _ in range(steps):
            next(gen)
            t = now()
            times.append(t - t_prev)
            t_prev = t
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
    finally:
        gc.enable()
    gen.close()
    return times, faults


def bench_steps(names, settings, repeats, child_argv):
    """Interleaved repeats, each contender's repeat in a fresh process (this script with
    --one-repeat NAME) started with its table's environment (_settings.process_env): glibc
    reads its malloc variables at start-up, and process-wide state (the C library's heap,
    torch's thread pools) is then each contender's own, as in a real run. Returns
    {setting: ({name: [steps/s per repeat]}, {name: [s per step]}, {name: [faults per step]})}."""
    out = {st: ({n: [] for n in names}, {n: [] for n in names}, {n: [] for n in names}) for st in settings}
    envs = {st: _settings.process_env(st) for st in settings}
    for r in range(repeats):
        for setting in settings[r % len(settings):] + settings[:r % len(settings)]:
            rates, per_step, faults = out[setting]
            for name in names[r % len(names):] + names[:r % len(names)]:
                cmd = [sys.executable, os.path.abspath(__file__), "--one-repeat", name] + child_argv
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=envs[setting])
                if res.returncode != 0:
                    raise SystemExit(f"the {name} repeat ({setting}) failed (exit {res.returncode}):\n"
                                     f"{res.stderr[-3000:]}")
                rep = json.loads(res.stdout.strip().splitlines()[-1])
                per_step[name] += rep["step_seconds"]
                rates[name].append(len(rep["step_seconds"]) / sum(rep["step_seconds"]))
                faults[name].append(rep["faults_per_step"])
        print(f"  repeat {r + 1}/{repeats}: " + "; ".join(
            f"{st} " + ", ".join(f"{n} {out[st][0][n][-1]:.3f}" for n in names) for st in settings) + " steps/s",
            flush=True)
    return out


def breakdown(names, cfg, dataset, batch_size, steps, warmup):
    """Per-phase seconds per optimizer step for each contender (timers between the lines of
    the loop; everything a library runs inside a call is charged to that call)."""
    results = {}
    for name in names:
        timers = Timers()
        gen, keep = make_run(name, cfg, dataset, batch_size, timers=timers)
        for _ in range(warmup):
            next(gen)
        timers.t.clear()
        gc.collect()
        gc.disable()
        try:
            timers.last = t0 = now()
            for _ in range(steps):
                next(gen)
            total = now() - t0
        finally:
            gc.enable()
        gen.close()
        del gen, keep
        gc.collect()
        results[name] = {k: v / steps for k, v in timers.t.items()}
        results[name]["total"] = total / steps
    phases = ["data", "accumulate", "forward", "backward", "clip", "opt.step", "sched.step", "zero_grad"]
    rows = [[p] + [f"{results[n].get(p, 0.0) * 1e3:.2f}" for n in names] for p in phases]
    rows.append(["(other)"] + [f"{(results[n]['total'] - sum(results[n].get(p, 0.0) for p in phases)) * 1e3:.2f}"
                               for n in names])
    rows.append(["total"] + [f"{results[n]['total'] * 1e3:.2f}" for n in names])
    print(f"where a step goes (ms per optimizer step, mean of {steps} steps, one run each):")
    print_table(["phase"] + names, rows)
    print()


GAP_TO_TORCH = (
    "accelerate_c runs torch's own forward, backward and clip (on one CPU process the gradients stay "
    "autograd's tensors, clipped by torch's clip_grad_norm_), and torch's AdamW update in one pass over memory "
    "instead of torch's nine, with torch's values bit for bit (accelerate_c/fused_adam.py; the opt.step phase of "
    "--breakdown). Around them, each optimizer step it adds what the "
    "library does for the user (the accumulate() context, the autocast and fp32-output wrapper of the forward, "
    "the prepared data loader, the optimizer and scheduler wrappers). With ACCELERATE_C_GRAD_BUFFERS=flat it "
    "also copies each gradient into the flat buffer ({grad_mb:.0f} MB read and written once per step, measured "
    "on the way) and saves the clip's read pass. --breakdown prints each contender's step by phase.")


def step_table(setting, names, rates, per_step, faults, args):
    """Prints one table's rates and ratios; records its targets. Returns [ok per target]."""
    S = {n: Summary.of(rates[n]) for n in names}
    F = {n: Summary.of(faults[n]).median for n in names}
    rows = [row + [f"{F[n]:.0f}"] for n, row in zip(names, rate_rows(names, rates, per_step))]
    print(f"{setting}: {_settings.describe(setting)}")
    print(f"steps/s over {args.repeats} repeats (each: {args.steps} optimizer steps / their seconds); the single "
          f"steps' times pooled over repeats ({args.repeats * args.steps} per contender); minor page faults per "
          "step (median over repeats):")
    print_table(RATE_HEADERS + ["faults/step"], rows)
    ours, results, ratio_rows = S["accelerate_c"], [], []
    goal = TARGET_VS_ACCELERATE[setting]
    if "accelerate" in names:
        r_med = ours.median / S["accelerate"].median
        ok = _targets.target(BENCH, f"steps/s vs accelerate, {setting}{device_note()}", r_med, goal)
        results.append(ok)
        ratio_rows.append(["accelerate_c / accelerate", f"{r_med:.3f}x", f"{ours.q1 / S['accelerate'].median:.3f}x",
                           f">= {goal:.2f}x (median)", verdict(ok)])
    r_med = ours.median / S["torch"].median
    gap_ms = 1e3 / ours.median - 1e3 / S["torch"].median
    _targets.info(BENCH, f"steps/s vs plain torch, {setting}{device_note()}", r_med,
                  note=f"{gap_ms:+.1f} ms per step against plain torch's {1e3 / S['torch'].median:.0f} ms: what "
                       "accelerate_c adds around torch's own step (library bookkeeping, one copy of each gradient "
                       "into its buffer) less what its fused clip saves; bench_step.py --breakdown shows the phases")
    ratio_rows.append(["accelerate_c / torch", f"{r_med:.3f}x", f"{ours.q1 / S['torch'].median:.3f}x",
                       "(no target)", "INFO"])
    print("ratios of steps/s: median = median(accelerate_c) / median(other); q1 = q1(accelerate_c) / median(other)")
    print_table(["ratio", "median", "q1", "target", ""], ratio_rows)
    print(f"gap to plain torch: {gap_ms:+.1f} ms per step ({1e3 / S['torch'].median:.1f} ms for torch)")
    print()
    return results


def explain_gap(args):
    """Why accelerate_c's step is not plain torch's (printed once, under the tables)."""
    print("the gap to plain torch: " + GAP_TO_TORCH.format(grad_mb=args.grad_bytes / 1e6))
    print()


def tuning_table(names, out):
    """What the tuned setting buys each contender: median steps/s tuned / defaults, and faults."""
    rows = []
    for n in names:
        d, t = Summary.of(out["defaults"][0][n]).median, Summary.of(out["tuned"][0][n]).median
        fd, ft = Summary.of(out["defaults"][2][n]).median, Summary.of(out["tuned"][2][n]).median
        rows.append([n, f"{d:.3f}", f"{t:.3f}", f"{t / d:.3f}x", f"{fd:.0f}", f"{ft:.0f}"])
        _targets.info(BENCH, f"what the malloc tuning buys {n}: tuned / defaults{device_note()}", t / d)
    print("what the malloc settings buy (median steps/s, each contender tuned against itself at defaults):")
    print_table(["contender", "defaults", "tuned", "tuned / defaults", "faults/step defaults", "tuned"], rows)
    bad = [r[0] for r in rows if float(r[5]) > 0.5 * float(r[4]) and float(r[4]) > 1000]
    if bad:
        print(f"warning: the tuned setting did not cut {', '.join(bad)}'s page faults: were the MALLOC_* variables "
              "ignored (not glibc, or a secure-execution process)?")
    print()


def run_step_benchmark(args, names, cfg, dataset, skip_note):
    """The loss check, the optional breakdown and the interleaved step timing; prints the
    tables. Returns [ok per target], or None if accelerate_c's losses diverge from torch's."""
    t_start = time.perf_counter()
    if not check_losses(names, cfg, dataset, args.batch, args.check_steps):
        return None

    if args.breakdown:
        breakdown(names, cfg, dataset, args.batch, max(2, min(args.steps, 5)), args.warmup)

    removed = _settings.removed_from_environment()
    if removed:
        print(f"NOTE: left out of every contender's environment: {' '.join(removed)} (the tables set their own)")
    print(f"timing ({', '.join(args.settings)}):")
    a = load_sample()
    out = bench_steps(names, args.settings, args.repeats, args.child_argv)
    load = other_load_between(a, load_sample())
    print()

    results = []
    for setting in args.settings:
        results += step_table(setting, names, *out[setting], args)
    explain_gap(args)
    if len(args.settings) == 2:
        tuning_table(names, out)
    if skip_note:
        print(f"NOTE: {skip_note}")
    if load is not None and load > 0.25:
        print(f"warning: other processes kept ~{load:.1f} CPUs busy while timing; the numbers are noisy")
    print(f"(step benchmark took {time.perf_counter() - t_start:.0f} s)")
    print()
    return results


# (self-contained: its constants, functions and the few lines in main() that call it)
def _part_in_child(part, part_argv, args):
    """Runs one part (--fp16-child / --clip-child) in a fresh process at glibc's defaults, echoes
    its report and returns its [ok per target], or None when it failed."""
    cmd = [sys.executable, os.path.abspath(__file__), f"--{part}-child"] + part_argv + args.child_argv
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                         env=_settings.process_env("defaults"))
    out = res.stdout.rstrip().splitlines()
    print("\n".join(out[:-1]) if res.returncode == 0 else res.stdout + res.stderr[-3000:])
    return json.loads(out[-1])[part] if res.returncode == 0 and out else None


# ---- main -------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per contender (default 5)")
    ap.add_argument("--steps", type=int, default=10, help="timed optimizer steps per repeat (default 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps per repeat (default 2)")
    ap.add_argument("--check-steps", type=int, default=3, help="optimizer steps of the loss comparison (default 3)")
    ap.add_argument("--model", choices=sorted(PRESETS), default="bench", help="model preset (default bench)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where model, batches and gradients live (default cpu; cuda: torch's current GPU)")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"sequences per micro-batch (default {DEFAULT_BATCH['cpu']} on cpu, "
                         f"{DEFAULT_BATCH['cuda']} on cuda)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default: the model's block_size)")
    ap.add_argument("--fp16-repeats", type=int, default=15, help="repeats of the fp16 micro-benchmark (>= 7)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny model, 2 repeats, 2 steps")
    ap.add_argument("--skip-accelerate", action="store_true", help="time torch and accelerate_c only")
    ap.add_argument("--skip-fp16", action="store_true", help="skip the fp16 post-processing micro-benchmark")
    ap.add_argument("--skip-steps", action="store_true", help="run only the fp16 post-processing micro-benchmark")
    ap.add_argument("--breakdown", action="store_true", help="also print where each contender's step goes")
    ap.add_argument("--settings", default=",".join(_settings.SETTINGS),
                    help="process settings to time, one table each: defaults, tuned (default both)")
    ap.add_argument("--skip-clip", action="store_true", help="skip the clip-in-a-real-loop benchmark")
    ap.add_argument("--clip-repeats", type=int, default=25, help="repeats of the clip-in-a-real-loop benchmark")
    ap.add_argument("--clip-child", action="store_true", help=argparse.SUPPRESS)  # internal: the clip part only
    ap.add_argument("--one-repeat", choices=["torch", "accelerate", "accelerate_c"], default=None,
                    help=argparse.SUPPRESS)  # internal: one contender's timed repeat, printed as JSON
    ap.add_argument("--fp16-child", action="store_true", help=argparse.SUPPRESS)  # internal: the fp16 part only
    args = ap.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print(f"bench_step: error: --device cuda: CUDA is not available (torch {torch.__version__}, "
                  f"built with CUDA {torch.version.cuda or 'none'}, {torch.cuda.device_count()} devices visible)",
                  file=sys.stderr)
            return 2
        if not getattr(_C, "has_cuda", True):
            print("bench_step: error: --device cuda: accelerate_c's C core was built without CUDA "
                  "(reinstall with nvcc on PATH)", file=sys.stderr)
            return 2
        _step_common.set_device(torch.device("cuda", torch.cuda.current_device()))
    else:
        _step_common.set_device(torch.device("cpu"))
    if args.batch is None:
        args.batch = DEFAULT_BATCH[args.device]
    if args.quick:
        args.model, args.repeats, args.steps, args.warmup, args.check_steps = "tiny", 2, 2, 1, 2
        args.fp16_repeats = 7
        args.clip_repeats = 7
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.check_steps < 1 or args.batch < 1:
        ap.error("--repeats, --steps, --check-steps and --batch must be >= 1, --warmup >= 0")
    args.fp16_repeats = max(7, args.fp16_repeats)
    try:
        args.settings = _settings.parse(args.settings)
    except ValueError as e:
        ap.error(str(e))

    cfg = PRESETS[args.model]
    seq = args.seq or cfg.block_size
    if seq > cfg.block_size:
        ap.error(f"--seq {seq} exceeds the model's block_size {cfg.block_size}")

    names = ["torch", "accelerate", "accelerate_c"]
    skip_note = None
    if args.skip_accelerate:
        skip_note = "accelerate skipped (--skip-accelerate): torch vs accelerate_c only"
    elif accelerate is None:
        skip_note = f"accelerate not importable ({ACCELERATE_ERROR}): torch vs accelerate_c only"
    if skip_note:
        names.remove("accelerate")

    micro_batches = ACCUM * (max(args.warmup + args.steps, args.check_steps) + 1) + 2  # + the loader's lookahead
    dataset = TokenDataset(make_tokens(micro_batches * args.batch, seq, cfg.vocab_size, seed=DATA_SEED))
    # what a --one-repeat child needs to rebuild the same model and data (the resolved values)
    args.child_argv = ["--model", args.model, "--device", args.device, "--batch", str(args.batch), "--seq", str(seq),
                       "--steps", str(args.steps), "--warmup", str(args.warmup), "--check-steps", str(args.check_steps)]
    if args.one_repeat:
        times, faults = time_one_repeat(args.one_repeat, cfg, dataset, args.batch, args.steps, args.warmup)
        print(json.dumps({"step_seconds": times, "faults_per_step": faults}))
        return 0
    if args.clip_child:
        clip = run_clip_benchmark(args, cfg, dataset)
        print(json.dumps({"clip": clip}))
        return 0 if clip is not None else 1
    if args.fp16_child:
        fp16 = run_fp16_benchmark(args, cfg, dataset)
        if fp16 is None:
            return 1
        print(json.dumps({"fp16": fp16}))
        return 0
    n_params = GPT(cfg).num_params()
    args.grad_bytes = 4 * n_params  # the fp32 gradients (the parameters are fp32; autocast is bf16)

    print(f"bench_step: {cpu_model()}, {logical_cpus()} logical CPUs; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), accelerate "
          f"{getattr(accelerate, '__version__', 'n/a')}, accelerate_c {accelerate_c.__version__} "
          f"(_C threads {_C.get_num_threads()}, kernels {_C.kernel_isa()}"
          + (f", pool {_C.pool_backend()}" if hasattr(_C, "pool_backend") else "") + ")")
    if on_cuda():
        major, minor = torch.cuda.get_device_capability(_step_common.DEVICE)
        free, total = torch.cuda.mem_get_info(_step_common.DEVICE)
        print(f"device: {_step_common.DEVICE} = {torch.cuda.get_device_name(_step_common.DEVICE)} (sm_{major}{minor}, "
              f"{total / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free), CUDA {torch.version.cuda}, "
              f"{torch.cuda.device_count()} visible; accelerate_c CUDA kernels "
              f"{'built' if getattr(_C, 'has_cuda', False) else 'NOT built'}; every timer read synchronizes")
    print(f"model '{args.model}': {n_params / 1e6:.1f}M parameters ({cfg.n_layer} layers, d_model {cfg.d_model}, "
          f"{cfg.n_head} heads, vocab {cfg.vocab_size}); micro-batch {args.batch} x {seq} tokens, "
          f"accumulation {ACCUM}, clip {MAX_NORM}, AdamW, bf16 autocast")
    print(f"{args.repeats} repeats x {args.steps} timed optimizer steps (+{args.warmup} warm-up) per contender "
          f"and table ({', '.join(args.settings)})")
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "AC_KERNELS_ISA")
           if k in os.environ}
    if env:  # these change how torch's OpenMP threads and our C pool share the cores
        print("environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
    if skip_note:
        print(f"NOTE: {skip_note}")
    load = other_load(0.5)
    if load is not None and load > 0.25:
        print(f"warning: other processes keep ~{load:.1f} CPUs busy; numbers will be noisy")
    print()

    t_all = time.perf_counter()
    results = []
    if not args.skip_steps:
        step_results = run_step_benchmark(args, names, cfg, dataset, skip_note)
        if step_results is None:
            return 1  # accelerate_c diverged from plain torch
        results += step_results

    if not args.skip_fp16:
        # in a fresh process, as when run alone (--skip-steps): after the step benchmark this
        # process's heap is fragmented and huge pages are scarcer, which shifted the ratio
        fp16 = (run_fp16_benchmark(args, cfg, dataset) if args.skip_steps
                else _part_in_child("fp16", ["--fp16-repeats", str(args.fp16_repeats)], args))
        if fp16 is None:
            return 1
        results += fp16

    if not args.skip_clip:
        clip = (run_clip_benchmark(args, cfg, dataset) if args.skip_steps and args.skip_fp16
                else _part_in_child("clip", ["--clip-repeats", str(args.clip_repeats)], args))
        if clip is None:
            return 1
        results += clip

    print(f"total {time.perf_counter() - t_all:.0f} s; targets: "
          f"{sum(results)}/{len(results)} PASS" + ("" if all(results) else " (a MISS is reported, not an error)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
