"""Full sharding's prefetch on N CPU processes (launched by tests/test_fsdp.py).

Checked in one run: (1) with prefetch on, the gather of the unit that runs next is launched
before the current unit's forward (and, in backward, before the current unit's backward)
computes: the order of events is read from hooks the test puts on the same modules; (2) at most
one unit is gathered ahead: the non-root units holding full storage at each unit's start are
counted; (3) the parameters after the steps are bitwise those of the same loop with prefetch
off, and within 1e-5 of torch's DistributedDataParallel over gloo (the independent reference);
(4) a forward whose path leaves out a unit the last forward ran (the prefetched unit is then
not run) still trains correctly, and that unit is released when the forward ends.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

LAYERS = 4
STEPS = 4
D = 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = torch.nn.Linear(D, 1)

    def forward(self, x, skip=None):
        h = self.inp(x)
        for k, b in enumerate(self.blocks):
            if k != skip:
                h = b(h)
        return self.out(h)


def batches(rank, world):
    g = torch.Generator().manual_seed(7)
    data = [(torch.randn(4 * world, 8, generator=g), torch.randn(4 * world, 1, generator=g)) for _ in range(STEPS)]
    return [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in data]


def skip_at(step):
    return 2 if step == 2 else None  # step 2 leaves out block 2, which the last forward ran


def run_ours(prefetch: bool, events: list | None):
    torch.manual_seed(0)
    model = Net()
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                            transformer_cls_names_to_wrap=["Block"], reshard_after_forward=True)
    acc = Accelerator(fsdp_plugin=plugin)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    strategy = acc._grads.strategy
    strategy.prefetch = prefetch
    units = strategy.models[id(model)].units
    by_module = {id(u.module): u for u in units}
    if events is not None:
        # the test's own hooks, registered after prepare's, see the state as the block starts computing
        def ahead():
            return sum(1 for u in units if not u.is_root and u.gathered and u.state != "forward"
                       and u.state != "backward")

        def launched():
            return [i for i, u in enumerate(units) if any(g.pending is not None for g in u.groups)]

        for k, b in enumerate(model.blocks):
            u = by_module[id(b)]

            def fwd(mod, args, _k=k, _u=u):
                events.append(("forward", _k, tuple(launched()), ahead()))

            b.register_forward_pre_hook(fwd)

            def bwd(mod, grad_out, _k=k):
                events.append(("backward", _k, tuple(launched()), ahead()))

            b.register_full_backward_pre_hook(bwd)
    rank, world = acc.process_index, acc.num_processes
    for step, (x, y) in enumerate(batches(rank, world)):
        loss = torch.nn.functional.mse_loss(model(x, skip=skip_at(step)), y)
        if prefetch and skip_at(step) is not None:  # prefetched, left out, released when the forward ended
            out = by_module[id(model.blocks[skip_at(step)])]
            assert not out.gathered, "a prefetched unit the forward left out is still gathered after it"
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        left = [i for i, u in enumerate(units) if u.gathered]
        assert not left, f"units {left} still gathered after the step"
    sd = acc.get_state_dict(model)
    obj = [sd]
    dist.broadcast_object_list(obj, src=0)
    return obj[0], units


def run_ddp():
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, find_unused_parameters=True)  # block 2 sits out step 2
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step, (x, y) in enumerate(batches(rank, world)):
        loss = torch.nn.functional.mse_loss(ddp(x, skip=skip_at(step)), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def main():
    events: list = []
    on, units = run_ours(True, events)
    off, _ = run_ours(False, None)
    rank = dist.get_rank()
    for k in on:
        assert torch.equal(on[k], off[k]), f"{k}: prefetch on and off differ"
    ref = run_ddp()
    for k, v in ref.items():
        err = (on[k].float() - v.float()).abs().max().item()
        assert err <= 1e-5 * max(1.0, v.abs().max().item()), f"{k}: {err} from DDP"
    # forward of step 0: no order recorded yet, so nothing is launched ahead; from step 1 on,
    # block k starts with block k+1's gather launched (the last one with none)
    fwd = [e for e in events if e[0] == "forward"]
    block_unit = [i for i, u in enumerate(units) if type(u.module).__name__ == "Block"]
    step1 = fwd[LAYERS:2 * LAYERS]
    for k, (_, blk, launched, ahead) in enumerate(step1):
        assert blk == k
        assert ahead <= 1, f"step 1, block {k}: {ahead} units gathered ahead (bound 1)"
        want = (block_unit[k + 1],) if k + 1 < LAYERS else ()
        assert launched == want, f"step 1, block {k}: launched {launched}, expected {want} (the next block's)"
    bwd = [e for e in events if e[0] == "backward"]
    # backward of step 0 runs blocks 3, 2, 1, 0. The test's backward pre-hook on a block runs
    # before ours (module backward hooks wrap the outputs after the forward hooks): at block k it
    # sees block k's own gather in flight, launched by the unit whose backward came before
    # (the root's for block 3); block k's hook then waits for it and launches block k-1's
    for n, (_, blk, launched, ahead) in enumerate(bwd[:LAYERS]):
        assert blk == LAYERS - 1 - n
        assert launched == (block_unit[blk],) and ahead <= 1, \
            f"backward, block {blk}: launched {launched}, expected {(block_unit[blk],)}; ahead {ahead}"
    print(f"rank {rank}: prefetch OK ({len(fwd)} forward and {len(bwd)} backward block starts checked)")


if __name__ == "__main__":
    main()
