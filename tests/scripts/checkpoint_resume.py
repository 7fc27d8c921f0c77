"""Resume exactness, run as one process (python) or several (accelerate-c launch).

    checkpoint_resume.py full   WORKDIR PRECISIONS   train K micro-batches, save_state, train M more
                                                     (one loop: the save does not interrupt it)
    checkpoint_resume.py resume WORKDIR PRECISIONS   (new process) load_state(), train the same M
    checkpoint_resume.py crash  WORKDIR              save checkpoints 0..2 (total_limit=2), then pause
                                                     inside the 4th save for the test to kill -9
    checkpoint_resume.py fail   WORKDIR              a registered state that needs pickle: save_state
                                                     raises on every rank, leaves nothing

Each process writes WORKDIR/<phase>_<rank>.json: per precision, the losses of the M micro-batches
after the save (float.hex: compared bitwise), the final parameters' bytes hash, and the
Accelerator's counters right after the save / load. The test compares full and resume.
The loop has everything resume must restore: a shuffled (seedable) data loader resumed mid-epoch
with skip_first_batches, dropout (torch RNG), python and numpy random draws in the loss, AdamW,
a LambdaLR, gradient accumulation 2, clipping, and under fp16 a loss scaler that grows and backs off.
"""
import hashlib
import json
import os
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from accelerate_c import (Accelerator, DataLoaderConfiguration, GradScalerKwargs,  # noqa: E402
                          ProjectConfiguration)
from accelerate_c.utils.random import set_seed  # noqa: E402

N_SAMPLES, BATCH = 48, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


class Counter:
    """A registered object (register_for_checkpointing)."""

    def __init__(self):
        self.n = 0
        self.history = torch.zeros(3)

    def state_dict(self):
        return {"n": self.n, "history": self.history.clone()}

    def load_state_dict(self, sd):
        self.n = int(sd["n"])
        self.history = sd["history"].clone()


def build(workdir, precision, seed, **project):
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 4, generator=g))
    handlers = [GradScalerKwargs(init_scale=2.0 ** 20, growth_interval=3)] if precision == "fp16" else []
    acc = Accelerator(mixed_precision=precision, gradient_accumulation_steps=2, cpu=True, kwargs_handlers=handlers,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                      project_config=ProjectConfiguration(project_dir=os.path.join(workdir, precision),
                                                          automatic_checkpoint_naming=True, **project))
    set_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * 0.97 ** s)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=True)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    return acc, model, opt, sched, dl, counter


def train(acc, model, opt, sched, dl, counter, start, stop, on_batch=None):
    """Micro-batches start..stop-1 of the run (epoch = i // len(dl)), the first epoch of this
    call resumed mid-way with skip_first_batches."""
    nb = len(dl)
    losses = []
    i = start
    while i < stop:
        epoch, skip = divmod(i, nb)
        dl.set_epoch(epoch)
        loader = acc.skip_first_batches(dl, skip) if skip else dl
        for x, y in loader:
            with acc.accumulate(model):
                out = model(x)
                loss = nn.functional.mse_loss(out, y) * (1 + 1e-3 * random.random()) * (1 + 1e-3 * float(np.random.rand()))
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
            counter.n += 1
            counter.history[counter.n % 3] += loss.item()
            losses.append(float(loss.item()).hex())
            i += 1
            if on_batch is not None:
                on_batch(i)
            if i == stop:
                break
    return losses


def params_hash(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def counters(acc, opt, sched, dl, counter):
    return {"step": acc.step, "iteration": acc.save_iteration, "dl_iteration": dl.iteration,
            "last_lr": [float(v).hex() for v in sched.get_last_lr()], "counter": counter.n,
            "scale": acc.scaler.get_scale() if acc.scaler is not None else None,
            "sampler_epoch": dl.get_sampler().epoch}


def main():
    phase, workdir = sys.argv[1], sys.argv[2]
    precisions = sys.argv[3].split(",") if len(sys.argv) > 3 else ["no"]
    out = {}
    if phase == "crash":
        acc, model, opt, sched, dl, counter = build(workdir, "no", 0, total_limit=2)
        nb = len(dl)
        record = {}

        def on_batch(i):
            if i % nb == 3:  # mid-epoch saves
                acc.save_state()
                record[acc.save_iteration - 1] = params_hash(model)
                with open(os.path.join(workdir, "crash_hashes.json"), "w") as f:
                    json.dump(record, f)
                if acc.save_iteration == 3:
                    os.environ["ACCELERATE_C_TEST_PAUSE_SAVE"] = os.path.join(workdir, "paused")

        train(acc, model, opt, sched, dl, counter, 0, 10 * nb, on_batch=on_batch)
        sys.exit(3)  # not reached: the 4th save pauses until killed
    if phase == "fail":  # a state that cannot be saved (rank 0 writes it): every rank raises, none hangs
        acc, model, opt, sched, dl, counter = build(workdir, "no", 0)

        class Bad:
            def state_dict(self):
                return {"fn": print}

            def load_state_dict(self, sd):
                pass

        acc.register_for_checkpointing(Bad())
        try:
            acc.save_state()
            raised = None
        except (TypeError, RuntimeError) as e:
            raised = [type(e).__name__, str(e)]
        base = os.path.join(workdir, "no", "checkpoints")
        left = sorted(os.listdir(base)) if os.path.isdir(base) else []
        acc.save_model(model, os.path.join(workdir, "weights"))  # rank 0 writes; all return once it is there
        out = {"raised": raised, "left": left, "iteration": acc.save_iteration,
               "weights": sorted(os.listdir(os.path.join(workdir, "weights")))}
        with open(os.path.join(workdir, f"fail_{acc.process_index}.json"), "w") as f:
            json.dump(out, f)
        acc.print(f"checkpoint_resume fail OK on {acc.num_processes} processes")
        sys.exit(0)
    for precision in precisions:
        acc, model, opt, sched, dl, counter = build(workdir, precision, 0 if phase == "full" else 1234)
        nb = len(dl)
        k = nb + nb // 3 + (nb // 3) % 2  # mid-epoch, on an accumulation boundary
        m = nb + 2
        if phase == "full":  # uninterrupted: the save happens inside the loop, which goes on
            saved = {}

            def on_batch(i):
                if i == k:
                    saved["path"] = acc.save_state()
                    saved["after"] = counters(acc, opt, sched, dl, counter)

            losses = train(acc, model, opt, sched, dl, counter, 0, k + m, on_batch=on_batch)[k:]
            path, after = saved["path"], saved["after"]
        else:
            acc.load_state()
            after = counters(acc, opt, sched, dl, counter)
            path = None
            losses = train(acc, model, opt, sched, dl, counter, k, k + m)
        out[precision] = {"losses": losses, "params": params_hash(model), "after_save_or_load": after,
                          "path": str(path) if path else None, "k": k, "m": m}
    with open(os.path.join(workdir, f"{phase}_{acc.process_index}.json"), "w") as f:
        json.dump(out, f, indent=1)
    acc.print(f"checkpoint_resume {phase} OK on {acc.num_processes} processes")
    sys.exit(0)


if __name__ == "__main__":
    main()
