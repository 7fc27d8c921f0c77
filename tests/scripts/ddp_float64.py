"""Run by tests/test_ddp.py through `accelerate-c launch --num_processes 2 --cpu`: a model with a
float64 layer (no gradient buffer) inside join_uneven_inputs, rank r holding 2 + r batches, against
torch DDP under torch's Join on the same seed and data: two forward/backward pairs before each
optimizer step, and (second part) two joined models, one of them without a float64 layer; then
(third part, no join) the output layer in a reentrant checkpoint, whose inner backward delivers
the first gradients and ends before the outer one has delivered the rest (the float64
gradients wait for the end of Accelerator.backward there); then (fifth part) the fp16 comm hook
with two sync backwards per step, (sixth) a forward whose branch order depends on each rank's
data, and (seventh) a raw sync backward followed by a no_sync micro-batch. The float64 gradients are
averaged at the end of every sync backward under join, after the model's buffers, so the process
that ran out of data shadows them per backward (DDPStrategy.reduce_unbuffered, shadow_unbuffered). Prints
"float64 OK" when the parameters are torch's bit for bit."""
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accelerate_c import Accelerator
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.utils import DDPCommunicationHookType, DistributedDataParallelKwargs


class Half64(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.wide = nn.Linear(5, 3).double()

    def forward(self, x):
        return self.lin(x) + self.wide(x.double()).float()


acc = Accelerator(cpu=True)
rank = acc.process_index
torch.manual_seed(3)
bases = [Half64(), nn.Linear(5, 3)]
gen = torch.Generator().manual_seed(40 + rank)
data = [(torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)) for _ in range(2 + rank)]
fails = []


def same_grads(ours, theirs, what):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.equal(p.grad, q.grad):
            fails.append(f"{what}: .grad of {name} differs from torch DDP's by {(p.grad - q.grad).abs().max().item():.3g}")


def same(ours, theirs, what):
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        if not torch.equal(p, q):
            fails.append(f"{what}: {name} differs from torch DDP's by {(p - q).abs().max().item():.3g}")


# 1. two backwards per step, one model
ref = DDP(copy.deepcopy(bases[0]))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
with Join([ref]):
    for x1, x2 in data:
        ref(x1).pow(2).sum().backward()
        ref(x2).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
model = copy.deepcopy(bases[0])
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = acc.prepare(model, opt)
with acc.join_uneven_inputs([model], even_batches=False):
    for x1, x2 in data:
        acc.backward(model(x1).pow(2).sum())
        acc.backward(model(x2).pow(2).sum())
        opt.step()
        opt.zero_grad()
same(model, ref.module, "two backwards per step")

# 2. two joined models (one with a float64 layer), a backward each, one step for both (torch
#    DDP under Join mismatches its own collectives when two DDP models share one loss)
refs = [DDP(copy.deepcopy(b)) for b in bases]
ref_opt = torch.optim.SGD([p for r in refs for p in r.parameters()], lr=0.1)
with Join(refs):
    for x, _ in data:
        for r in refs:
            r(x).pow(2).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
models = [copy.deepcopy(b) for b in bases]
opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
*models, opt = acc.prepare(*models, opt)
with acc.join_uneven_inputs(models, even_batches=False):
    for x, _ in data:
        for m in models:
            acc.backward(m(x).pow(2).sum())
        opt.step()
        opt.zero_grad()
for k, (m, r) in enumerate(zip(models, refs)):
    same(m, r.module, f"two joined models, model {k}")



# 3. reentrant checkpointing of the output layer, no join
class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = Half64()
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return checkpoint(lambda t: self.out(t), torch.tanh(self.body(x)), use_reentrant=True)


torch.manual_seed(5)
base = Checkpointed()
ref = DDP(copy.deepcopy(base))
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
model = copy.deepcopy(base)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
for x, _ in data[:2]:  # as many batches on every rank
    ref(x).pow(2).sum().backward()
    ref_opt.step()
    ref_opt.zero_grad()
    acc.backward(model(x).pow(2).sum())
    opt.step()
    opt.zero_grad()
same(model, ref.module, "reentrant checkpointing")


# 4. two float64-only models in one loss (no buffer at all), one in a reentrant checkpoint whose
#    inner backward ends first, the other's gradients arriving in the outer backward
class Ck64(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3).double()

    def forward(self, x):
        return checkpoint(self.lin, x, use_reentrant=True)


