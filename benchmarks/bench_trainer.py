"""The same transformers.Trainer script on real accelerate 1.15 and on accelerate_c
(`accelerate_c.transformers.Trainer`, the one-line change), 1 and 2 CPU processes: train
steps/s and peak RSS side by side.

    .venv/bin/python benchmarks/bench_trainer.py                  # ~6 min on 2 busy cores
    .venv/bin/python benchmarks/bench_trainer.py --repeats 1 --steps 4 --worlds 1   # smoke test

Model: LlamaForCausalLM from a config (hidden 384, 6 layers, 6 heads, 2 key/value heads, MLP
1024, vocabulary 8000: 15.5M parameters), bf16, 4 sequences x 128 tokens per process and step,
AdamW, clipping at 1.0, no evaluation, no checkpoints. Every contender runs in fresh processes
with the same settings and seed: accelerate on 1 process as plain `python`, on 2 through torchrun
with ACCELERATE_USE_CPU=true (accelerate's launcher with --cpu starts one process); ours through
`accelerate-c launch --cpu`. OMP_NUM_THREADS = cores / processes for both (--threads N to set it:
on a machine shared with other work, 2 threads per process measured 4-10x slower than 1 and
swung the ratio both ways). Repeats alternate
the contenders (A, B, A, B, ...) so drifts of the machine hit both alike; the medians are
compared.

Timing: a TrainerCallback reads time.perf_counter() at the end of optimizer step --warmup and of
the last step, on every rank; the slowest rank's rate is the run's steps/s. Peak RSS: each
rank's ru_maxrss at the end; the largest rank's is reported (bytes per process). Printed beside
the target's ratio of medians, as information: each run's rate in the order run, the ratio of
the runs' median steps (a burst of the shared machine's load over a few steps moves it less),
and the median of the per-repeat ratios (the two contenders of a repeat run back to back, so
drifts spanning a repeat cancel). A run whose launch exits non-zero after every rank wrote its
results (a teardown abort) keeps its timings, with a note. Guard: the two
contenders' last logged losses must agree (same data, seed and mixed precision) to 1e-2
relative, or the benchmark fails.

Every contender starts with the same process settings (benchmarks/_settings.py): glibc's malloc
defaults, or with --tuned bench_step's tuned MALLOC_* variables for all (glibc's heuristics,
e.g. its dynamic mmap threshold, otherwise depend on each library's pattern of frees).

Targets: steps/s >= 1.0x accelerate on 1 and 2 processes (the issue's 1.05x on 2 processes is
for after the shared-memory collectives become the default; reported as information).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _settings  # noqa: E402
import _targets  # noqa: E402
from _common import Summary, logical_cpus, print_table, verdict  # noqa: E402

BENCH = "bench_trainer"
TARGET = 1.0
TARGET_LATER_2P = 1.05
CONTENDERS = ("accelerate", "accelerate_c")
# information beside them on one process: accelerate_c with ACCELERATE_C_GRAD_BUFFERS=flat (the
# flat gradient buffers every multi-process run uses; one CPU process leaves them out by default,
# accelerate_c/loose_grads.py says why)
FLAT = "accelerate_c (flat buffers)"


# ---------------------------------------------------------------------- the script (one contender)


def worker(a):
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments

    class Clock(TrainerCallback):
        def __init__(self, warmup):
            self.warmup, self.t0, self.t1, self.ends = warmup, None, None, []

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == self.warmup:
                self.t0 = time.perf_counter()
            self.t1 = time.perf_counter()
            if state.global_step >= self.warmup:
                self.ends.append(self.t1)

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = 4 * world * (a.warmup + a.steps)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 8000, (n, 128), generator=g)]
    if a.backend == "accelerate":
        trainer_cls = transformers.Trainer
    else:
        from accelerate_c.transformers import Trainer as trainer_cls
    clock = Clock(a.warmup)
    args = TrainingArguments(output_dir=a.out, per_device_train_batch_size=4, max_steps=a.warmup + a.steps,
                             bf16=True, use_cpu=True, learning_rate=1e-4, max_grad_norm=1.0, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, seed=0,
                             logging_strategy="steps")
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    with open(f"{a.result}.{rank}", "w") as f:
        json.dump({"steps_per_s": a.steps / (clock.t1 - clock.t0), "rss": rss, "last_loss": losses[-1],
                   "world": world, "step_s": [b - e for e, b in zip(clock.ends, clock.ends[1:])]}, f)


# ---------------------------------------------------------------------- the runner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(backend, world, a, tmp, i):
    tag = backend.replace(" ", "_").replace("(", "").replace(")", "")
    out, result = os.path.join(tmp, f"{tag}-{world}-{i}"), os.path.join(tmp, f"{tag}-{world}-{i}.json")
    argv = [os.path.abspath(__file__), "--worker", "--backend", backend, "--out", out, "--result", result,
            "--steps", str(a.steps), "--warmup", str(a.warmup)]
    # the same process settings for every contender (benchmarks/_settings.py): glibc's malloc
    # defaults, or --tuned's MALLOC_* variables for all
    env = {k: v for k, v in _settings.process_env(a.setting).items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = str(a.threads or max(1, logical_cpus() // world))
    bindir = os.path.dirname(sys.executable)
    env.pop("ACCELERATE_C_GRAD_BUFFERS", None)
    if backend == FLAT:
        env["ACCELERATE_C_GRAD_BUFFERS"] = "flat"
    if backend == "accelerate":
        env["ACCELERATE_USE_CPU"] = "true"
        cmd = [sys.executable, *argv] if world == 1 else \
            [shutil.which("torchrun", path=bindir), "--nproc_per_node", str(world), "--master_addr", "127.0.0.1",
             "--master_port", str(_free_port()), *argv]
    else:
        cmd = [shutil.which("accelerate-c", path=bindir), "launch", "--num_processes", str(world), "--cpu",
               "--main_process_port", "0", *argv]
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    written = all(os.path.exists(f"{result}.{r}") for r in range(world))
    if done.returncode != 0:
        print(done.stdout[-4000:])
        if not written:
            raise SystemExit(f"{backend} on {world} processes failed (exit {done.returncode})")
        # every rank wrote its result (the last thing the worker does) and the launch failed
        # after: a teardown abort (torch's gloo teardown race has ended accelerate's 2-process
        # runs so); the timings stand, the exit is reported
        print(f"note: {backend} on {world} processes exited {done.returncode} after every rank wrote its "
              "results; the run's timings are kept")
    ranks = []
    for r in range(world):
        with open(f"{result}.{r}") as f:
            ranks.append(json.load(f))
    # the median step of the slowest rank: a rate that a burst of the machine's load during a
    # few steps moves less than the run's mean rate (steps_per_s, the target's measure)
    median_step = max(sorted(x["step_s"])[len(x["step_s"]) // 2] for x in ranks)
    return {"steps_per_s": min(x["steps_per_s"] for x in ranks), "rss": max(x["rss"] for x in ranks),
            "last_loss": ranks[0]["last_loss"], "median_step_rate": 1.0 / median_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", choices=CONTENDERS + (FLAT,), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--tuned", dest="setting", action="store_const", const="tuned", default="defaults",
                    help="start every contender with the MALLOC_* settings of bench_step's tuned table")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS per process (default: cores / processes); 1 is steadier on a shared machine")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="bench_trainer-") as tmp:
        for world in (int(w) for w in a.worlds.split(",")):
            contenders = CONTENDERS + ((FLAT,) if world == 1 else ())
            runs = {c: [] for c in contenders}
            for i in range(a.repeats):
                order = contenders if i % 2 == 0 else contenders[::-1]
                for c in order:
                    runs[c].append(_launch(c, world, a, tmp, i))
            rate = {c: Summary.of([r["steps_per_s"] for r in runs[c]]) for c in contenders}
            by_median = {c: Summary.of([r["median_step_rate"] for r in runs[c]]).median for c in contenders}
            rss = {c: Summary.of([r["rss"] for r in runs[c]]) for c in contenders}
            ratio = rate["accelerate_c"].median / rate["accelerate"].median
            rss_ratio = rss["accelerate"].median / rss["accelerate_c"].median
            la, lo = runs["accelerate"][0]["last_loss"], runs["accelerate_c"][0]["last_loss"]
            agree = abs(la - lo) <= 1e-2 * abs(la)
            print(f"\nbench_trainer: {world} process(es), 15.5M-parameter Llama, bf16, 4 x 128 tokens per process "
                  f"(median of {a.repeats}; last loss accelerate {la:.4f}, ours {lo:.4f}: "
                  f"{'agree' if agree else 'DIFFER'}); {_settings.describe(a.setting)}")
            rows = [[c, f"{rate[c].median:.3f}", f"{rate[c].q1:.3f}-{rate[c].q3:.3f}",
                     f"{rss[c].median / 2**20:.0f}"] for c in contenders]
            print_table(["contender", "steps/s", "q1-q3", "peak RSS MiB/process"], rows)
            for c in contenders:  # each run's rate in the order run (drifts of the machine show here)
                print(f"  runs of {c}: " + " ".join(f"{r['steps_per_s']:.3f}" for r in runs[c]))
            ok = ratio >= TARGET
            print(f"steps/s vs accelerate: {ratio:.3f}x (target >= {TARGET}x: {verdict(ok)}); "
                  f"peak RSS accelerate / ours: {rss_ratio:.3f}x")
            tag = "" if a.setting == "defaults" else f", {a.setting} malloc settings"
            # repeat i ran the two back to back: their ratio within a repeat cancels the drifts of
            # the machine that span a repeat (information beside the target's ratio of medians)
            paired = Summary.of([o["steps_per_s"] / r["steps_per_s"]
                                 for o, r in zip(runs["accelerate_c"], runs["accelerate"])])
            print(f"paired (each repeat's ours / accelerate, information): median {paired.median:.3f}x, "
                  f"q1-q3 {paired.q1:.3f}-{paired.q3:.3f}")
            _targets.info(BENCH, f"paired per-repeat ratio vs accelerate, {world} process(es){tag}", paired.median)
            step_ratio = by_median["accelerate_c"] / by_median["accelerate"]
            print(f"by each run's median step (information): accelerate {by_median['accelerate']:.3f}, ours "
                  f"{by_median['accelerate_c']:.3f} steps/s: {step_ratio:.3f}x")
            _targets.target(BENCH, f"train steps/s vs accelerate, {world} process(es){tag}", ratio, TARGET)
            _targets.info(BENCH, f"median-step rate vs accelerate, {world} process(es){tag}", step_ratio)
            _targets.info(BENCH, f"peak RSS accelerate / ours, {world} process(es)", rss_ratio)
            if world == 1:
                flat = rate[FLAT].median / rate["accelerate"].median
                print(f"with the flat gradient buffers (ACCELERATE_C_GRAD_BUFFERS=flat): {flat:.3f}x accelerate")
                _targets.info(BENCH, "train steps/s vs accelerate, 1 process, flat gradient buffers", flat)
            if world == 2:
                _targets.info(BENCH, f"train steps/s vs accelerate, 2 processes (later target {TARGET_LATER_2P}x "
                              "with shared-memory collectives)", ratio)
            failed |= not agree
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
