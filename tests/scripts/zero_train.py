"""ZeRO stage 1 or 2 (argv[1], default 1) on N CPU processes against torch DDP (launched by
tests/test_zero.py).

The subject is a user's loop on accelerate_c with `DeepSpeedPlugin(zero_stage=STAGE)`: AdamW with
two param groups (weight decay on the weights only, a larger learning rate on the rest), a
scheduler built before prepare, gradient accumulation 2, gradient_clipping in the plugin (the
engine clips inside its step, as accelerate's DeepSpeed engine; clip_grad_norm_ reports the norm),
a frozen layer and a weight tied between the embedding and the output layer. The reference is the
same loop on torch's DistributedDataParallel (no_sync for accumulation) with the same torch
optimizer, unsharded, clipped by torch.nn.utils.clip_grad_norm_, and its scheduler stepped as
accelerate steps a torch scheduler under DeepSpeed (once per process per step).
Checked: the parameters after every optimizer step, the norms clip returned (and that it left the
gradients as they were), the learning rates;
that over shared memory (the default on one host) the parameters live in shared windows; that
each process keeps optimizer state for its owned elements only (summed over processes, the
whole model once); the bytes each process holds against the stage's formula; under stage 2 that
no full gradient is left in p.grad after a backward; and the refusals.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from accelerate_c import Accelerator, collectives
from accelerate.utils import DeepSpeedPlugin  # accelerate's own plugin, as a moved script keeps it

STAGE = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 1
STEPS = 6  # optimizer steps
GA = 2
MAX_NORM = 0.5


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(37, 24)
        self.frozen = torch.nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.body = torch.nn.Sequential(torch.nn.Linear(24, 48), torch.nn.GELU(), torch.nn.Linear(48, 24))
        self.head = torch.nn.Linear(24, 37)
        self.head.weight = self.emb.weight  # tied: one parameter

    def forward(self, x):
        h = self.emb(x).mean(1)
        return self.head(self.body(self.frozen(h)))


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
            for _ in range(dist.get_world_size()):  # accelerate's AcceleratedScheduler, DeepSpeed or not
                sched.step()
            opt.zero_grad()
            trace.append((float(norm), [p.detach().clone() for p in model.parameters()],
                          [g["lr"] for g in opt.param_groups]))
    REF_STATE.update(opt.state_dict())
    return trace


REF_STATE: dict = {}  # the reference optimizer's state_dict() after training


def check_full_state(acc, opt):
    """full_optimizer_state_dict: the unsharded torch optimizer's state_dict(), gathered from
    every process's shard; a process that calls it alone gets an error, not a hang."""
    full = acc.full_optimizer_state_dict(opt)
    assert [g["params"] for g in full["param_groups"]] == [g["params"] for g in REF_STATE["param_groups"]], \
        (full["param_groups"], REF_STATE["param_groups"])
    assert sorted(full["state"]) == sorted(REF_STATE["state"]), (sorted(full["state"]), sorted(REF_STATE["state"]))
    for k, ref in REF_STATE["state"].items():
        got = full["state"][k]
        assert sorted(got) == sorted(ref), (k, sorted(got), sorted(ref))
        for key, v in ref.items():
            a, b = torch.as_tensor(got[key]).float(), torch.as_tensor(v).float()
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
            assert a.shape == b.shape and err <= 1e-4, f"state {k} {key}: off by {err:.3g}"
    # and loads into the plain torch optimizer of an unsharded copy (torch checks the groups' sizes)
    _, plain, _ = build()
    plain.load_state_dict(full)
    assert all(torch.equal(plain.state_dict()["state"][k]["exp_avg"], full["state"][k]["exp_avg"])
               for k in full["state"])


def check_alone(acc, opt):
    if dist.get_rank() == 0:
        try:
            acc.full_optimizer_state_dict(opt, timeout_s=2)
        except RuntimeError as e:
            assert "every process must call it" in str(e), str(e)
        else:
            raise AssertionError("full_optimizer_state_dict on one process alone returned")


