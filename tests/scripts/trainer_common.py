"""Shared by the Trainer tests and their subprocess scripts: a small regression problem, the
Trainer run on it, and the same training written as a plain PyTorch loop (the reference).

Run as a script, it trains with the Trainer and saves the final parameters:
    trainer_common.py OUT_DIR RESULT_FILE [--interrupt-at K] [--resume] [--batch B] [--samples N] [--no-save]
`--interrupt-at K` ends the process (os._exit) right after the checkpoint of step K is saved,
as a crash would; `--resume` resumes from the latest complete checkpoint in OUT_DIR."""
from __future__ import annotations

import math
import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

N_TRAIN, N_EVAL, IN, HID, OUT = 44, 10, 6, 16, 2
SEED = 42


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.fc2 = nn.Linear(HID, OUT)

    def forward(self, x):
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_model():
    torch.manual_seed(0)
    return Net()


def make_data(n=N_TRAIN, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    y = torch.sin(x @ w) + 0.05 * torch.randn(n, OUT, generator=g)
    return TensorDataset(x, y)


def mse(outputs, labels):
    return nn.functional.mse_loss(outputs, labels)


def train_args(out_dir, **overrides):
    from accelerate_c import TrainingArguments

    # eval batch 5: N_EVAL = 10 splits evenly over 1 or 2 processes, so no rank evaluates padding
    kw = dict(output_dir=out_dir, per_device_train_batch_size=4, per_device_eval_batch_size=5,
              gradient_accumulation_steps=2,
              learning_rate=1e-2, weight_decay=0.01, warmup_steps=3, num_train_epochs=3, max_grad_norm=0.5,
              logging_steps=2, save_strategy="no", seed=SEED, disable_tqdm=True, use_cpu=True)
    kw.update(overrides)
    return TrainingArguments(**kw)


def reference_train(model, dataset, batch=4, accum=2, epochs=3, lr=1e-2, wd=0.01, warmup=3, clip=0.5,
                    seed=SEED, betas=(0.9, 0.999), eps=1e-8):
    """transformers' Trainer loop written out by hand: seeded shuffle per epoch (seed + epoch),
    loss / accum, clip + AdamW (no decay on biases and norms) + linear warm-up/decay schedule
    stepped at every accum-th batch and at the end of each epoch."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and not n.startswith("norm"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=betas, eps=eps)
    n = len(dataset)
    n_batches = math.ceil(n / batch)
    per_epoch = n_batches // accum + int(n_batches % accum > 0)
    total = per_epoch * epochs

    def lam(step):
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    x, y = dataset.tensors
    for epoch in range(epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        for b in range(n_batches):
            idx = order[b * batch:(b + 1) * batch]
            loss = mse(model(x[idx]), y[idx]) / accum
            loss.backward()
            if (b + 1) % accum == 0 or b == n_batches - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                sched.step()
                opt.zero_grad()
    return model


def main(argv):
    from accelerate_c import Trainer, TrainerCallback

    out_dir, result = argv[0], argv[1]
    interrupt = int(argv[argv.index("--interrupt-at") + 1]) if "--interrupt-at" in argv else None
    batch = int(argv[argv.index("--batch") + 1]) if "--batch" in argv else 4
    n = int(argv[argv.index("--samples") + 1]) if "--samples" in argv else N_TRAIN
    save = dict(save_strategy="steps", save_steps=4) if "--no-save" not in argv else {}

    class Crash(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == interrupt:
                sys.stdout.flush()
                os._exit(0)

    trainer = Trainer(make_model(), train_args(out_dir, per_device_train_batch_size=batch, **save),
                      train_dataset=make_data(n), eval_dataset=make_data(N_EVAL, seed=2), compute_loss_func=mse,
                      callbacks=[Crash()] if interrupt else None)
    trainer.train(resume_from_checkpoint=True if "--resume" in argv else None)
    if interrupt:
        raise SystemExit(f"step {interrupt} was never saved")
    metrics = trainer.evaluate()
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        torch.save({"params": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "log_history": trainer.state.log_history, "eval": metrics,
                    "num_processes": trainer.accelerator.num_processes}, result)
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1:])
