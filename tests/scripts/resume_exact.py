"""The resume loop users write, run as one process (python) or several (accelerate-c launch).

    resume_exact.py accelerate_c full    WORKDIR  every variant uninterrupted; save_state at step k
    resume_exact.py accelerate_c resume  WORKDIR  (new process) build the same way, load_state,
                                                  skip_first_batches, train to the end; the
                                                  "chain" variants save again at each step of k2
    resume_exact.py accelerate_c resume2 WORKDIR  (new process) resume the chain variants from
                                                  those second checkpoints
    resume_exact.py accelerate   full    WORKDIR  accelerate 1.15 itself, uninterrupted, no saves

The loop: set_seed, a model with nn.Dropout(0.2), AdamW, a DataLoader over a small generated
dataset, prepare, then epochs of `for batch in loader` (no set_epoch by hand); the resumed run
takes `skip_first_batches(loader, k % len(loader))` for its first epoch (or, in the "direct"
variants, iterates the loader itself when that is 0), as accelerate's examples do. Variants:
shuffle on/off x use_seedable_sampler on/off x where the save happens (mid-epoch 0, after the
last batch of epoch 0, mid-epoch 1), plus: pickle-mode checkpoints (safe_serialization=False), a
resume under another seed, and resumes of resumed runs (saved again while the skipped loader
runs, and in the epoch after it). Each rank writes WORKDIR/<impl>_<phase>_<rank>.json: per run,
the losses of every step it trained (float.hex, compared bitwise), its first step, and a hash of
the final parameters' bytes. The test compares them with the uninterrupted run's.
"""
import hashlib
import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IMPL, PHASE, WORKDIR = sys.argv[1], sys.argv[2], sys.argv[3]
if IMPL == "accelerate":
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, set_seed
else:
    from accelerate_c import Accelerator
    from accelerate_c.utils import DataLoaderConfiguration, set_seed

N_SAMPLES, BATCH, EPOCHS = 24, 4, 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.drop = nn.Dropout(0.2)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def variants(nb):
    """name -> options; k: the step after which the uninterrupted run saves (nb batches per epoch)."""
    out = {}
    for shuffle in (True, False):
        for seedable in (False, True):
            base = dict(shuffle=shuffle, seedable=seedable, direct=False, safe=True, seed=0, k2=())
            for where, k in (("mid0", nb // 2), ("end0", nb), ("end0direct", nb), ("mid1", nb + nb // 2 + 1)):
                out[f"shuffle{int(shuffle)}_seedable{int(seedable)}_{where}"] = dict(
                    base, k=k, direct=where.endswith("direct"))
            if shuffle:
                out[f"shuffle1_seedable{int(seedable)}_pickle"] = dict(base, k=nb // 2 + 1, safe=False)
                # saved again mid-way through the skipped epoch, then in the epoch after it
                out[f"shuffle1_seedable{int(seedable)}_chain"] = dict(base, k=1, k2=(nb - 1, nb + 1))
    out["shuffle1_seedable0_reseed"] = dict(out["shuffle1_seedable0_mid1"], seed=1234)
    return out


def build(shuffle, seedable, seed):
    set_seed(seed)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=seedable))
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(N_SAMPLES, 6, generator=g), torch.randn(N_SAMPLES, 3, generator=g))
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dl = DataLoader(ds, batch_size=BATCH, shuffle=shuffle)
    model, opt, dl = acc.prepare(model, opt, dl)
    return acc, model, opt, dl


def run(name, v, resume_from=None, saves=()):
    """Trains to the end of epoch EPOCHS - 1; resume_from: (checkpoint, its step); saves: {step: dir}."""
    acc, model, opt, dl = build(v["shuffle"], v["seedable"], v["seed"] if resume_from else 0)
    nb = len(dl)
    step = 0
    if resume_from is not None:
        acc.load_state(resume_from[0])
        step = resume_from[1]
    first = step
    start_epoch, skip = divmod(step, nb)
    losses = []
    for epoch in range(start_epoch, EPOCHS):
        loader = dl
        if resume_from is not None and epoch == start_epoch and not (v["direct"] and skip == 0):
            loader = acc.skip_first_batches(dl, skip)
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            step += 1
            losses.append(float(loss.item()).hex())
            if step in saves:
                acc.save_state(saves[step], safe_serialization=v["safe"])
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return {"losses": losses, "first": first, "params": h.hexdigest()}, acc


def main():
    # the number of batches per process decides the save points: build once to know it
    acc, _, _, dl = build(False, False, 0)
    out = {}
    for name, v in variants(len(dl)).items():
        ckpt = os.path.join(WORKDIR, name)
        if PHASE == "full":
            out[name], acc = run(name, v, saves={v["k"]: ckpt} if IMPL == "accelerate_c" else {})
        elif PHASE == "resume":
            out[name], acc = run(name, v, (ckpt, v["k"]), saves={k2: f"{ckpt}_at{k2}" for k2 in v["k2"]})
        else:
            for k2 in v["k2"]:
                out[f"{name}_at{k2}"], acc = run(name, v, (f"{ckpt}_at{k2}", k2))
    with open(os.path.join(WORKDIR, f"{IMPL}_{PHASE}_{acc.process_index}.json"), "w") as f:
        json.dump(out, f, indent=1)
    acc.print(f"resume_exact {IMPL} {PHASE} OK on {acc.num_processes} processes")


if __name__ == "__main__":
    main()