def subject(rank, world):
    plugin = DeepSpeedPlugin(zero_stage=STAGE, gradient_accumulation_steps=GA, gradient_clipping=MAX_NORM)
    # no data loader goes through prepare() here: the batch size "auto" cannot be filled from one
    # (accelerate's error says to set it, as here)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 4
    acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
    model, opt, sched = build()
    model, opt, sched = acc.prepare(model, opt, sched)
    if collectives.cpu_comm() == "shm":
        # over shared memory the trainable parameters live in shared windows, so the all-gather
        # after each step reads the other processes' chunks in place (its window path)
        assert all(collectives.in_shared_buffer(p) for p in model.parameters() if p.requires_grad), \
            "a ZeRO parameter buffer is not in a shared window"
    trace = []
    for x, y in batches(rank):
        with acc.accumulate(model):
            ops = collectives.window_ops()
            acc.backward(torch.nn.functional.cross_entropy(model(x), y))
            if STAGE == 2 and collectives.cpu_comm() == "shm":
                # the buckets were staged in the shared window and reduce-scattered there
                assert collectives.window_ops() > ops, "no ZeRO-2 reduce-scatter took the window path"
            if STAGE == 2:  # only a shard of the gradients exists, as with DeepSpeed
                assert all(p.grad is None for p in model.parameters()), "ZeRO-2 left a full gradient in p.grad"
            norm = None
            if acc.sync_gradients:
                # gathered under stage 2 (get_full_grad is a collective), p.grad under stage 1
                trainable = [p for p in model.parameters() if p.requires_grad]
                before = [acc.get_full_grad(p).clone() for p in trainable]
                norm = acc.clip_grad_norm_(model.parameters(), 1e-9)  # max_norm is DeepSpeed's, not this
                after = [acc.get_full_grad(p) for p in trainable]
                assert isinstance(norm, float) and all(torch.equal(a, b) for a, b in zip(before, after)), \
                    "clip_grad_norm_ under DeepSpeed changed the gradients"
            opt.step()
            sched.step()
            opt.zero_grad()
        if acc.sync_gradients:
            trace.append((float(norm), [p.detach().clone() for p in model.parameters()],
                          [g["lr"] for g in opt.param_groups]))
    return acc, model, opt, trace


def check_memory(acc, model, opt, world):
    """Optimizer state for the owned elements only, and the stage's bytes: 4 per trainable
    element (parameters), 8 per owned element (AdamW's two moments) and the gradients: 4 per
    trainable element in the flat buffers (stage 1: 8Ψ + 8Ψ/N), or 4 per owned element in the
    gradient shard (stage 2: 4Ψ + 12Ψ/N) with the staging buffers of the buckets being reduced
    counted apart (at most two buckets and one being filled, kept between backwards as
    DeepSpeed keeps its reduce bucket)."""
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}
    psi = sum(p.numel() for p in trainable.values())
    state_elems = sum(v.numel() for s in opt.state.values() for k, v in s.items()
                      if torch.is_tensor(v) and k in ("exp_avg", "exp_avg_sq"))
    total = torch.tensor([state_elems], dtype=torch.int64)
    dist.all_reduce(total)
    assert int(total) == 2 * psi, f"optimizer state over all processes {int(total)} elements, want 2 x {psi}"
    param_bytes = sum(p.numel() * p.element_size() for p in trainable.values())
    # the flat gradient buffers the library keeps (the .grad views are None after zero_grad), or
    # the gradient shards
    grad_bytes = sum(g.flat.numel() * g.flat.element_size() for g in acc._grads.groups)
    strategy = acc._grads.strategy
    if STAGE == 2:
        assert grad_bytes == 0, f"ZeRO-2 kept {grad_bytes} bytes of full gradient buffers"
        mem = strategy.memory()
        grad_bytes = mem["grad_shards"]
        largest = max(c for gs in strategy.grad_shards for _, c, *_ in gs.buckets) * world * 4
        assert mem["grad_staging"] <= 3 * largest, f"staging {mem['grad_staging']} bytes, buckets of {largest}"
    held = param_bytes + grad_bytes + 4 * state_elems
    formula = 8 * psi + 8 * psi / world if STAGE == 1 else 4 * psi + 12 * psi / world
    # the padding: each bucket rounds up to world x 16 elements (64-byte alignment, fp32)
    pad = 8 * world * 16 * 4
    assert abs(held - formula) <= 0.05 * formula + pad, f"holds {held} bytes, ZeRO-1's formula {formula:.0f}"
    return held, formula


def check_frozen_in_optimizer(acc, model):
    """An optimizer over model.parameters(), the frozen ones included (torch takes it; they
    never get a gradient): prepared, with the frozen parameters kept as they are."""
    sgd = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    listed = {id(p) for g in sgd.param_groups for p in g["params"]}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert frozen and all(id(p) in listed for p in frozen), "the frozen parameters left the optimizer"


