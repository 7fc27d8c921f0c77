"""Full sharding (FSDP / ZeRO-3) on N CPU processes against torch DDP (launched by
tests/test_fsdp.py). argv: precision (fp32 | bf16), reshard_after_forward (1 | 0), wrap policy
(TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP), checkpointing (none | ac | reentrant).

The subject is a user's loop on accelerate_c with accelerate's own FullyShardedDataParallelPlugin
(fsdp_version 2): AdamW with two param groups, a scheduler built before prepare, gradient
accumulation 2 under accumulate(), accelerator.clip_grad_norm_, a block with a frozen layer in it
(a unit that mixes frozen and trainable parameters), and a weight tied between the embedding and
the output layer (in the root unit). The reference is the same loop on torch's
DistributedDataParallel over gloo, unsharded, clipped by torch.nn.utils.clip_grad_norm_ (1e-5);
under bf16 it is FSDP2's bf16 policy written out in torch, unsharded (reference_bf16: 1e-3).
Checked: the
parameters after every optimizer step (gathered with accelerator.get_state_dict), the norms, the
learning rates; that between steps each process holds 1/N of the parameters' and of the
optimizer state's elements (counted from distinct storage); that no full gradient is left in
p.grad; that model.state_dict() refuses clearly; eval under no_grad and inference_mode; (fp32) a
model prepared for evaluation before it is prepared for training.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin  # accelerate's own plugin, as a moved script keeps it

MP = sys.argv[1] if len(sys.argv) > 1 else "fp32"
RESHARD = (sys.argv[2] if len(sys.argv) > 2 else "1") == "1"
WRAP = sys.argv[3] if len(sys.argv) > 3 else "TRANSFORMER_BASED_WRAP"
# "ac": FSDP's activation_checkpointing (the plugin's); "reentrant": the model checkpoints each
# block itself with torch.utils.checkpoint(use_reentrant=True) (nested backwards); "none"
CKPT = sys.argv[4] if len(sys.argv) > 4 else "none"
# "untied": the output layer has its own weight (in the root unit, whose first gradient then
# comes first in backward and its last, the embedding's, last) and five blocks; default: tied
# to the embedding, three blocks
UNTIED = (sys.argv[5] if len(sys.argv) > 5 else "tied") == "untied"
STEPS = 5
GA = 2
MAX_NORM = 0.5
TOL = 1e-5 if MP == "fp32" else 1e-3


class Block(torch.nn.Module):
    def __init__(self, d, frozen=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        if frozen:
            self.up.requires_grad_(False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.blocks = torch.nn.ModuleList([Block(24), Block(24, frozen=True), Block(24)] +
                                          ([Block(24), Block(24)] if UNTIED else []))
        self.head = torch.nn.Linear(24, 37, bias=False)
        if not UNTIED:
            self.head.weight = self.emb.weight  # tied: one parameter

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = torch.utils.checkpoint.checkpoint(b, h, use_reentrant=True) if CKPT == "reentrant" else b(h)
        return self.head(h.mean(1))


def build():
    torch.manual_seed(0)
    model = Net()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
              {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0, "lr": 3e-3}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randint(0, 37, (4, 5), generator=g), torch.randint(0, 37, (4,), generator=g))
            for _ in range(STEPS * GA)]


def reference(rank):
    model, opt, sched = build()
    ddp = DDP(model)
    trace = []
    for i, (x, y) in enumerate(batches(rank)):
        last = (i + 1) % GA == 0
        with contextlib.nullcontext() if last else ddp.no_sync():
            (torch.nn.functional.cross_entropy(ddp(x), y) / GA).backward()
        if last:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            for _ in range(dist.get_world_size()):  # accelerate's AcceleratedScheduler
                sched.step()
            opt.zero_grad()
            trace.append(({n: p.detach().clone() for n, p in model.named_parameters()}, float(norm),
                          sched.get_last_lr()))
    return trace


def reference_bf16(rank):
    """FSDP2's bf16 policy written out in torch, unsharded: fp32 master weights; each
    micro-batch computes with a bf16 copy of them under autocast; each bf16 gradient, times 1/N
    and rounded to bf16, is summed over the processes in fp32 and rounded once (the rule of
    accelerate_c's 16-bit collectives, docs/collectives.md), and accumulated in fp32; clip and
    AdamW run on the fp32 masters."""
    import copy

    model, opt, sched = build()
    world = dist.get_world_size()
    acc_grads = None
    trace = []
    for i, (x, y) in enumerate(batches(rank)):
        half = copy.deepcopy(model).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = half(x)
        (torch.nn.functional.cross_entropy(out.float(), y) / GA).backward()
        grads = []
        for p in half.parameters():
            if p.grad is None:
                grads.append(None)
                continue
            g = (p.grad * (1.0 / world)).to(torch.bfloat16).float()
            dist.all_reduce(g)
            grads.append(g.to(torch.bfloat16).float())
        acc_grads = grads if acc_grads is None else [a if g is None else a + g for a, g in zip(acc_grads, grads)]
        if (i + 1) % GA == 0:
            for p, g in zip(model.parameters(), acc_grads):
                p.grad = g
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            for _ in range(world):
                sched.step()
            opt.zero_grad()
            acc_grads = None
            trace.append(({n: p.detach().clone() for n, p in model.named_parameters()}, float(norm),
                          sched.get_last_lr()))
    return trace


def subject(rank):
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=RESHARD, auto_wrap_policy=WRAP,
                                            min_num_params=1000, state_dict_type="FULL_STATE_DICT",
                                            activation_checkpointing=CKPT == "ac")
    acc = Accelerator(cpu=True, mixed_precision=MP if MP != "fp32" else "no", gradient_accumulation_steps=GA,
                      fsdp_plugin=plugin)
    assert acc.distributed_type == "FSDP", acc.distributed_type
    assert acc.is_fsdp2 and acc.state.fsdp_plugin is plugin
    model, opt, sched = build()
    total = sum(p.numel() for p in model.parameters())
    if MP == "fp32":  # prepared for evaluation first, as the Trainer's evaluate() before train() does
        acc.prepare_model(model, evaluation_mode=True)
        with torch.no_grad():
            model(batches(rank)[0][0])
    model, opt, sched = acc.prepare(model, opt, sched)
    names = [n for n, _ in model.named_parameters()]
    calls = [0]  # a layer inside a unit: under activation checkpointing it runs again in backward
    model.blocks[0].up.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    trace = []
    for x, y in batches(rank):
        with acc.accumulate(model):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            acc.backward(loss)
            assert all(p.grad is None for p in model.parameters()), "a full gradient was left in p.grad"
            norm = acc.clip_grad_norm_(model.parameters(), MAX_NORM) if acc.sync_gradients else None
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            sd = acc.get_state_dict(model)
            assert bool(sd) == (rank == 0), "get_state_dict: the main process's weights, {} elsewhere (FSDP2's)"
            box = [sd]
            dist.broadcast_object_list(box, src=0)  # every process checks them
            sd = box[0]
            trace.append(({n: sd[n] for n in names if n in sd}, float(norm), sched.get_last_lr()))
    runs = 1 if CKPT == "none" else 2  # the forward, and the recomputation of a checkpointed one
    assert calls[0] == runs * len(batches(rank)), (calls, CKPT)
    # between steps: 1/N of the parameters' and the optimizer state's elements on each process
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()
            if p.untyped_storage().nbytes()}
    mine = sum(p.numel() for p in model.parameters())
    state = sum(v.numel() for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim())
    counts = torch.tensor([mine, state], dtype=torch.float64)
    dist.all_reduce(counts)
    trainable = sum(p.numel() for p in build()[0].parameters() if p.requires_grad)
    world = dist.get_world_size()
    assert mine <= total / world * 1.05 + 64, (mine, total, world)
    assert abs(counts[0] - total) <= 64 * world * 3, (counts, total)  # padding of each unit's chunks
    assert abs(counts[1] - 2 * trainable) <= 2 * 64 * world * 3, (counts, trainable)
    # the storage behind the parameters is the shards (fp32), nothing full-size kept
    assert sum(held.values()) <= 4 * (total / world * 1.05 + 64 * 12), (held, total, world)
    try:  # p.grad is None under full sharding: a clip by value would clip nothing, so it refuses
        acc.clip_grad_value_(model.parameters(), 1.0)
    except RuntimeError as e:
        assert "FSDP" in str(e), e
    else:
        raise AssertionError("clip_grad_value_ under FSDP did not refuse")
    try:
        model.state_dict()
    except RuntimeError as e:
        assert "get_state_dict" in str(e), e
    else:
        raise AssertionError("model.state_dict() of a fully sharded model did not refuse")
    # forward outside training, parameters released after it
    x = batches(rank)[0][0]
    with torch.no_grad():
        a = model(x)
    with torch.inference_mode():
        b = model(x)
    assert torch.equal(a, b)
    assert sum(p.numel() for p in model.parameters()) == mine, "eval left a unit gathered"
    return trace


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ref = reference(rank) if MP == "fp32" else reference_bf16(rank)
    got = subject(rank)
    assert len(ref) == len(got) == STEPS, (len(ref), len(got))
    worst = 0.0
    for k, ((rp, rn, rl), (gp, gn, gl)) in enumerate(zip(ref, got)):
        assert set(rp) == set(gp), (set(rp) ^ set(gp))
        for n in rp:
            err = ((gp[n].float() - rp[n]).abs().max() / rp[n].abs().max().clamp_min(1e-12)).item()
            worst = max(worst, err)
            assert err <= TOL, f"step {k}: {n} differs by {err:.3g} relative (tolerance {TOL})"
        assert abs(gn - rn) <= TOL * max(1.0, abs(rn)), (k, gn, rn)
        assert gl == rl, (k, gl, rl)
    dist.barrier()
    if rank == 0:
        print(f"fsdp {MP} reshard={int(RESHARD)} {WRAP} {CKPT} OK on {dist.get_world_size()} processes (worst {worst:.2g})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
