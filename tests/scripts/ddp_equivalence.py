"""Run by tests/test_ddp.py through `accelerate-c launch --num_processes N --cpu`: N ranks with
per-rank batch b train exactly like one plain-PyTorch process with batch N*b (computed here, on
every rank, as the reference), across precisions, accumulation, clipping, optimizers, frozen
and unused parameters."""
import copy
import itertools
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_c import Accelerator
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.utils import DistributedDataParallelKwargs


B = 4  # per-rank batch


class Net(nn.Module):
    def __init__(self, with_unused=True):
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.body = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)
        if with_unused:
            self.unused = nn.Linear(16, 3)  # never in the graph: no gradient anywhere

    def forward(self, x):
        return self.head(torch.relu(self.body(self.frozen(x))))


def reference(model, data, n, accum, mp, clip, make_opt):
    """Plain torch, one process, batch n*B: what N ranks must reproduce."""
    opt = make_opt(model)
    dl = DataLoader(data, batch_size=n * B)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mp)
    scaler = torch.amp.GradScaler("cpu") if mp == "fp16" else None
    steps = len(dl)
    for i, (x, y) in enumerate(dl):
        with torch.autocast("cpu", dtype=dt, enabled=dt is not None):
            out = model(x)
        loss = nn.functional.mse_loss(out.float(), y) / accum
        (scaler.scale(loss) if scaler else loss).backward()
        if (i + 1) % accum == 0 or i == steps - 1:
            if scaler:
                scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
    return model


def ours(model, data, accum, mp, clip, make_opt, find_unused=False, bucket_cap_mb=25):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    kw = DistributedDataParallelKwargs(find_unused_parameters=find_unused, bucket_cap_mb=bucket_cap_mb)
    acc = Accelerator(cpu=True, mixed_precision=mp, gradient_accumulation_steps=accum, kwargs_handlers=[kw])
    opt = make_opt(model)
    dl = DataLoader(data, batch_size=B)
    model, opt, dl = acc.prepare(model, opt, dl)
    for x, y in dl:
        with acc.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            if clip and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, acc


OPTS = {
    "sgd": lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2),
}

fails = []
n = None
for mp, accum, clip, opt_name in itertools.product(["no", "bf16", "fp16"], [1, 2], [None, 0.3], ["sgd", "adamw"]):
    torch.manual_seed(0)
    # AdamW runs get a module no rank uses (find_unused_parameters=True); SGD runs use every
    # parameter and the default reducer, with a tiny bucket cap so gradients span buckets
    unused = opt_name == "adamw"
    base = Net(with_unused=unused)
    g = torch.Generator().manual_seed(1)
    n_samples = 8 * B * 3  # every rank count used (2, 3) divides the steps evenly
    data = TensorDataset(torch.randn(n_samples, 6, generator=g), torch.randn(n_samples, 3, generator=g))
    model, acc = ours(copy.deepcopy(base), data, accum, mp, clip, OPTS[opt_name], find_unused=unused,
                      bucket_cap_mb=25 if unused else 0.0002)
    n = acc.num_processes
    ref = reference(copy.deepcopy(base), data, n, accum, mp, clip, OPTS[opt_name])
    # fp32: the 1e-6 relative + 1e-7 absolute. 16-bit autocast rounds activations
    # per element and the kernels chosen for batch B and N*B differ, so the two runs agree to
    # the format's precision: fp16 (eps 2^-10) 2e-3, bf16 (eps 2^-7) 2e-2 relative. Adam moves
    # every weight by ~lr per step whatever the gradient's size, so a sign flip of a tiny
    # 16-bit gradient costs up to 2*lr: absolute tolerance 2.5*lr there.
    rtol, atol = {"no": (1e-6, 1e-7), "fp16": (2e-3, 2e-4), "bf16": (2e-2, 2e-3)}[mp]
    if opt_name == "adamw" and mp != "no":
        atol = 2.5e-2
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p, q, rtol=rtol, atol=atol):
            fails.append(f"{mp} accum={accum} clip={clip} {opt_name}: {name} max diff {(p - q).abs().max().item():.3e}")
    if unused:
        assert model.unused.weight.grad is None, "a parameter no rank used must keep grad None"
    # every rank holds the same parameters
    w = acc.gather(model.head.weight.detach().reshape(1, -1))
    if not bool((w == w[0]).all()):
        fails.append(f"{mp} accum={accum} clip={clip} {opt_name}: ranks disagree")
# bf16 parameters: the gradient buffer itself is bf16 and is all-reduced in bf16 (or in fp32
# on a backend that lacks it: accelerate_c/strategies/ddp.py picks the wire dtype)
torch.manual_seed(0)
base = Net(with_unused=False).to(torch.bfloat16)
g = torch.Generator().manual_seed(2)
data = TensorDataset(torch.randn(8 * B * 3, 6, generator=g).bfloat16(), torch.randn(8 * B * 3, 3, generator=g).bfloat16())
model, acc = ours(copy.deepcopy(base), data, 1, "no", None, OPTS["sgd"])
ref = reference(copy.deepcopy(base), data, acc.num_processes, 1, "no", None, OPTS["sgd"])
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    if not torch.allclose(p.float(), q.float(), rtol=2e-2, atol=2e-3):
        fails.append(f"bf16 parameters: {name} max diff {(p.float() - q.float()).abs().max().item():.3e}")
if fails:
    print("\n".join(fails[:20]), file=sys.stderr)
    sys.exit(1)
if acc.is_main_process:
    print(f"ddp equivalence OK on {n} processes")