def check_refusals(acc, model):
    lbfgs = torch.optim.LBFGS(model.parameters())
    try:
        acc.prepare(lbfgs)
    except ValueError as e:
        assert "LBFGS" in str(e), str(e)
    else:
        raise AssertionError(f"LBFGS was prepared under ZeRO-{STAGE}")
    # as accelerate under DeepSpeed: a warning, and no effect
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with acc.join_uneven_inputs([model]):
            pass
    assert any("only supported for multi-GPU" in str(w.message) for w in caught), [str(w.message) for w in caught]


def warmup_lr(n, max_lr, warmup):
    """DeepSpeed's WarmupLR (log warm-up from 0) after n scheduler steps, from its documentation:
    min_lr before the first step, then min + (max - min) * log(n) / log(warmup) up to warmup."""
    if n == 0:
        return 0.0
    w = max(2, warmup)
    return max_lr * (math.log(n) / math.log(w) if n - 1 < w else 1.0)


def check_dummies(rank, world):
    """DeepSpeed's optimizer and scheduler blocks through DummyOptim / DummyScheduler, their
    "auto" values filled at prepare() (the batch size from the data loader, lr and weight decay
    from the DummyOptim, the warm-up from the DummyScheduler): the same updates as torch's AdamW
    with DeepSpeed's WarmupLR written out, stepped once per optimizer step (the engine's)."""
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # accelerate's own, as a moved script has them

    cfg = {"zero_optimization": {"stage": STAGE}, "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.95]}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}}}
    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    model, _, _ = build()
    data = [b for b in batches(rank)][:4]
    loader = torch.utils.data.DataLoader([(x[k], y[k]) for x, y in data for k in range(4)], batch_size=4)
    dopt = DummyOptim(model.parameters(), lr=2e-2, weight_decay=0.05)
    model, opt, loader, sched = acc.prepare(model, dopt, loader, DummyScheduler(dopt, warmup_num_steps=3))
    assert isinstance(opt.optimizer, torch.optim.AdamW), type(opt.optimizer)
    assert acc.sharding.micro_batch_size == 4 and acc.sharding.train_batch_size == 4 * world
    got = []
    for x, y in loader:
        acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
        got.append([p.detach().clone() for p in model.parameters()])
    ref_model, _, _ = build()
    ddp = DDP(ref_model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.0, weight_decay=0.05, betas=(0.9, 0.95))
    xs = [b for b in loader]  # the prepared loader's batches on this rank (in order: no shuffle), again
    for n, (x, y) in enumerate(xs):
        for g in ref_opt.param_groups:
            g["lr"] = warmup_lr(n, 2e-2, 3)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for a, b in zip(got[n], ref_model.parameters()):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            assert err <= 1e-5, f"DummyOptim step {n}: off by {err:.3g}"
    assert abs(sched.get_last_lr()[0] - warmup_lr(len(xs), 2e-2, 3)) < 1e-12, sched.get_last_lr()


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    ref = reference(rank)
    acc, model, opt, sub = subject(rank, world)
    assert len(sub) == len(ref) == STEPS, (len(sub), len(ref))
    worst = 0.0
    for k, ((n_s, p_s, lr_s), (n_r, p_r, lr_r)) in enumerate(zip(sub, ref)):
        assert abs(n_s - n_r) <= 1e-5 * max(abs(n_r), 1e-6), f"step {k}: clip returned {n_s}, torch {n_r}"
        assert lr_s == lr_r, f"step {k}: learning rates {lr_s}, torch {lr_r}"
        for j, (a, b) in enumerate(zip(p_s, p_r)):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            worst = max(worst, err)
            assert err <= 1e-5, f"step {k}: parameter {j} off by {err:.3g} (relative)"
    held, formula = check_memory(acc, model, opt, world)
    # state_dict() is this process's shard, without a collective: fewer moment elements than the
    # model has (each process owns part of it), and the two param groups with their settings
    sd = opt.state_dict()
    sd_elems = sum(v.numel() for s in sd["state"].values() for k, v in s.items() if k == "exp_avg")
    assert 0 < sd_elems < sum(p.numel() for p in model.parameters() if p.requires_grad), sd_elems
    assert [g["weight_decay"] for g in sd["param_groups"]] == [0.1, 0.0]
    check_full_state(acc, opt)
    check_frozen_in_optimizer(acc, model)
    check_refusals(acc, model)
    check_dummies(rank, world)
    dist.barrier()
    check_alone(acc, opt)  # last: the process left out never joins that barrier
    if rank == 0:
        print(f"zero{STAGE} OK on {world} processes: max relative error {worst:.2e}, bytes held {held} "
              f"(formula {formula:.0f})")
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
