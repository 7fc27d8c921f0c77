"""Where one transformers.Trainer step goes, on real accelerate or on accelerate_c: bench_trainer's
script (the 15.5M-parameter Llama, bf16, 4 x 128 tokens, AdamW, clip 1.0) with wall-clock timers
around the Trainer's phases, plus the process's minor page faults per step. Not a benchmark with
a target (bench_trainer.py holds the steps/s target): a tool to see which phase a difference
comes from. One process, one thread; run each contender a few times, alternating, since a
process's speed on this machine varies by a few percent from one process to the next.

    .venv/bin/python benchmarks/trainer_phases.py accelerate
    .venv/bin/accelerate-c launch --cpu --num_processes 1 benchmarks/trainer_phases.py accelerate_c

Prints the median over the steps after the third of: compute_loss (the forward and loss),
training_step (compute_loss + backward), _clip_grad_norm, the whole step (end to end, from one
step's end to the next), and the page faults per step.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend", choices=("accelerate", "accelerate_c"))
    ap.add_argument("--steps", type=int, default=24)
    a = ap.parse_args(argv)
    if a.backend == "accelerate":
        os.environ["ACCELERATE_USE_CPU"] = "true"
        trainer_cls = transformers.Trainer
    else:
        from accelerate_c.transformers import Trainer as trainer_cls
    times = collections.defaultdict(list)

    def timed(obj, name):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times[name].append(time.perf_counter() - t0)
        setattr(obj, name, wrapper)

    class Clock(TrainerCallback):
        last = faults = None

        def on_step_end(self, args, state, control, **kwargs):
            t, f = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            if self.last is not None:
                times["step"].append(t - self.last)
                times["page faults"].append(f - self.faults)
            self.last, self.faults = t, f

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 8000, (4 * a.steps, 128), generator=g)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=a.steps, bf16=True,
                                 use_cpu=True, learning_rate=1e-4, max_grad_norm=1.0, logging_steps=1,
                                 save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
        trainer = trainer_cls(model=LlamaForCausalLM(cfg), args=args, train_dataset=data, callbacks=[Clock()])
        for name in ("compute_loss", "training_step", "_clip_grad_norm"):
            timed(trainer, name)
        trainer.train()
    row = {k: statistics.median(v[3:]) for k, v in times.items()}
    print(f"{a.backend}: " + ", ".join(f"{k} {v:.0f}" if k == "page faults" else f"{k} {v * 1e3:.1f} ms"
                                      for k, v in row.items()))


if __name__ == "__main__":
    main()
