"""Data-parallel training-step throughput on 2 CPU processes (gloo): accelerate_c vs accelerate 1.15
(torch DDP underneath) vs plain torch DDP, on a small transformer and a ~100M-parameter MLP.

Run it plainly; it launches itself on 2 processes through accelerate_c's launcher
(`accelerate-c launch --num_processes 2 --cpu --main_process_port 0 bench_ddp.py --worker ...`,
torchrun underneath, one OpenMP thread per process on a 2-core machine):

    .venv/bin/python benchmarks/bench_ddp.py                 # the full run (~5 min quiet, ~8 busy)
    .venv/bin/python benchmarks/bench_ddp.py --quick         # smoke test (~1.5 min quiet, 3 busy)
    .venv/bin/python benchmarks/bench_ddp.py --models mlp --repeats 7 --steps 10

All contenders run in ONE process group (initialised once, before any of them, and shared: both
Accelerators find it initialised and use it). Three contenders, the same model init (seeded), the
same per-rank batches (rank r's step k takes global batch k * world + r, as accelerate shards a
loader), the same optimizer, fp32 by default:

  torch_ddp     DistributedDataParallel(model, gradient_as_bucket_view=True) (bucket_cap_mb 25),
                    loss = loss_of(ddp, batch); loss.backward(); opt.step(); opt.zero_grad()
  accelerate    accelerate 1.15's Accelerator(cpu=True): prepare(model, opt) wraps the model in
                torch DDP with accelerate's defaults (gradient_as_bucket_view=False), then
                    loss = loss_of(model, batch); accelerator.backward(loss); opt.step(); opt.zero_grad()
  accelerate_c  the same code with `from accelerate_c import Accelerator` (bucketed all-reduce
                launched from gradient hooks while backward runs, waited at its end)

accelerate_c runs as a user gets it: its CPU collectives through shared memory (the default on
one host; the gradient buffers in shared windows, reduced in place). --shm adds two contenders:
accelerate_c_gloo (the same code with CpuCommKwargs(comm="gloo")) and accelerate_c_nosync (every
step under accelerator.no_sync: no reduction at all, the bound a faster all-reduce approaches;
left out of the correctness check, as it computes something else). Its target:
(t_gloo - t_shm) / (t_gloo - t_nosync) >= 0.70 in median step times.

Batches are pre-built tensors (no DataLoader) so the comparison is about gradient reduction, not
data loading. Models:
  gpt   benchmarks/models.py's "bench" preset (13.8M parameters, the model of bench_step.py),
        4 x 128 tokens per rank, AdamW; --gpt-precision bf16 runs its forward under bf16
        autocast (torch_ddp: torch.autocast; the Accelerators: mixed_precision="bf16")
  mlp   6 x Linear(4096, 4096) with ReLUs between (100.7M parameters, 403 MB of fp32 gradients),
        8 rows per rank, MSE loss, SGD with momentum 0.9: little compute per byte of gradient,
        so the step is communication-bound

Repeats are interleaved: in every repeat each contender (in an order rotated from repeat to
repeat) builds a fresh model and optimizer from the same seed, prepares/wraps them, runs --warmup
untimed steps, then --steps timed ones; the model is deleted (gc.collect()) before the next
contender, so only one contender's ~1.6 GB per process (the mlp) is alive at a time. A timed step
is forward + backward + optimizer step + zero_grad. Timing: a barrier before the first timed step
(untimed), none inside; each rank reads time.perf_counter() around its steps and the slowest
rank's time (all_reduce MAX) defines the repeat's steps/s. The garbage collector is paused while
timing. Each repeat ends with a measurement of the loopback limit (below).

Correctness guard (untimed, before any timing, and warming the processes up): each contender trains
--check-steps steps from the same seed on the same data, and its parameters are compared with the
first contender's (torch_ddp): max over tensors of max|a - b| / max|b|, worst of both ranks, must be
<= 1e-5 (fp32; 1e-3 under bf16 autocast); every rank's parameters are also compared with rank 0's
(per-tensor checksums). It is printed; a mismatch is an ERROR, that model's timing is skipped and
the exit status is 1 (a benchmark that compares different computations is useless).

Communication figures, per model:
  all-reduce bytes per step  torch DDP: the trainable gradients' bytes; accelerate_c: the bytes
                             of its flat gradient buffers (accelerator._grads.groups[i].flat),
                             which may carry a little alignment padding
  loopback limit             a plain dist.all_reduce of one tensor of that many bytes, timed in
                             a loop (median), and the same bytes as 25 MiB async all-reduces
                             waited in order (what a bucketed reducer issues); bus bandwidth =
                             2 (n - 1) / n * bytes / time, gloo over loopback TCP on this machine
  implied bus bandwidth      2 (n - 1) / n * bytes * steps/s: the bandwidth if the whole step were
                             communication, a lower bound on what the reducer achieved (the
                             all-reduce overlaps backward, so its own time cannot be isolated)
  comm share at the limit    loopback all-reduce time / step time: the part of a step that the
                             all-reduce alone would take at the loopback limit

Targets (a MISS is reported, not an error; the exit status is 0 unless something broke):
  * median(accelerate_c) / median(accelerate) >= 1.00 on both models
  * median(accelerate_c) / median(torch_ddp) >= 0.97 on both models
With 2 ranks on 2 cores and gloo underneath all three, parity is expected, not a win.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import (  # noqa: E402
    RATE_HEADERS,
    Summary,
    cpu_model,
    load_sample,
    logical_cpus,
    print_table,
    rate_rows,
    quantile,
    verdict,
)
import _targets  # noqa: E402

NAMES = ["torch_ddp", "accelerate", "accelerate_c"]  # the first one is the correctness reference
# --shm: accelerate_c over shared memory, and with no reduction at all (the bound); target: the
# shared-memory run gets >= 70% of the step time the bound saves over gloo
SHM_NAMES = ("accelerate_c_gloo", "accelerate_c_nosync")
TARGET_SHM_SHARE = 0.70
TARGET_VS_ACCELERATE = 1.00
TARGET_VS_TORCH_DDP = 0.97
PARAM_RTOL = {"no": 1e-5, "bf16": 1e-3}
SEED = 1234
DATA_SEED = 4321
BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's (and accelerate_c's) bucket_cap_mb default
MLP_WIDTH, MLP_LAYERS = 4096, 6


# ---- launcher (plain run) --------------------------------------------------------------
def launch_self(argv: List[str]) -> int:
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable)) or shutil.which("accelerate-c")
    launcher = [exe] if exe else [sys.executable, "-m", "accelerate_c.commands.main"]
    cmd = launcher + ["launch", "--num_processes", "2", "--cpu", "--main_process_port", "0",
                      os.path.abspath(__file__), "--worker", *argv]
    print("launching: " + " ".join(shlex.quote(a) for a in cmd), flush=True)
    env = dict(os.environ)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["BENCH_DDP_CMDLINE"] = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    # the workers exit 0 after a failed correctness check (a non-zero rank makes torchrun print a
    # traceback that buries the message); rank 0 leaves the verdict in this file instead
    fd, status_path = tempfile.mkstemp(prefix="bench_ddp_status_")
    os.close(fd)
    env["BENCH_DDP_STATUS"] = status_path
    try:
        rc = subprocess.call(cmd, env=env)
        with open(status_path) as f:
            if rc == 0 and f.read().strip() == "mismatch":
                rc = 1
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        os.unlink(status_path)


# ---- everything below runs in the workers ----------------------------------------------
def worker(args) -> int:  # noqa: C901 (one linear script)
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import accelerate_c
    import accelerate_c.state
    from accelerate_c import _C
    from models import GPT, PRESETS, TokenDataset, make_tokens

    try:
        import accelerate
        import accelerate.state
        acc_error = None
    except Exception as e:  # not installed, or broken
        accelerate, acc_error = None, f"{type(e).__name__}: {e}"

    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print("bench_ddp: --worker must run under the launcher (WORLD_SIZE >= 2); run the script plainly",
              file=sys.stderr)
        return 2
    dist.init_process_group("gloo")  # the one group every contender uses
    rank, world = dist.get_rank(), dist.get_world_size()
    main = rank == 0
    threads = torch.get_num_threads()

    def say(*a, **kw):
        if main:
            print(*a, **kw, flush=True)

    def max_across(values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def sum_across(values: List[float]) -> List[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    names = list(NAMES) + (list(SHM_NAMES) if args.shm else [])
    if accelerate is None:
        names.remove("accelerate")

    # ---- models ------------------------------------------------------------------------
    @dataclass
    class Spec:
        key: str
        desc: str
        build: Callable[[], nn.Module]
        make_opt: Callable[[object], torch.optim.Optimizer]
        loss_of: Callable[[nn.Module, tuple], torch.Tensor]
        batches: list  # this rank's batches, one per step (warm-up + timed)
        precision: str  # "no" or "bf16"
        n_params: int

    n_batches = max(args.warmup + args.steps, args.check_steps)

    def gpt_spec():
        cfg = PRESETS["bench"]
        seq = cfg.block_size
        data = TokenDataset(make_tokens(n_batches * world * args.gpt_batch, seq, cfg.vocab_size, seed=DATA_SEED))
        batches = []
        for k in range(n_batches):
            first = (k * world + rank) * args.gpt_batch
            rows = [data[i] for i in range(first, first + args.gpt_batch)]
            batches.append((torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])))

        def build():
            torch.manual_seed(SEED)
            return GPT(cfg)

        n = sum(p.numel() for p in build().parameters())
        return Spec("gpt", f"GPT 'bench' preset: {n / 1e6:.1f}M parameters ({cfg.n_layer} layers, d_model "
                           f"{cfg.d_model}, vocab {cfg.vocab_size}, tied head), {args.gpt_batch} x {seq} tokens "
                           f"per rank, AdamW, {'bf16 autocast' if args.gpt_precision == 'bf16' else 'fp32'}",
                    build,
                    lambda params: torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
                    lambda model, b: model(b[0], b[1]),
                    batches, args.gpt_precision, n)

    def mlp_spec():
        def build():
            torch.manual_seed(SEED)
            layers = []
            for i in range(MLP_LAYERS):
                layers.append(nn.Linear(MLP_WIDTH, MLP_WIDTH))
                if i < MLP_LAYERS - 1:
                    layers.append(nn.ReLU())
            return nn.Sequential(*layers)

        g = torch.Generator().manual_seed(DATA_SEED)
        batches = []
        for k in range(n_batches):
            x = torch.randn(world, args.mlp_batch, MLP_WIDTH, generator=g)[rank].contiguous()
            y = torch.randn(world, args.mlp_batch, MLP_WIDTH, generator=g)[rank].contiguous()
            batches.append((x, y))
        n = MLP_LAYERS * (MLP_WIDTH * MLP_WIDTH + MLP_WIDTH)
        return Spec("mlp", f"MLP: {MLP_LAYERS} x Linear({MLP_WIDTH}, {MLP_WIDTH}), {n / 1e6:.1f}M parameters, "
                           f"{args.mlp_batch} rows per rank, MSE, SGD momentum 0.9, fp32",
                    build,
                    lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
                    lambda model, b: F.mse_loss(model(b[0]), b[1]),
                    batches, "no", n)

    # ---- contenders --------------------------------------------------------------------
    def reset_singletons():
        if accelerate is not None:
            accelerate.state.AcceleratorState._reset_state(True)
            accelerate.state.GradientState._reset_state()
        accelerate_c.state.AcceleratorState._reset_state()
        accelerate_c.state.GradientState._reset_state()

    def prepare(name, spec):
        """Builds contender `name`; returns (step(i), raw module, all-reduce bytes, keepalive)."""
        reset_singletons()
        raw = spec.build()
        grad_bytes = sum(p.numel() * p.element_size() for p in raw.parameters() if p.requires_grad)
        if name == "torch_ddp":
            model = DDP(raw, gradient_as_bucket_view=True)
            opt = spec.make_opt(model.parameters())
            amp = spec.precision == "bf16"

            def step(i):
                if amp:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        loss = spec.loss_of(model, spec.batches[i])
                else:
                    loss = spec.loss_of(model, spec.batches[i])
                loss.backward()
                opt.step()
                opt.zero_grad()
            return step, raw, (lambda: grad_bytes), (model, opt)
        mod = accelerate if name == "accelerate" else accelerate_c
        kwargs = {}
        if name.startswith("accelerate_c"):  # each says how its CPU collectives travel (--shm)
            kwargs["kwargs_handlers"] = [accelerate_c.utils.CpuCommKwargs(comm="gloo" if name == "accelerate_c_gloo"
                                                                          else "auto")]
        accelerator = mod.Accelerator(cpu=True, mixed_precision=spec.precision, **kwargs)
        if accelerator.num_processes != world:
            raise SystemExit(f"{name}'s Accelerator sees {accelerator.num_processes} processes, not {world}")
        model, opt = accelerator.prepare(raw, spec.make_opt(raw.parameters()))
        if torch.get_num_threads() != threads:  # keep every contender on the same thread count
            say(f"note: {name} changed torch threads {threads} -> {torch.get_num_threads()}; restored")
            torch.set_num_threads(threads)
        if name.startswith("accelerate_c"):
            def nbytes():
                return sum(g.flat.numel() * g.flat.element_size() for g in accelerator._grads.groups)
        else:
            if not isinstance(model, DDP):
                raise SystemExit(f"accelerate did not wrap the model in DDP (got {type(model).__name__})")

            def nbytes():
                return grad_bytes

        def step(i):
            # accelerate_c_nosync: the same step with no gradient reduction at all (no_sync on
            # every step), the bound a faster all-reduce can approach
            with accelerator.no_sync(model) if name == "accelerate_c_nosync" else contextlib.nullcontext():
                loss = spec.loss_of(model, spec.batches[i])
                accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        return step, raw, nbytes, (accelerator, model, opt)

    def run_one(name, spec):
        """One repeat of one contender: returns (steps/s, [s per step] of the slowest rank, bytes)."""
        step, raw, nbytes, keep = prepare(name, spec)
        for i in range(args.warmup):
            step(i)
        gc.collect()
        gc.disable()
        try:
            dist.barrier()  # untimed: every rank starts the timed steps together
            t_start = t_prev = time.perf_counter()
            marks = []
            for i in range(args.warmup, args.warmup + args.steps):
                step(i)
                t = time.perf_counter()
                marks.append(t - t_prev)
                t_prev = t
            elapsed = t_prev - t_start
        finally:
            gc.enable()
        slowest = max_across([elapsed] + marks)  # the slowest rank defines the rate
        result = (args.steps / slowest[0], slowest[1:], nbytes())
        del step, raw, keep
        gc.collect()
        return result

    def check_contenders(spec):
        """Untimed: every contender trains --check-steps steps from the same seed on the same data;
        returns {name: (max rel diff vs names[0], max rel diff rank vs rank 0)}, over both ranks.
        Also warms the processes up (allocator, gloo connections) before any timing."""
        ref, out = None, {}
        for name in names:
            if name == "accelerate_c_nosync":  # not the same computation: only a bound (--shm)
                out[name] = (0.0, 0.0)
                continue
            step, raw, _, keep = prepare(name, spec)
            for i in range(args.check_steps):
                step(i)
            params = [p.detach() for p in raw.parameters()]
            if ref is None:
                ref = [p.clone() for p in params]
                diff = 0.0
            else:
                diff = 0.0
                for a, b in zip(params, ref):
                    diff = max(diff, float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30))
            # ranks must hold the same parameters too: every tensor's checksum against rank 0's
            sums = torch.tensor([float(p.double().sum()) for p in params], dtype=torch.float64)
            sums0 = sums.clone()
            dist.broadcast(sums0, src=0)
            rank_diff = float(((sums - sums0).abs() / sums0.abs().clamp_min(1e-30)).max())
            out[name] = tuple(max_across([diff, rank_diff]))
            del step, raw, keep, params
            gc.collect()
        del ref
        gc.collect()
        return out

    def loopback(nbytes):
        """(s per whole-tensor all_reduce, s per bucketed all-reduce of the same bytes), medians of
        the slowest rank over a few iterations."""
        t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        chunks = list(t.split(BUCKET_BYTES // 4))
        iters = args.loopback_iters
        whole, bucketed = [], []
        dist.all_reduce(t)  # warm the connections for this size
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            whole.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            works = [dist.all_reduce(c, async_op=True) for c in chunks]
            for w in works:
                w.wait()
            bucketed.append(time.perf_counter() - t0)
        whole, bucketed = max_across(whole), max_across(bucketed)
        del t, chunks
        return quantile(whole, 0.5), quantile(bucketed, 0.5)

    def machine_load():
        """(sample, own CPU ticks summed over the ranks) for other_load_during()."""
        s = load_sample()
        own = sum_across([s[2] if s else 0.0])[0]
        return s, own

    def other_load_during(a, b):
        """CPUs' worth of work done by processes other than the ranks between two machine_load()s."""
        (sa, own_a), (sb, own_b) = a, b
        if sa is None or sb is None or sb[1] <= sa[1]:
            return None
        return max(0.0, (sb[0] - sa[0]) - (own_b - own_a)) / (sb[1] - sa[1]) * sb[3]

    # ---- header ------------------------------------------------------------------------
    say(f"bench_ddp: {os.environ.get('BENCH_DDP_CMDLINE') or ' '.join(map(shlex.quote, [sys.executable] + sys.argv))}")
    say(f"{cpu_model()}, {logical_cpus()} logical CPUs; {world} processes, backend {dist.get_backend()}, "
        f"{threads} torch thread(s) per process (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')})")
    say(f"torch {torch.__version__}, accelerate {getattr(accelerate, '__version__', 'n/a')}, accelerate_c "
        f"{accelerate_c.__version__} (_C threads {_C.get_num_threads()}, kernels {_C.kernel_isa()})")
    say(f"{args.repeats} interleaved repeats x {args.steps} timed steps (+{args.warmup} warm-up) per contender; "
        f"targets: accelerate_c / accelerate >= {TARGET_VS_ACCELERATE:.2f}x, accelerate_c / torch_ddp >= "
        f"{TARGET_VS_TORCH_DDP:.2f}x (median steps/s)")
    if acc_error:
        say(f"NOTE: accelerate not importable ({acc_error}): torch_ddp vs accelerate_c only")
    a0 = machine_load()
    time.sleep(0.5)
    load = other_load_during(a0, machine_load())
    if load is not None and load > 0.25:
        say(f"warning: other processes keep ~{load:.1f} CPUs busy; numbers will be noisy")
    say()

    # ---- per model ---------------------------------------------------------------------
    t_all = time.perf_counter()
    results, broken = [], False
    for key in args.models:
        spec = gpt_spec() if key == "gpt" else mlp_spec()
        say(f"== {key}: {spec.desc}")
        t_model = time.perf_counter()
        rates = {n: [] for n in names}
        per_step = {n: [] for n in names}
        nbytes = {}
        lb_whole, lb_bucketed = [], []

        diffs = check_contenders(spec)
        rtol = PARAM_RTOL[spec.precision]
        rows, ok = [], True
        for n in names:
            d, rd = diffs[n]
            good = d <= rtol and rd <= rtol
            ok = ok and good
            rows.append([n, "reference" if n == names[0] else f"{d:.1e}", f"{rd:.1e}", "ok" if good else "MISMATCH"])
        say(f"correctness: parameters after {args.check_steps} steps from the same seed on the same data, untimed "
            f"(max|a - b| / max|b| per tensor, worst tensor, worst rank; limit {rtol:g}):")
        if main:
            print_table(["contender", "vs " + names[0], "rank vs rank 0 (checksums)", ""], rows)
        if not ok:
            say(f"ERROR: the contenders' parameters disagree on {key}: the timings would compare different "
                "computations; skipping its timing", file=sys.stderr)
            broken = True
            say()
            continue

        say("timing:")
        la = machine_load()
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                rate, steps_s, nb = run_one(name, spec)
                rates[name].append(rate)
                per_step[name].extend(steps_s)
                nbytes[name] = nb
            w, b = loopback(nbytes["accelerate_c"])
            lb_whole.append(w)
            lb_bucketed.append(b)
            say(f"  repeat {r + 1}/{args.repeats}: " + ", ".join(f"{n} {rates[n][-1]:.3f}" for n in names)
                + f" steps/s; loopback all_reduce {w * 1e3:.0f} ms, bucketed {b * 1e3:.0f} ms")
        load = other_load_during(la, machine_load())
        say()

        S = {n: Summary.of(rates[n]) for n in names}
        rows = rate_rows(names, rates, per_step)
        say(f"steps/s over {args.repeats} repeats (each: {args.steps} steps / the slowest rank's seconds); and "
            f"single steps' times (slowest rank) pooled over repeats:")
        if main:
            print_table(RATE_HEADERS,
                        rows)
        say()

        ours = S["accelerate_c"]
        ratio_rows, to_record = [], []
        if "accelerate" in names:
            r_med = ours.median / S["accelerate"].median
            ok = r_med >= TARGET_VS_ACCELERATE
            results.append((key, "accelerate", ok))
            to_record.append(("accelerate", r_med, TARGET_VS_ACCELERATE))
            ratio_rows.append(["accelerate_c / accelerate", f"{r_med:.3f}x",
                               f"{ours.q1 / S['accelerate'].median:.3f}x",
                               f"{ours.q3 / S['accelerate'].median:.3f}x",
                               f">= {TARGET_VS_ACCELERATE:.2f}x", verdict(ok)])
        r_med = ours.median / S["torch_ddp"].median
        ok = r_med >= TARGET_VS_TORCH_DDP
        results.append((key, "torch_ddp", ok))
        to_record.append(("torch_ddp", r_med, TARGET_VS_TORCH_DDP))
        ratio_rows.append(["accelerate_c / torch_ddp", f"{r_med:.3f}x", f"{ours.q1 / S['torch_ddp'].median:.3f}x",
                           f"{ours.q3 / S['torch_ddp'].median:.3f}x", f">= {TARGET_VS_TORCH_DDP:.2f}x", verdict(ok)])
        if args.shm:
            t_gloo, t_shm, t_none = (1 / S[n].median for n in ("accelerate_c_gloo", "accelerate_c",
                                                               "accelerate_c_nosync"))
            share = (t_gloo - t_shm) / (t_gloo - t_none) if t_gloo > t_none else float("nan")
            ok = share >= TARGET_SHM_SHARE
            results.append((key, "accelerate_c_nosync", ok))
            to_record.append(("the all-reduce skipped: share of its saving over gloo won by shm", share,
                              TARGET_SHM_SHARE))
            ratio_rows.append(["(gloo - shm) / (gloo - no reduction), step time", f"{share:.2f}",
                               f"{1e3 * t_gloo:.0f} ms", f"{1e3 * t_shm:.0f} / {1e3 * t_none:.0f} ms",
                               f">= {TARGET_SHM_SHARE:.2f}", verdict(ok)])
        say("ratios of steps/s (median: median/median; q1, q3: our quartile / their median):")
        if main:
            print_table(["ratio", "median", "q1", "q3", "target (median)", ""], ratio_rows)
        say()

        bus = 2 * (world - 1) / world
        w_med, b_med = quantile(lb_whole, 0.5), quantile(lb_bucketed, 0.5)
        nb = nbytes["accelerate_c"]
        say(f"all-reduce bytes per step: accelerate_c {nbytes['accelerate_c'] / 1e6:.2f} MB (its flat buffers, "
            f"padding included); torch_ddp {nbytes['torch_ddp'] / 1e6:.2f} MB"
            + (f", accelerate {nbytes['accelerate'] / 1e6:.2f} MB" if "accelerate" in names else "")
            + " (the trainable gradients)")
        say(f"loopback limit (gloo on this machine, same run, {nb / 1e6:.1f} MB, median of {args.repeats} x "
            f"{args.loopback_iters}): one all_reduce {w_med * 1e3:.1f} ms = {bus * nb / w_med / 1e9:.2f} GB/s bus; "
            f"as 25 MiB async buckets {b_med * 1e3:.1f} ms = {bus * nb / b_med / 1e9:.2f} GB/s bus")
        comm_rows = []
        for n in names:
            step_s = 1.0 / S[n].median
            comm_rows.append([n, f"{nbytes[n] / 1e6:.2f}", f"{1e3 * step_s:.1f}",
                              f"{bus * nbytes[n] / step_s / 1e9:.3f}", f"{bus * nb / b_med / 1e9:.3f}",
                              f"{100 * b_med / step_s:.0f}%"])
        if main:
            print_table(["contender", "MB/step", "ms/step", "implied bus GB/s (>=)", "loopback bus GB/s",
                         "comm share at limit"], comm_rows)
        say("(implied = 2(n-1)/n x bytes / step time, as if the whole step were communication: a lower bound on "
            "the bandwidth the reducer achieved, since the all-reduce overlaps backward; comm share = the "
            "bucketed loopback all-reduce time / step time)")
        limit = (f"gloo loopback {bus * nb / b_med / 1e9:.2f} GB/s bus; all-reduce alone "
                 f"{100 * b_med * S['accelerate_c'].median:.0f}% of our step")
        for other, ratio, goal in to_record if main else ():
            what = f"{key}: {other}" if other.startswith("the all-reduce") else f"{key}: steps/s vs {other}"
            _targets.target("bench_ddp", f"{what}, {world} processes", ratio, goal, limit=limit)
        if load is not None and load > 0.25:
            say(f"warning: other processes kept ~{load:.1f} CPUs busy while timing {key}; the numbers are noisy")
        say(f"({key} took {time.perf_counter() - t_model:.0f} s)")
        say()

    n_ok = sum(ok for _, _, ok in results)
    say("summary: " + (", ".join(f"{k} vs {o} {verdict(ok)}" for k, o, ok in results) or "nothing timed"))
    say(f"total {time.perf_counter() - t_all:.0f} s; targets: {n_ok}/{len(results)} PASS"
        + ("" if n_ok == len(results) else " (a MISS is reported, not an error)")
        + ("; ERROR: a correctness check failed (above)" if broken else ""))
    status = os.environ.get("BENCH_DDP_STATUS")
    if main and status:
        with open(status, "w") as f:
            f.write("mismatch" if broken else "ok")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if broken and not status else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per contender (default 5)")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per repeat (default 6)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per repeat (default 2)")
    ap.add_argument("--models", default="gpt,mlp", help="comma-separated: gpt, mlp (default gpt,mlp)")
    ap.add_argument("--gpt-batch", type=int, default=4, help="sequences of 128 tokens per rank (default 4)")
    ap.add_argument("--gpt-precision", choices=["no", "bf16"], default="no",
                    help="the GPT's forward: fp32 ('no', default) or bf16 autocast")
    ap.add_argument("--mlp-batch", type=int, default=8, help="rows per rank for the MLP (default 8)")
    ap.add_argument("--check-steps", type=int, default=3,
                    help="steps of the untimed correctness check, before timing (default 3)")
    ap.add_argument("--loopback-iters", type=int, default=3, help="loopback all-reduces per repeat (default 3)")
    ap.add_argument("--shm", action="store_true",
                    help="also accelerate_c over gloo and accelerate_c with no reduction (the bound)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 repeats x 2 steps (+1 warm-up), 2 check steps")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup, args.check_steps, args.loopback_iters = 2, 2, 1, 2, 2
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in args.models if m not in ("gpt", "mlp")]
    if bad or not args.models:
        ap.error(f"--models: expected a comma-separated list of gpt, mlp; got {bad or 'nothing'}")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0 or args.gpt_batch < 1 or args.mlp_batch < 1 \
            or args.loopback_iters < 1 or args.check_steps < 1:
        ap.error("--repeats, --steps, --gpt-batch, --mlp-batch, --loopback-iters must be >= 1, --warmup >= 0")
    if not args.worker:
        return launch_self(list(argv if argv is not None else sys.argv[1:]))
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
