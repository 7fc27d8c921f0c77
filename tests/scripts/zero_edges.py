"""ZeRO (argv[1]: stage 1 or 2) on 2 CPU processes in the loops a review found wrong under stage 2,
each against plain torch DDP run in the same process (launched by tests/test_zero.py):

- accelerate's find_executable_batch_size pattern: free_memory(), then the same model prepared
  again with a new optimizer: both attempts train (stage 2 once stacked a second hook that left
  every gradient None), with one forward-sync hook on the model (every prepare once added one);
- free_memory(), then the loop drops its model and optimizer: freed, with the parameters' flat
  buffer (the strategy once kept them until the Accelerator went); the old optimizer prepared
  again is refused by name;
- model.zero_grad() between a discarded backward and the real one: the step reads only the
  second backward's gradients (stage 2 once kept the first's in its shard);
- a backward that raises midway on every process, caught, both optimizers (each over part of the
  model) zeroed, training going on: the same as skipping that batch (stage 2 once kept partial
  sums; DDP and stage 1 once re-reduced at the next step);
- reentrant activation checkpointing whose first gradient lands inside a segment (stage 2 once
  ended the backward at the segment's end);
- a parameter whose storage is replaced after prepare: refused by name at the step.
"""
from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from accelerate.utils import DeepSpeedPlugin

import accelerate_c.state
from accelerate_c import collectives
from accelerate_c import Accelerator

STAGE = int(sys.argv[1])


def make_acc(**kw):
    accelerate_c.state.AcceleratorState._reset_state()
    accelerate_c.state.GradientState._reset_state()
    plugin = DeepSpeedPlugin(zero_stage=STAGE, gradient_clipping=0.0)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    return Accelerator(cpu=True, deepspeed_plugin=plugin, **kw)


def close(a, b, what, tol=1e-6):
    for x, y in zip(a, b):
        err = (x - y).abs().max().item() / max(y.abs().max().item(), 1e-6)
        assert err <= tol, f"{what}: off by {err:.3g}"


def x_of(rank, n=3, d=4):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(7 + rank))


def free_memory_then_prepare_again(rank):
    acc = make_acc()
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(m.state_dict())
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for attempt in range(2):
        acc.free_memory()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        pm, opt = acc.prepare(m, opt)
        acc.backward(pm(x_of(rank)).square().sum())
        opt.step()
        opt.zero_grad()
        ddp(x_of(rank)).square().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        close(list(pm.parameters()), list(ref.parameters()), f"attempt {attempt} after free_memory()")
        # one forward-sync hook whatever the number of prepares (torch DDP wraps once; a hook per
        # prepare would broadcast buffers once per prepare, and mismatch join's shadow all-reduce)
        assert len(pm._forward_pre_hooks) == 1, f"attempt {attempt}: {len(pm._forward_pre_hooks)} forward pre-hooks"


