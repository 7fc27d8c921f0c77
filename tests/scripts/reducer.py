"""Run by tests/test_ddp.py through `accelerate-c launch --num_processes N --cpu`: the bucketed
reducer against torch DDP (gradient_as_bucket_view=True) on the same seed and data, and its own
rules: bucket plan (caps, re-laid in arrival order, identical on all ranks, launched during
backward), raw loss.backward(), no_sync, two backwards in one step, unused parameters, 16-bit
comm hooks, broadcast_buffers. Prints "reducer OK on N processes" when every check passed."""
import copy
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from accelerate_c import Accelerator, collectives
from accelerate_c.state import AcceleratorState, GradientState
from accelerate_c.utils import DistributedDataParallelKwargs

# run as a script by accelerate-c launch: sys.path has tests/scripts but not tests/, where the
# shared stand-in lives; appended, not prepended, so nothing in tests/ shadows an installed module
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from counting_kernels import counting_reads  # noqa: E402


fails = []


def check(ok, what):
    if not ok:
        fails.append(what)


class MLP(nn.Module):
    def __init__(self, bn=False, unused=False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(5)])
        self.bn = nn.BatchNorm1d(8) if bn else None
        self.out = nn.Linear(8, 2)
        self.unused = nn.Linear(8, 2) if unused else None

    def forward(self, x):
        for lin in self.layers:
            x = torch.tanh(lin(x))
        if self.bn is not None:
            x = self.bn(x)
        return self.out(x)


def fresh(**ddp_kwargs):
    AcceleratorState._reset_state()
    GradientState._reset_state()
    return Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(**ddp_kwargs)])


def batches(k, seed):
    """Different data on every rank (the rank is folded into the seed), same on every run."""
    g = torch.Generator().manual_seed(seed * 100 + dist.get_rank())
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in range(k)]


