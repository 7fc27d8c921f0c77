"""`accelerate-c test`: a short training run on the configured setup, checked against plain PyTorch.

The command launches this module (`python -m accelerate_c.commands.test`) through
`accelerate-c launch` with the config file in effect, as `accelerate test` launches its
test_script.py. Each process trains a tiny regression model for a few steps with the Accelerator
(data sharding, gradient averaging, the configured accumulation and mixed precision), computes the
same training with plain PyTorch on the full batch, and compares; the collectives are checked too.
"""
from __future__ import annotations

import subprocess
import sys

SUCCESS = "Test is a success! You are ready for your distributed training!"
PER_RANK_BATCH = 4
STEPS_PER_EPOCH = 4
EPOCHS = 2
LR = 0.05


def run(args) -> int:
    cmd = [sys.executable, "-m", "accelerate_c.commands.main", "launch"]
    if args.config_file is not None:
        cmd += ["--config_file", args.config_file]
    cmd += ["-m", "accelerate_c.commands.test"]
    print("Running: " + " ".join(cmd), flush=True)
    code = subprocess.call(cmd)
    if code == 0:
        print(SUCCESS)
        return 0
    print(f"Test failed: the self-check exited with status {code} (see the output above).", file=sys.stderr)
    return code if code > 0 else 1


def register(sub) -> None:
    p = sub.add_parser("test", help="Run a short training self-check on the configured setup.")
    p.add_argument("--config_file", default=None,
                   help="config file to launch with (default: accelerate's default config file, if it exists)")
    p.set_defaults(func=run)


# ---------------------------------------------------------------------- the self-check (in each process)


def _data(n: int):
    import torch

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 3, generator=g)
    y = x @ torch.tensor([[2.0], [-1.0], [0.5]]) + 3.0 + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))


def self_check() -> int:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_c import Accelerator
    from accelerate_c.utils import GradScalerKwargs

    # a small initial loss scale: fp16 runs take no overflow-skipped steps, like the fp32 reference
    acc = Accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=2.0 ** 8)])
    n_proc, rank, ga = acc.num_processes, acc.process_index, acc.gradient_accumulation_steps
    n = PER_RANK_BATCH * n_proc * STEPS_PER_EPOCH * ga
    x, y = _data(n)
    problems = []

    # collectives
    got = acc.gather(torch.tensor([rank], device=acc.device)).cpu().tolist()
    if got != list(range(n_proc)):
        problems.append(f"gather of the ranks gave {got}")
    total = acc.reduce(torch.tensor(float(rank + 1), device=acc.device), "sum").item()
    if total != n_proc * (n_proc + 1) / 2:
        problems.append(f"reduce(sum) gave {total}")

    # training with the Accelerator
    model = _model()
    ref = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    dl = DataLoader(TensorDataset(x, y), batch_size=PER_RANK_BATCH, shuffle=False)
    model, opt, dl = acc.prepare(model, opt, dl)
    for _ in range(EPOCHS):
        for xb, yb in dl:
            with acc.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()

    # the same training in plain PyTorch: one process, batch n_proc * PER_RANK_BATCH, fp32
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    big = PER_RANK_BATCH * n_proc
    for _ in range(EPOCHS):
        for i in range(0, n, big):
            loss = torch.nn.functional.mse_loss(ref(x[i:i + big]), y[i:i + big]) / ga
            loss.backward()
            if (i // big + 1) % ga == 0:
                ref_opt.step()
                ref_opt.zero_grad()

    tol = 1e-5 if acc.mixed_precision == "no" else 5e-2
    worst = 0.0
    # the whole weights (full sharding: gathered to the main process, {} on the others, which
    # then check the loss only)
    full = acc.get_state_dict(model)
    for name, q in ref.named_parameters():
        if not full and not acc.is_main_process:
            break
        p = full[name]
        diff = ((p.detach().float().cpu() - q.detach()).abs().max() / q.detach().abs().max().clamp_min(1e-6)).item()
        worst = max(worst, diff)
        if diff > tol:
            problems.append(f"parameter {name} differs from plain PyTorch by {diff:.3g} (relative; tolerance {tol})")
    with torch.no_grad():
        start = torch.nn.functional.mse_loss(_model()(x), y).item()
        end = torch.nn.functional.mse_loss(model(x.to(acc.device)).float().cpu(), y).item()
    if not end < start:
        problems.append(f"the loss over the data set did not go down ({start:.4f} -> {end:.4f})")

    for p in problems:
        print(f"[rank {rank}] FAILED: {p}", flush=True)
    if acc.is_main_process:
        print(f"accelerate_c self-check on {n_proc} process(es), device {acc.device}, mixed_precision="
              f"{acc.mixed_precision}, gradient_accumulation_steps={ga}: loss {start:.4f} -> {end:.4f}, "
              f"largest parameter difference from plain PyTorch {worst:.2e} (relative)", flush=True)
    failed = torch.tensor(float(bool(problems)), device=acc.device)
    failed = acc.reduce(failed, "sum").item() > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    self_check()
