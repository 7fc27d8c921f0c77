"""A case trained with plain PyTorch: the reference the harness holds accelerate_c to.

Written from torch's and accelerate's public behaviour, without importing accelerate_c:
torch DDP (no_sync for accumulation, find_unused_parameters, bucket_cap_mb, torch's own
fp16/bf16 compress hooks), torch.amp.GradScaler, torch.nn.utils.clip_grad_norm_/clip_grad_value_,
hand-written accumulation (loss / steps, a step at each window's end and at the loader's end), and
accelerate's rules that a user relies on: each process reads the batches accelerate 1.15's own
prepare_data_loader gives it, a skipped fp16 step does not advance the scheduler, and the
scheduler advances once per process per step (split_batches=False).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from accelerate.data_loader import prepare_data_loader
from accelerate.state import PartialState
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from . import workload as W

_AMP = {"bf16": torch.bfloat16, "fp16": torch.float16}


def world_rank():
    return (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)


def batches_of(case, ds, world, rank):
    """What accelerate 1.15 hands this process, batch by batch."""
    # accelerate's process state is a singleton that prepare_data_loader initialises on first
    # use; without cpu=True it takes a CPU process group for one process, and the evaluation's
    # Accelerator below would then gather nothing
    PartialState(cpu=True)
    shard = prepare_data_loader(W.loader(ds, case), device=torch.device("cpu"), num_processes=world,
                                process_index=rank, put_on_device=False, even_batches=not case["uneven"])
    return [tuple(t.clone() for t in b) for b in shard]


class Addends:
    """Per element, the largest magnitude each parameter's local gradient reaches in a window,
    over every rank: the size of the terms a 16-bit cross-rank sum adds at that element
    (compare.py bounds the sum's rounding by it). Tensor hooks see each micro-batch's gradient
    before it is accumulated or reduced; they return nothing, so the reference's arithmetic is
    untouched."""

    def __init__(self, params):
        self._acc = [None] * len(params)
        self._peak = [None] * len(params)
        for j, p in enumerate(params):
            p.register_hook(lambda g, j=j: self._seen(j, g))

    def _seen(self, j, g):
        g = g.detach().float()
        self._acc[j] = g.clone() if self._acc[j] is None else self._acc[j] + g
        seen = torch.maximum(g.abs(), self._acc[j].abs())
        seen = torch.where(torch.isfinite(seen), seen, torch.zeros_like(seen))
        self._peak[j] = seen if self._peak[j] is None else torch.maximum(self._peak[j], seen)

    def take(self, params, across_ranks: bool = True, divide_by: float = 1.0) -> list:
        """This window's peaks per element (MAX over ranks; this rank's alone where ranks step
        unevenly, as a collective there would not meet its peers: a smaller floor, a stricter
        comparison), in the units of the gradients compared (divide_by: the loss scale the
        reference unscaled them by before recording them), and a new window."""
        peaks = [torch.zeros(p.shape) if k is None else k for p, k in zip(params, self._peak)]
        if across_ranks and dist.is_initialized():
            flat = torch.cat([k.reshape(-1) for k in peaks])
            dist.all_reduce(flat, op=dist.ReduceOp.MAX)
            peaks = [v.view(p.shape) for v, p in zip(flat.split([k.numel() for k in peaks]), params)]
        self._acc = [None] * len(self._acc)
        self._peak = [None] * len(self._peak)
        return [k / divide_by for k in peaks]


def wrap(case, models, world):
    if world == 1:
        return models
    # (a forward that leaves out a layer on some steps needs find_unused_parameters under DDP)
    kwargs = {"find_unused_parameters": case["unused"] or bool(case.get("fsdp_skip") or case.get("rank_skip"))}
    if case["tiny_buckets"]:
        kwargs["bucket_cap_mb"] = W.bucket_cap_mb(case)
    wrapped = [DDP(m, **kwargs) for m in models]
    hook = {"fp16": default_hooks.fp16_compress_hook, "bf16": _bf16_hook}.get(case["comm_hook"])
    for d in wrapped:
        if hook is not None:
            d.register_comm_hook(dist.group.WORLD, hook)
    return wrapped


def _bf16_hook(group, bucket):
    """torch's bf16_compress_hook arithmetic (cast, divide by the world size in bf16, sum in bf16,
    cast back). torch's own refuses to register without NCCL; accelerate_c offers it on gloo."""
    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(wire, async_op=True).get_future()

    def back(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def run(case: dict) -> dict:
    world, rank = world_rank()
    models = W.models(case)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    addends = Addends(params)
    nets = wrap(case, models, world)
    opts = W.optimizers(case, params)
    sched = W.schedule(opts[0])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if case["mp"] == "fp16" else None
    amp = _AMP.get(case["mp"])
    batches = batches_of(case, W.dataset(case), world, rank)
    trace = {"steps": [], "initial": [p.detach().float().clone() for p in params]}
    with Join(nets) if case["uneven"] else contextlib.nullcontext():
        _train(case, nets, models, params, opts, sched, scaler, amp, batches, world, rank, trace, addends)
    trace["final"] = [p.detach().float().clone() for p in params]
    # after a join every process holds the model of the one that ran longest (torch's join hook
    # broadcasts it): the final parameters went through that process's steps, not this one's
    trace["final_steps"] = len(trace["steps"])
    if case["uneven"] and world > 1:
        n = torch.tensor([len(trace["steps"])])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        trace["final_steps"] = int(n)
    if case["eval"]:
        trace["eval"] = evaluate(case, models[0], amp)
    return trace


def _train(case, nets, models, params, opts, sched, scaler, amp, batches, world, rank, trace, addends):
    for epoch in range(case["epochs"]):
        epoch_batches = batches[case["skip_first"]:] if epoch == 0 else batches
        n = len(epoch_batches)
        for i, (x, y) in enumerate(epoch_batches):
            window_end = (i + 1) % case["ga"] == 0 or i + 1 == n
            with contextlib.ExitStack() as stack:
                if world > 1 and not window_end and not case.get("sync_each"):
                    for d in nets:
                        stack.enter_context(d.no_sync())
                aux = _aux(case, nets[0], amp, x) if case.get("fsdp_aux") == "before" else 0.0
                with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
                    outs = [d(x, **W.forward_kwargs(case, i, rank)) for d in nets]
                if case.get("fsdp_aux") == "after":
                    aux = _aux(case, nets[0], amp, x)
                loss = (W.loss_of([o.float() for o in outs], y) + aux) / case["ga"]
                if case["overflow"] is not None and case["overflow"] == (rank, i) and epoch == 0:
                    loss = loss * float("inf")
                (scaler.scale(loss) if scaler is not None else loss).backward()
            if not window_end:
                continue
            norm = _step(case, params, opts, scaler, world, sched, trace, addends)
            trace["steps"][-1]["norm"] = norm
            W.zero_grads(case, opts, models, params, engine=True)


def _aux(case, net, amp, x):
    """fsdp_aux: the output layer called directly (on the module DDP wraps), under autocast."""
    model = net.module if isinstance(net, DDP) else net
    with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
        return W.aux_loss(case, model.out, x)


def evaluate(case, model, amp, cast=None):
    """What accelerate 1.15's own gather_for_metrics collects over its prepared evaluation loader
    (first batches skipped as the case asks), fed with the reference model's outputs."""
    from accelerate import Accelerator as HFAccelerator

    hf = HFAccelerator(cpu=True)
    edl = hf.prepare(W.loader(W.eval_dataset(case), case))
    if case["eval_skip"]:
        edl = hf.skip_first_batches(edl, case["eval_skip"])
    outs = []
    with torch.no_grad():
        for x, _ in edl:
            with torch.autocast("cpu", dtype=amp) if amp is not None else contextlib.nullcontext():
                y = model(cast(x) if cast is not None else x).float()
            outs.append(hf.gather_for_metrics(y))
    return torch.cat(outs)


def step_and_schedule(opts, scaler, sched, world) -> bool:
    """The optimizer step (through GradScaler under fp16: skipped on an inf, the scale updated)
    and the scheduler's, unless skipped; whether it was skipped. accelerate steps a prepared
    torch scheduler once per process per step, under DeepSpeed too (only a scheduler built from
    the DeepSpeed configuration is the engine's)."""
    skipped = False
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(opts[0])  # fp16 is drawn with one optimizer (cases.py)
        scaler.update()
        skipped = scaler.get_scale() < before
    else:
        for opt in opts:
            opt.step()
    if not skipped:
        for _ in range(world):
            sched.step()
    return skipped


def _step(case, params, opts, scaler, world, sched, trace, addends):
    W.touch_grads(case, params, len(trace["steps"]))
    # the gradients recorded below are unscaled when unscale_ ran before them: the addends too
    scale = 1.0
    if scaler is not None and (case["unscale_first"] or case["clip"] != "none"):
        (opt,) = opts  # fp16 is drawn with one optimizer (cases.py)
        scaler.unscale_(opt)
        scale = scaler.get_scale()
    terms = addends.take(params, across_ranks=not case["uneven"], divide_by=scale)
    norm, clipped = None, W.clipped(case, params)
    sharded = case.get("sharding", "none") in ("zero1", "zero2", "zero3")
    if sharded:  # DeepSpeed clips inside its step: what the loop sees before it is unclipped
        grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
    if case["clip"] == "value":
        torch.nn.utils.clip_grad_value_(clipped, case["max_norm"])
    elif case["clip"] != "none":
        norm = W.torch_clip_norm(case, clipped)
    if not sharded:
        grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
    skipped = step_and_schedule(opts, scaler, sched, world)
    trace["steps"].append({"params": [p.detach().float().clone() for p in params], "grads": grads,
                           "skipped": skipped, "lr": sched.get_last_lr()[0],
                           "scale": scaler.get_scale() if scaler is not None else None, "addends": terms})
    return norm