def train_ours(model, data, hook_fn=None, raw_backward=False, **ddp_kwargs):
    acc = fresh(**ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = acc.prepare(model, opt)
    for i, (x, y) in enumerate(data):
        loss = nn.functional.mse_loss(model(x), y)
        if raw_backward:
            loss.backward()
        else:
            acc.backward(loss)
        if hook_fn:
            hook_fn(acc, model, i)
        opt.step()
        opt.zero_grad()
    return model, acc


def train_torch_ddp(model, data, comm_hook=None):
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    if comm_hook is not None:
        ddp.register_comm_hook(None, comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return ddp.module


def same_params(a, b, rtol, atol, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if not torch.allclose(p, q, rtol=rtol, atol=atol):
            fails.append(f"{what}: {name} differs by {(p - q).abs().max().item():.3e}")
    for (name, p), q in zip(a.named_buffers(), b.buffers()):
        if p.dtype.is_floating_point and not torch.allclose(p, q, rtol=rtol, atol=atol):
            fails.append(f"{what}: buffer {name} differs by {(p - q).abs().max().item():.3e}")


def same_on_all_ranks(obj, what):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    check(all(o == everyone[0] for o in everyone), f"{what} differs across ranks: {everyone}")


fresh()  # initialises the process group
torch.manual_seed(0)
base = MLP()
data = batches(4, seed=1)

# 1. torch DDP agreement (fp32: 1e-6 relative), through accelerator.backward and a raw
#    loss.backward() (the end of backward comes from the autograd engine callback)
ref = train_torch_ddp(copy.deepcopy(base), data)
for raw in (False, True):
    ours, _ = train_ours(copy.deepcopy(base), data, raw_backward=raw)
    same_params(ours, ref, 1e-6, 1e-7, f"vs torch DDP (raw backward={raw})")

# 2. the bucket plan: tiny cap -> many buckets; sizes within the cap; re-laid after step 1 in
#    the order gradients arrived, the same on all ranks; buckets launched while backward runs
CAP = 100  # bytes: 25 fp32 elements, under one 8x8 weight
cap_mb = CAP / 2**20
seen = {}


def inspect(acc, model, i):
    g = acc._grads.groups[0]
    spans = [g.reducer.range(b) for b in range(g.reducer.count())]
    sizes = {}
    for p, o in zip(g.params, g.offsets):
        b = next(k for k, (s, n) in enumerate(spans) if s <= o < s + n)
        sizes[b] = sizes.get(b, 0) + p.numel() * 4
    seen[i] = (g.strategy_state.relaid, list(g.order), spans, sizes)


launched_in_backward = []
model_b = copy.deepcopy(base)
acc_b = fresh(bucket_cap_mb=cap_mb)
opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
model_b, opt_b = acc_b.prepare(model_b, opt_b)
comm = acc_b._grads.strategy
orig_launch = comm.buckets_ready


def spy(g, first, last):
    launched_in_backward.append(torch._C._current_graph_task_id() != -1)
    orig_launch(g, first, last)


comm.buckets_ready = spy
for i, (x, y) in enumerate(data):
    acc_b.backward(nn.functional.mse_loss(model_b(x), y))
    inspect(acc_b, model_b, i)
    opt_b.step()
    opt_b.zero_grad()
same_params(model_b, ref, 1e-6, 1e-7, "tiny buckets vs torch DDP")
relaid0, order0, spans0, sizes0 = seen[0]
check(relaid0, "the buffer was not re-laid after the first reduced backward")
check(len(spans0) >= 5, f"a {CAP}-byte cap should give many buckets, got {len(spans0)}")
g0 = acc_b._grads.groups[0]
for b, nbytes in sizes0.items():
    # torch's closing rule: a bucket reaches the cap only with its last gradient
    inside = sorted((o, p.numel() * 4) for p, o in zip(g0.params, g0.offsets) if spans0[b][0] <= o < spans0[b][0] + spans0[b][1])
    cap_b = CAP  # a user-set bucket_cap_mb applies to the first bucket too (torch's rule)
    check(nbytes - inside[-1][1] < cap_b, f"bucket {b} holds {nbytes} bytes, {nbytes - inside[-1][1]} before its "
                                          f"last gradient (cap {cap_b})")
    if b + 1 < len(spans0):
        check(nbytes >= cap_b, f"bucket {b} closed at {nbytes} bytes, under the cap ({cap_b})")
same_on_all_ranks((order0, spans0), "the bucket plan")
# the arrival order: the output layer's gradients come first in backward, the first layer's last
names = [n for n, _ in model_b.named_parameters()]
first_name = names[order0[0]]  # the group holds every parameter, in registration order
check(first_name.startswith("out."), f"the re-laid plan should start with the output layer, starts with {first_name}")
check(seen[3][1] == order0, "the plan changed again after the first re-layout")
check(len(launched_in_backward) > 0 and all(launched_in_backward),
      f"buckets must be launched from the hooks while backward runs: {launched_in_backward}")

# 3. no_sync: local gradients differ across ranks; the next sync backward reduces the sum
acc = fresh()
m = copy.deepcopy(base)
m = acc.prepare(m)
(x1, y1), (x2, y2) = data[0], data[1]
with acc.no_sync(m):
    acc.backward(nn.functional.mse_loss(m(x1), y1))
local = m.out.weight.grad.clone()
everyone = acc.gather(local.reshape(1, -1))
check(not torch.equal(everyone[0], everyone[1]), "gradients under no_sync must stay local")
acc.backward(nn.functional.mse_loss(m(x2), y2))
plain = copy.deepcopy(base)
nn.functional.mse_loss(plain(x1), y1).backward()
nn.functional.mse_loss(plain(x2), y2).backward()
want = acc.reduce(plain.out.weight.grad.clone(), reduction="mean")
check(torch.allclose(m.out.weight.grad, want, rtol=1e-6, atol=1e-7), "no_sync then sync: not the mean of the sums")

# 4. two backwards in one sync step: each is reduced; the sum of the two means results
acc = fresh()
m = acc.prepare(copy.deepcopy(base))
acc.backward(nn.functional.mse_loss(m(x1), y1))
acc.backward(nn.functional.mse_loss(m(x2), y2))
check(torch.allclose(m.out.weight.grad, want, rtol=1e-5, atol=1e-7), "two backwards in one step: wrong sum")

# 4b. clip_grad_norm_ reuses the averaging pass's sum of squares, unless the gradients were
#     changed since (version counter): both cases against torch's clip on the same gradients.
#     The sums are taken during a reduced backward only once a clip has asked for a 2-norm, so
#     the cache is first reachable at the second step of one Accelerator; a counting stand-in
#     for the module's kernels tells whether clip read the buffer again.
for touch in (False, True, "data"):
    acc = fresh()
    m = acc.prepare(copy.deepcopy(base))
    acc.backward(nn.functional.mse_loss(m(x1), y1))
    acc.clip_grad_norm_(m.parameters(), 0.05)  # step 1: asks for 2-norms from now on
    for p in m.parameters():
        p.grad = None
    acc.backward(nn.functional.mse_loss(m(x2), y2))  # step 2: measured as it is reduced
    if touch is True:
        m.out.weight.grad.mul_(3.0)
    elif touch == "data":  # older code writes through .data, whose version counter is its own
        m.out.weight.grad.data.mul_(3.0)
    ref_grads = [p.grad.clone() for p in m.parameters()]
    ref_ps = [torch.nn.Parameter(torch.zeros_like(g)) for g in ref_grads]
    for p, g in zip(ref_ps, ref_grads):
        p.grad = g.clone()
    want_norm = torch.nn.utils.clip_grad_norm_(ref_ps, 0.05)
    with counting_reads() as counting:
        got = acc.clip_grad_norm_(m.parameters(), 0.05)
    check(torch.allclose(got, want_norm, rtol=1e-6), f"clip norm (touched={touch}): {got} vs {want_norm}")
    check((counting.reads > 0) == bool(touch),
          f"clip read the buffer {counting.reads} time(s) (touched={touch}): the cached sums were "
          f"{'trusted after a change' if touch else 'not used'}")
    for p, q in zip(m.parameters(), ref_ps):
        check(torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-9), f"clipped grads differ (touched={touch})")

# 5. an unused parameter without find_unused_parameters: a clear error naming it on every rank
acc = fresh()
m = acc.prepare(MLP(unused=True))
try:
    acc.backward(m(x1).sum())
    fails.append("an unused parameter without find_unused_parameters did not raise")
except RuntimeError as e:
    check("unused.weight" in str(e) and "find_unused_parameters=True" in str(e), f"unclear error: {e}")
dist.barrier()

# 6. find_unused_parameters: a parameter used on one rank only gets the mean (zeros elsewhere)
acc = fresh(find_unused_parameters=True)
m = acc.prepare(MLP(unused=True))
out = m(x1)
loss = out.sum() + (m.unused(x1).sum() if dist.get_rank() == 0 else 0.0)
acc.backward(loss)
g0 = torch.ones(2) * x1.shape[0] / dist.get_world_size()  # d(sum)/d(bias) on rank 0 only, averaged
check(m.unused.bias.grad is not None and torch.allclose(m.unused.bias.grad, g0),
      f"used on rank 0 only: {m.unused.bias.grad}")

# 7. comm_hook fp16 / bf16: the wire is 16 bits, matching torch DDP's compress hooks (torch
#    refuses its bf16 hook on gloo, by name; the reference is the same algorithm written out here)
def bf16_reference_hook(state, bucket):
    wire = bucket.buffer().to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f):
        buf = bucket.buffer()
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


for name, fn, tol in (("fp16", default_hooks.fp16_compress_hook, 1e-3), ("bf16", bf16_reference_hook, 1e-2)):
    ref16 = train_torch_ddp(copy.deepcopy(base), data, comm_hook=fn)
    windowed = collectives.window_ops()
    ours16, _ = train_ours(copy.deepcopy(base), data, comm_hook=name)
    same_params(ours16, ref16, tol, tol / 10, f"comm_hook={name} vs torch DDP")
    # over shared memory the 16-bit wire buffers live in a shared window (DDPStrategy._make_wire_bufs)
    check(collectives.cpu_comm() != "shm" or collectives.window_ops() > windowed,
          f"comm_hook={name} over shared memory: the wire buffers' all-reduces took the copy path")
    # and it is not the fp32 result: the wire really was 16 bits
    check(any(not torch.equal(p, q) for p, q in zip(ours16.parameters(), ref.parameters())),
          f"comm_hook={name} gave bit-identical fp32 results")

# 7b. a model cast to bf16 after prepare(): the backward that finds the cast breaks its buffer,
#     which the step rebuilds and then reduces whole (DDPStrategy.average_whole), with the comm
#     hook's wire as torch's hook has it (cast, divide, sum in fp16); later steps go through the
#     rebuilt buckets. torch DDP is given the bf16 model from the start. Each step's parameters
#     must match (on 2 ranks bitwise: a sum of two is the same in any order)
def cast_after_prepare(hook_name, hook_fn):
    data16 = [(x.to(torch.bfloat16), y.to(torch.bfloat16)) for x, y in data]
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base).to(torch.bfloat16), gradient_as_bucket_view=True)
    if hook_fn is not None:
        ddp.register_comm_hook(None, hook_fn)
    ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    acc = fresh(comm_hook=hook_name)
    ours = copy.deepcopy(base)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ours, opt = acc.prepare(ours, opt)
    ours.to(torch.bfloat16)
    for step, (x, y) in enumerate(data16):
        nn.functional.mse_loss(ddp(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        acc.backward(nn.functional.mse_loss(ours(x), y))
        opt.step()
        opt.zero_grad()
        for (name, p), q in zip(ours.named_parameters(), ddp.module.parameters()):
            exact = dist.get_world_size() == 2
            # 3 ranks: bf16 sums in another order, a bf16 ulp or two of the tensor's largest value
            ok = torch.equal(p, q) if exact else bool(
                (p.float() - q.float()).abs().max() <= 2 ** -6 * q.float().abs().max().clamp(min=1e-3))
            check(ok, f"cast after prepare, comm_hook={hook_name}, step {step}: {name} differs from torch DDP's by "
                      f"{(p.float() - q.float()).abs().max().item():.3e}")


# the hook's dtype differs from the gradients'; no hook (x 1/world before the sum); the hook's
# dtype is the gradients' (the bucket divided in it)
for hook_name, hook_fn in (("fp16", default_hooks.fp16_compress_hook), ("no", None), ("bf16", bf16_reference_hook)):
    cast_after_prepare(hook_name, hook_fn)

# 8. broadcast_buffers (default True): BatchNorm statistics follow torch DDP's
torch.manual_seed(3)
bn = MLP(bn=True)
ref_bn = train_torch_ddp(copy.deepcopy(bn), data)
ours_bn, _ = train_ours(copy.deepcopy(bn), data)
# with 3 ranks gloo's ring sums each element in an order that depends on the bucket
# boundaries, which differ from torch's; batch norm over 6 samples amplifies those last-bit
# differences over 4 steps to ~1e-5, hence 1e-4 here (the rounding, not the rule, differs)
same_params(ours_bn, ref_bn, 1e-4, 1e-5, "BatchNorm model vs torch DDP")

# 9. join_uneven_inputs: rank r has r+1 fewer batches than the last rank; the processes that
#    run out shadow the others' collectives; matches torch DDP under torch's Join
def uneven(k_base):
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    k = k_base + dist.get_rank()
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 2, generator=g)) for _ in range(k)]


