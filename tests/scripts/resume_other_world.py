"""A job saved mid-epoch on one number of processes and resumed on another, as a user writes it:
the global batch kept (per-process batch = GLOBAL // processes), a prepared shuffled DataLoader
(seedable sampler), save_state after K steps of epoch 0, and the resumed run's
`skip_first_batches(loader, K)` for the rest of that epoch, then the next epoch whole.

    resume_other_world.py full   WORKDIR   train both epochs, save_state after step K
    resume_other_world.py resume WORKDIR   (new processes) build the same way, load_state, go on
    resume_other_world.py reference WORKDIR N   one process, no accelerate_c: plain torch SGD on
                                                the global batches accelerate 1.15's
                                                prepare_data_loader gives N processes

The main process writes WORKDIR/<phase>_<world>.json: each step's global batch (the sample
indices every process drew, gathered) and loss, from its first step on, and the final
parameters. tests/test_resume_other_world.py holds them to plain torch on accelerate's batches.
"""
import json
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accelerate_c import Accelerator
from accelerate_c.utils import DataLoaderConfiguration, set_seed

PHASE, WORKDIR = sys.argv[1], sys.argv[2]
N, GLOBAL, EPOCHS, K, SEED, LR = 48, 12, 2, 2, 7, 0.05


def dataset():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    return TensorDataset(torch.arange(N), x, y)


def model():
    m = torch.nn.Linear(4, 1)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def reference(world: int):
    """Plain torch on accelerate's batches: each step's global batch is what accelerate 1.15's
    prepared loaders hand processes 0..world-1 (their seedable sampler, set_seed(SEED) first),
    and its loss the mean over it (the average of the processes' equal-sized means)."""
    from accelerate.data_loader import prepare_data_loader
    from accelerate.state import PartialState
    from accelerate.utils import set_seed as hf_set_seed

    PartialState(cpu=True)
    hf_set_seed(SEED)
    shards = [prepare_data_loader(DataLoader(dataset(), batch_size=GLOBAL // world, shuffle=True),
                                  device=torch.device("cpu"), num_processes=world, process_index=r,
                                  put_on_device=False, use_seedable_sampler=True) for r in range(world)]
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    steps = []
    for _ in range(EPOCHS):
        # each process's loader run to its end (as each process does), then the steps side by side
        for parts in zip(*[list(s) for s in shards]):
            idx, x, y = (torch.cat(t) for t in zip(*parts))
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append({"indices": sorted(idx.tolist()), "loss": loss.item()})
    params = {n: p.detach().tolist() for n, p in net.named_parameters()}
    with open(os.path.join(WORKDIR, f"reference_{world}.json"), "w") as f:
        json.dump({"steps": steps, "params": params}, f)


def main():
    if PHASE == "reference":
        return reference(int(sys.argv[3]))
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(SEED)
    world = acc.num_processes
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    loader = DataLoader(dataset(), batch_size=GLOBAL // world, shuffle=True)
    net, opt, loader = acc.prepare(net, opt, loader)
    ckpt = os.path.join(WORKDIR, "ckpt")
    start_epoch = 0
    if PHASE == "resume":
        acc.load_state(ckpt)
    steps = []
    for epoch in range(start_epoch, EPOCHS):
        batches = acc.skip_first_batches(loader, K) if (PHASE == "resume" and epoch == 0) else loader
        for idx, x, y in batches:
            loss = torch.nn.functional.mse_loss(net(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            steps.append({"indices": sorted(acc.gather(idx).tolist()),
                          "loss": acc.reduce(loss.detach(), "mean").item()})
            if PHASE == "full" and epoch == 0 and len(steps) == K:
                acc.save_state(ckpt)
    if acc.is_main_process:
        params = {n: p.detach().tolist() for n, p in acc.unwrap_model(net).named_parameters()}
        with open(os.path.join(WORKDIR, f"{PHASE}_{world}.json"), "w") as f:
            json.dump({"steps": steps, "params": params}, f)
    acc.wait_for_everyone()
    print(f"resume_other_world {PHASE} OK on {world} processes", flush=True)


if __name__ == "__main__":
    main()