def _shm_mappings() -> set:
    """The shared-memory segments this process maps (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        return {line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line}


def free_memory_releases_what_was_prepared(rank):
    """free_memory(), then the loop drops its model and optimizer: they are freed, with the flat
    buffer the parameters live in (a shared window under the shm collectives): the strategy kept
    every prepared model's shards and rebuilt optimizer until the Accelerator went. The dropped
    optimizer, prepared again instead, is refused by name (its param_groups list the old runs).
    The next model prepared on the same Accelerator trains as torch DDP does."""
    acc = make_acc()
    torch.manual_seed(0)
    shm = collectives.cpu_comm() == "shm"
    mapped = _shm_mappings()
    m = torch.nn.Linear(64, 32)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    pm, popt = acc.prepare(m, opt)
    acc.backward(pm(x_of(rank, d=64)).square().sum())
    popt.step()
    popt.zero_grad()
    # under the shm collectives the parameters live in a shared window: one more mapping
    assert not shm or len(_shm_mappings() - mapped) >= 1, "the parameters are not in a shared window"
    held = [weakref.ref(m.weight), weakref.ref(opt)]
    acc.free_memory()
    for again in (opt, popt):  # the user's optimizer, and the wrapper prepare() returned (the Trainer's)
        try:
            acc.prepare(again)
        except ValueError as e:
            assert "prepared before free_memory()" in str(e), e
        else:
            raise AssertionError(f"an optimizer rebuilt before free_memory() was prepared again ({type(again).__name__})")
    del m, opt, pm, popt, again
    gc.collect()
    alive = [w for w in held if w() is not None]
    assert not alive, f"after free_memory() and the loop dropping them, still alive: {[type(w()).__name__ for w in alive]}"
    left = _shm_mappings() - mapped
    assert not left, f"after free_memory() and the loop dropping the model, still mapped: {sorted(left)}"
    torch.manual_seed(1)
    m2 = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(m2.state_dict())
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    m2, opt2 = acc.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    acc.backward(m2(x_of(rank)).square().sum())
    opt2.step()
    ddp(x_of(rank)).square().sum().backward()
    ref_opt.step()
    close(list(m2.parameters()), list(ref.parameters()), "a model prepared after free_memory()")


def model_zero_grad_discards(rank):
    acc = make_acc()
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    ref = torch.nn.Linear(4, 1)
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = acc.prepare(m, opt)
    acc.backward(m(x_of(rank)).sum() * 100)  # a batch the loop decides to discard
    m.zero_grad()
    acc.backward(m(x_of(rank)).sum())
    opt.step()
    ddp = DDP(ref)
    ddp(x_of(rank)).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    close(list(m.parameters()), list(ref.parameters()), "the step after model.zero_grad()")


class Boom(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if Boom.armed:
            raise ValueError("boom")
        return g


class Deep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(6))

    def forward(self, x):
        for i, layer in enumerate(self.l):
            x = torch.tanh(layer(x))
            if i == 1:
                x = Boom.apply(x)
        return x.sum()


def failed_backward_is_forgotten(rank):
    from accelerate_c.utils import DistributedDataParallelKwargs
    acc = make_acc(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.003)])
    torch.manual_seed(0)
    m = Deep()
    ref = Deep()
    ref.load_state_dict(m.state_dict())
    o1, o2 = torch.optim.SGD(m.l[:3].parameters(), lr=0.1), torch.optim.SGD(m.l[3:].parameters(), lr=0.1)
    m, o1, o2 = acc.prepare(m, o1, o2)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(3)) * (1 + rank)
    for it in range(3):
        Boom.armed = it == 1
        try:
            acc.backward(m(x) * (100.0 if it == 1 else 1.0))
            o1.step()
            o2.step()
        except ValueError:
            pass
        o1.zero_grad()
        o2.zero_grad()
    Boom.armed = False
    ddp = DDP(ref)
    r1, r2 = torch.optim.SGD(ref.l[:3].parameters(), lr=0.1), torch.optim.SGD(ref.l[3:].parameters(), lr=0.1)
    for it in (0, 2):  # the failed batch skipped
        ddp(x).backward()
        r1.step()
        r2.step()
        r1.zero_grad()
        r2.zero_grad()
    close(list(m.parameters()), list(ref.parameters()), "training after a failed backward", tol=1e-5)


class Segments(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l0, self.l1, self.l2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, reentrant=True):
        h = self.l0(x)
        h = checkpoint(self.l1, h, use_reentrant=reentrant)
        return checkpoint(self.l2, h, use_reentrant=reentrant)


def reentrant_first_gradient_in_a_segment(rank):
    acc = make_acc()
    torch.manual_seed(0)
    m = Segments()
    ref = Segments()
    ref.load_state_dict(m.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = acc.prepare(m, opt)
    x = x_of(rank, 4, 8)
    acc.backward(m(x).sum())
    opt.step()
    ddp = DDP(ref)  # torch DDP takes non-reentrant checkpointing: the same gradients
    ddp(x, reentrant=False).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    close(list(m.parameters()), list(ref.parameters()), "reentrant checkpointing")


def replaced_storage_is_refused(rank):
    """The parameters live in one flat buffer per shard group after prepare (as DeepSpeed lays
    them); one whose storage is replaced later would silently stop receiving updates: refused."""
    acc = make_acc()
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = acc.prepare(m, opt)
    m.weight.data = m.weight.data.clone()
    acc.backward(m(x_of(rank)).sum())
    try:
        opt.step()
    except RuntimeError as e:
        assert "weight no longer views the flat buffer" in str(e), e
    else:
        raise AssertionError("a parameter whose storage was replaced after prepare was not refused")


def main():
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for check in (free_memory_then_prepare_again, free_memory_releases_what_was_prepared, model_zero_grad_discards, failed_backward_is_forgotten,
                  reentrant_first_gradient_in_a_segment, replaced_storage_is_refused):
        check(rank)
    dist.barrier()
    if rank == 0:
        print(f"zero{STAGE} edges OK")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
