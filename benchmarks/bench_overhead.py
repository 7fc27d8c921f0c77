"""What the library itself adds to a training step: accelerate_c vs accelerate 1.15 vs a plain
torch loop on a model so small that the step is almost all Python and dispatch.

bench_step times a 14M-parameter model, where the library's own work is a fraction of a percent
of the step and the ratio between contenders is decided by the machine's run-to-run spread. Here
the model is a 16-16-4 MLP (one optimizer step = 2 micro-batches of 4 samples), so what each
library does around torch's forward, backward, clip and AdamW is most of the time:

  torch         autocast("cpu", bfloat16) forward, mse loss, (loss / 2).backward(); every second
                micro-batch clip_grad_norm_(params, 1.0), opt.step(), sched.step(),
                opt.zero_grad(set_to_none=True); iterates the raw DataLoader
  accelerate    Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True):
                prepare(model, opt, loader, sched); accumulate(); backward; clip_grad_norm_ when
                sync_gradients; opt.step(); sched.step(); opt.zero_grad()
  accelerate_c  the same code with `from accelerate_c import Accelerator`

Each repeat of each contender is a fresh process (defaults: glibc's malloc settings, as
benchmarks/_settings.py), one thread, garbage collection paused while timing; repeats are
interleaved across contenders in rotated order. A repeat's sample is the mean time of an
optimizer step over --steps steps. The overhead of a library is its median step time minus the
plain torch loop's (the limit: what the same math costs without a library).

Target: overhead(accelerate) / overhead(accelerate_c) >= 1.0 (accelerate_c adds no more than
accelerate does).

    .venv/bin/python benchmarks/bench_overhead.py               # ~1 minute
    .venv/bin/python benchmarks/bench_overhead.py --repeats 9 --steps 1000
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONTENDERS = ("torch", "accelerate", "accelerate_c")


def _loop(name: str):
    """Builds the contender's model, optimizer, loader and scheduler; returns run(n): n steps."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 16, generator=g), torch.randn(4, 4, generator=g)) for _ in range(64)]
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mse = torch.nn.functional.mse_loss
    if name == "torch":
        def run(n):
            done = 0
            while True:
                for i, (x, y) in enumerate(loader):
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        out = model(x)
                    (mse(out.float(), y) / 2).backward()
                    if i % 2 == 1:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        opt.step()
                        sched.step()
                        opt.zero_grad(set_to_none=True)
                        done += 1
                        if done == n:
                            return
        return run
    if name == "accelerate":
        from accelerate import Accelerator
    else:
        from accelerate_c import Accelerator
    acc = Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)

    def run(n):
        done = 0
        while True:
            for x, y in loader:
                with acc.accumulate(model):
                    acc.backward(mse(model(x), y))
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                if acc.sync_gradients:
                    done += 1
                    if done == n:
                        return
    return run


def _one_repeat(name: str, steps: int, warmup: int) -> None:
    import torch

    torch.set_num_threads(1)
    run = _loop(name)
    run(warmup)
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    run(steps)
    print(f"RESULT {(time.perf_counter() - t0) / steps * 1e6:.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=600, help="timed optimizer steps per repeat")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--one-repeat", choices=CONTENDERS, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one_repeat:
        _one_repeat(a.one_repeat, a.steps, a.warmup)
        return 0
    from _common import other_load, print_table, quantile
    from _settings import process_env
    from _targets import info, target

    env = dict(process_env("defaults"), OMP_NUM_THREADS="1")
    samples = {n: [] for n in CONTENDERS}
    print(f"{a.repeats} repeats x {a.steps} optimizer steps (+{a.warmup} warm-up) per contender, each a fresh process")
    load = other_load()
    for r in range(a.repeats):
        order = CONTENDERS[r % 3:] + CONTENDERS[:r % 3]
        for name in order:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one-repeat", name, "--steps",
                                  str(a.steps), "--warmup", str(a.warmup)], env=env, capture_output=True, text=True,
                                 timeout=600)
            line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                print(out.stdout[-2000:] + out.stderr[-2000:])
                raise SystemExit(f"bench_overhead: the {name} repeat failed")
            samples[name].append(float(line[0].split()[1]))
        print(f"  repeat {r + 1}/{a.repeats}: " + ", ".join(f"{n} {samples[n][-1]:.1f}" for n in CONTENDERS)
              + " us/step")
    med = {n: statistics.median(v) for n, v in samples.items()}
    rows = [[n, f"{med[n]:.1f}", f"{quantile(samples[n], 0.25):.1f}", f"{quantile(samples[n], 0.75):.1f}",
             "" if n == "torch" else f"{med[n] - med['torch']:.1f}"] for n in CONTENDERS]
    print_table(["contender", "us/step med", "q1", "q3", "overhead us (med - torch)"], rows)
    over_ours, over_theirs = med["accelerate_c"] - med["torch"], med["accelerate"] - med["torch"]
    ratio = over_theirs / over_ours if over_ours > 0 else float("inf")
    limit = f"plain torch loop {med['torch']:.1f} us/step (the same math without a library)"
    ok = target("bench_overhead", "library overhead per step: accelerate / accelerate_c (tiny MLP, bf16, "
                    "accumulation 2, clip)", ratio, 1.0, limit=limit)
    info("bench_overhead", "step time accelerate_c / torch (tiny MLP)", med["accelerate_c"] / med["torch"])
    print(f"overhead ratio accelerate / accelerate_c: {ratio:.2f}x  target >= 1.0x  {'PASS' if ok else 'MISS'}"
          f"   ({limit})")
    if load is not None and load > 0.3:
        print(f"warning: other processes kept ~{load:.1f} CPUs busy before timing; the numbers are noisy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