from torch.distributed.algorithms.join import Join  # noqa: E402

torch.manual_seed(4)
jbase = MLP(bn=True)
jdata = uneven(2)
ref_j = nn.parallel.DistributedDataParallel(copy.deepcopy(jbase), gradient_as_bucket_view=True)
opt_r = torch.optim.SGD(ref_j.parameters(), lr=0.1, momentum=0.9)
with Join([ref_j]):
    for x, y in jdata:
        nn.functional.mse_loss(ref_j(x), y).backward()
        opt_r.step()
        opt_r.zero_grad()
acc = fresh(bucket_cap_mb=cap_mb)
mj = copy.deepcopy(jbase)
opt_j = torch.optim.SGD(mj.parameters(), lr=0.1, momentum=0.9)
mj, opt_j = acc.prepare(mj, opt_j)
with acc.join_uneven_inputs([mj], even_batches=False):
    for x, y in jdata:
        acc.backward(nn.functional.mse_loss(mj(x), y))
        opt_j.step()
        opt_j.zero_grad()
same_params(mj, ref_j.module, 1e-5, 1e-6, "join_uneven_inputs vs torch DDP + Join")
same_on_all_ranks([round(v, 6) for v in mj.out.weight.detach().reshape(-1).tolist()], "params after join")

# 10. fp16: an overflow on one rank skips that step on every rank (the averaged gradients
#     carry the Inf everywhere), the scale backs off everywhere, parameters stay identical
AcceleratorState._reset_state()
GradientState._reset_state()
acc = Accelerator(cpu=True, mixed_precision="fp16")
m16 = copy.deepcopy(base)
o16 = torch.optim.SGD(m16.parameters(), lr=0.1)
m16, o16 = acc.prepare(m16, o16)
skipped = []
for i, (x, y) in enumerate(data):
    loss = nn.functional.mse_loss(m16(x), y)
    if i == 1 and dist.get_rank() == 0:
        loss = loss * float("inf")
    acc.backward(loss)
    o16.step()
    o16.zero_grad()
    skipped.append(o16.step_was_skipped)