torch.manual_seed(6)
bases = [nn.Linear(5, 3).double(), Ck64()]
refs = [DDP(copy.deepcopy(b)) for b in bases]
ref_opt = torch.optim.SGD([p for r in refs for p in r.parameters()], lr=0.1)
models = [copy.deepcopy(b) for b in bases]
opt = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
*models, opt = acc.prepare(*models, opt)
for x, _ in data[:2]:
    x = x.double().requires_grad_()
    (refs[1](x).pow(2).sum() + refs[0](x).pow(2).sum()).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    acc.backward(models[1](x).pow(2).sum() + models[0](x).pow(2).sum())
    opt.step()
    opt.zero_grad()
for k, (m, r) in enumerate(zip(models, refs)):
    same(m, r.module, f"float64-only models, reentrant checkpoint, model {k}")


# 5. the fp16 comm hook, two sync backwards per step (raw backwards, no no_sync), no join: torch
#    averages the float64 bucket after each backward, re-rounding the running sum (the previous
#    average plus the new local gradient) through fp16 each time; averaging the two backwards'
#    sum once at the step differs by an fp16 rounding (soak case 6464376765). The gradients read
#    right after each backward are torch's too.
AcceleratorState._reset_state()
GradientState._reset_state()
acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
torch.manual_seed(7)
base = Half64()
ref = DDP(copy.deepcopy(base))
ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
model = copy.deepcopy(base)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = acc.prepare(model, opt)
for x1, x2 in zip(data[:2], data[1:3] if len(data) > 2 else data[:2]):
    for x in (x1[0], x2[0] * 3.7):
        ref(x).pow(2).sum().backward()
        acc.backward(model(x).pow(2).sum())
        same_grads(model, ref.module, "fp16 hook, after a backward")
    ref_opt.step()
    ref_opt.zero_grad()
    opt.step()
    opt.zero_grad()
same(model, ref.module, "fp16 comm hook, two sync backwards per step")


# 6. the same, with a forward whose branch order depends on each rank's data (so each rank's
#    autograd delivers the float64 and fp32 gradients in its own order; torch DDP is fine, as
#    its buckets launch in bucket order): averaging the float64 layer from inside the backward
#    (when its last gradient landed) had the ranks call their collectives in different orders
class Flip(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 3)
        self.wide = nn.Linear(5, 3).double()

    def forward(self, x, flip):
        if flip:
            a = self.lin(x)
            b = self.wide(x.double()).float()
        else:
            b = self.wide(x.double()).float()
            a = self.lin(x)
        return a + b


torch.manual_seed(8)
base = Flip()
ref = DDP(copy.deepcopy(base))
ref.register_comm_hook(None, default_hooks.fp16_compress_hook)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
model = copy.deepcopy(base)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
flips = torch.Generator().manual_seed(90 + rank)
for x, _ in data[:2]:
    for _ in range(2):
        flip = bool(torch.rand((), generator=flips) > 0.5)
        ref(x, flip).pow(2).sum().backward()
        acc.backward(model(x, flip).pow(2).sum())
    ref_opt.step()
    ref_opt.zero_grad()
    opt.step()
    opt.zero_grad()
same(model, ref.module, "fp16 comm hook, forward order depending on each rank's data")


# 7. a raw sync loss.backward(), then a micro-batch under no_sync() (through Accelerator.backward,
#    or raw), then the step: torch averages the first backward's float64 gradient and adds the
#    second's locally; averaging the two together (at the step, or at the end of the second
#    call) is another average (a review of the change above); under the fp16 hook of part 5
for second in ("Accelerator.backward", "raw loss.backward()"):
    torch.manual_seed(9)
    base = Half64()
    ref = DDP(copy.deepcopy(base))
    ref.register_comm_hook(None, default_hooks.fp16_compress_hook)  # as `acc` above has it
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    (x1, _), (x2, _) = data[0], data[1]
    ref(x1).pow(2).sum().backward()
    with ref.no_sync():
        ref(x2).pow(2).sum().backward()
    model(x1).pow(2).sum().backward()
    with acc.no_sync(model):
        loss = model(x2).pow(2).sum()
        acc.backward(loss) if second == "Accelerator.backward" else loss.backward()
    same_grads(model, ref.module, f"raw sync backward, then {second} under no_sync")
    ref_opt.step()
    opt.step()
    same(model, ref.module, f"raw sync backward, then {second} under no_sync")

everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, fails)
bad = [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs]
if bad:
    raise SystemExit("\n".join(bad[:20]))
if rank == 0:
    print("float64 OK")