check(skipped == [False, True, False, False], f"rank {dist.get_rank()} skipped {skipped}")
same_on_all_ranks((skipped, acc.scaler.get_scale()), "fp16 skips and scale")
same_on_all_ranks([round(v, 7) for v in m16.out.weight.detach().reshape(-1).tolist()], "fp16 params")

# 11. two models in one loop (separate optimizers, both prepared): each matches torch DDP
torch.manual_seed(5)
base2 = MLP()
ref_a = train_torch_ddp(copy.deepcopy(base), data)
ref_b = train_torch_ddp(copy.deepcopy(base2), data)
acc = fresh(bucket_cap_mb=cap_mb)
ma, mb = copy.deepcopy(base), copy.deepcopy(base2)
oa = torch.optim.SGD(ma.parameters(), lr=0.1, momentum=0.9)
ob = torch.optim.SGD(mb.parameters(), lr=0.1, momentum=0.9)
ma, mb, oa, ob = acc.prepare(ma, mb, oa, ob)
for x, y in data:
    acc.backward(nn.functional.mse_loss(ma(x), y) + nn.functional.mse_loss(mb(x), y))
    oa.step()
    ob.step()
    oa.zero_grad()
    ob.zero_grad()
same_params(ma, ref_a, 1e-6, 1e-7, "two models: first")
same_params(mb, ref_b, 1e-6, 1e-7, "two models: second")

# 12. PowerSGD: a clear "not supported" error at prepare
try:
    fresh(comm_hook="power_sgd").prepare(copy.deepcopy(base))
    fails.append("PowerSGD did not raise")
except NotImplementedError as e:
    check("PowerSGD" in str(e), f"unclear PowerSGD error: {e}")

if fails:
    print(f"rank {dist.get_rank()}:\n" + "\n".join(fails[:30]), file=sys.stderr)
    sys.exit(1)
if dist.get_rank() == 0:
    print(f"reducer OK on {dist.get_world_size()} processes")
