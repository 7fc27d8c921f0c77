"""An FSDP case under bf16 trained with plain PyTorch the way accelerate 1.15 trains it with torch's
FSDP2 (fully_shard): the reference the harness holds accelerate_c's FSDP bf16 policy to. It never
imports accelerate_c, and it does not shard: sharding moves no value, so the full-size
arithmetic below is what FSDP2 computes, element by element.

Written from accelerate's FSDP2 path (utils/fsdp_utils.py fsdp2_prepare_model, utils/dataclasses.py
set_mixed_precision, Accelerator.no_sync / accumulate / prepare_model) and torch's
MixedPrecisionPolicy:
- accelerate's policy for mixed_precision="bf16" is param_dtype = reduce_dtype = bf16, and it
  upcasts trainable 16-bit parameters to fp32 before fully_shard: the sharded parameters, the
  optimizer's, are fp32 masters.
- every forward all-gathers the masters cast to param_dtype: the module computes with a bf16
  copy of them (frozen parameters cast too), under autocast (accelerate wraps the forward).
- accelerate's accumulate() (and no_sync) call set_requires_gradient_sync(False) on the
  micro-batches before a window's last: their unsharded bf16 gradients accumulate in bf16 (autograd
  adds them into the bf16 parameters' .grad, as FSDP2 keeps them when reduce_dtype is
  param_dtype), and only the window's last backward reduce-scatters.
- the reduce-scatter averages in reduce_dtype: the bf16 result here is the exact mean of the
  processes' bf16 gradients rounded to bf16 once (summed in float64, where a few bf16 values add
  exactly), the most exact result a bf16 collective can give. A real one rounds more (gloo's
  pairwise bf16 sums, FSDP2's pre/post divide factors, accelerate_c's terms x 1/N rounded to bf16
  then summed in fp32): compare.py bounds that by the terms the sum adds (Addends).
- the reduced bf16 gradient is upcast to the fp32 gradient shard (added to one left by a
  zero_grad(set_to_none=False)); torch.nn.utils.clip_grad_norm_ and the optimizer run on the fp32
  masters and their fp32 gradients; a torch scheduler steps once per process per step.
- fp16 is the same policy in fp16 (param_dtype = reduce_dtype = fp16) with accelerate's loss
  scaling for FSDP, torch's ShardedGradScaler: the loss multiplied by the scale before backward,
  the reduced gradients unscaled on the fp32 masters (by unscale_gradients(), the clip, or the
  step), a step with a non-finite gradient anywhere skipped (the sharded scaler agrees on it
  across processes; here the mean already carries one rank's inf), the scale updated as
  GradScaler updates it, and the scheduler not stepped on a skipped step. ShardedGradScaler is
  GradScaler plus that agreement: torch.amp.GradScaler over the unsharded masters computes the
  same.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from . import workload as W
from .reference import Addends, batches_of, evaluate, step_and_schedule, world_rank

_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _trainable(models) -> list:
    params: list = []
    for m in models:
        params += [p for p in m.parameters() if p.requires_grad and all(p is not q for q in params)]
    return params


MIN_NUM_PARAMS = 50  # subject.py's FSDP plugin (min_num_params), for SIZE_BASED_WRAP


def _wrapped(case: dict, module) -> bool:
    """accelerate's FSDP2 auto-wrap policy (fsdp2_prepare_auto_wrap_policy), asked of each module
    but the root: TRANSFORMER_BASED_WRAP with the class names subject.py gives (["Linear"]);
    SIZE_BASED_WRAP by the module's whole parameter count, strictly above min_num_params."""
    if case["fsdp_wrap"] == "TRANSFORMER_BASED_WRAP":
        return isinstance(getattr(module, "_checkpoint_wrapped_module", module), torch.nn.Linear)
    if case["fsdp_wrap"] == "SIZE_BASED_WRAP":
        return sum(p.numel() for p in module.parameters()) > MIN_NUM_PARAMS
    return False


def _frozen_outside_root(case: dict, model) -> list:
    """Frozen parameters that belong to a unit other than the root (a wrapped module holds them,
    or a wrapped module above it). The forward reads such a layer's weight.dtype before the
    layer's unit gathers (workload: `x.to(self.inp.weight.dtype)`), and FSDP2 shows the sharded
    parameter then, in its stored dtype: accelerate upcasts only trainable 16-bit parameters, so
    a frozen bf16 layer shows bf16 and its input is rounded to bf16 before autocast casts it to
    param_dtype. In the root's own forward its parameters are gathered, in param_dtype."""
    out = []
    for name, module in model.named_modules():
        if not name:
            continue
        path = name.split(".")
        holders = [model.get_submodule(".".join(path[:k])) for k in range(1, len(path) + 1)]
        if any(_wrapped(case, h) for h in holders):
            out += [p for p in module.parameters(recurse=False) if not p.requires_grad and p.is_floating_point()]
    return out


def _compute_copies(case, models, dtype):
    """What FSDP2's all-gathers give the forward: each model with every floating parameter in
    param_dtype (buffers too: this workload has none), the same structure (a tied weight stays one);
    but a frozen parameter of a unit other than the root keeps its stored dtype
    (_frozen_outside_root): the layer's own linear casts it to param_dtype under autocast, which
    is FSDP2's cast, and the dtype read before it is the sharded one."""
    copies = []
    for m in models:
        c = copy.deepcopy(m)
        stored = {id(p): p.data for p in _frozen_outside_root(case, c)}
        c.to(dtype)
        for p in c.parameters():
            if id(p) in stored:
                p.data = stored[id(p)]
        copies.append(c)
    return copies


def _eval_copy(case, model, dtype):
    """The compute copy an evaluation loop sees. Without reshard_after_forward FSDP2 leaves a unit
    gathered after a forward under no_grad (FSDPParamGroup.reshard returns early in the forward
    state, and no backward follows to reshard it): from the second evaluation batch on, the
    frozen layers of units other than the root show param_dtype."""
    c = _compute_copies(case, [model], dtype)[0]
    if not case["fsdp_reshard"]:
        frozen = _frozen_outside_root(case, c)

        def gathered(*_):
            for p in frozen:
                p.data = p.data.to(dtype)
        c.register_forward_hook(gathered)
    return c


def run(case: dict) -> dict:
    world, rank = world_rank()
    dtype = _DTYPE[case["mp"]]
    models = W.models(case)
    for m in models:  # accelerate's upcast of trainable 16-bit parameters to fp32 masters
        for p in m.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    params = _trainable(models)
    opts = W.optimizers(case, params)
    sched = W.schedule(opts[0])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16) if case["mp"] == "fp16" else None
    batches = batches_of(case, W.dataset(case), world, rank)
    trace = {"steps": [], "initial": [p.detach().float().clone() for p in params]}
    window = None  # (the compute copies, their trainable parameters, Addends, micro-batches so far)
    for epoch in range(case["epochs"]):
        epoch_batches = batches[case["skip_first"]:] if epoch == 0 else batches
        n = len(epoch_batches)
        for i, (x, y) in enumerate(epoch_batches):
            window_end = (i + 1) % case["ga"] == 0 or i + 1 == n
            if window is None:  # the masters change only at a step: one gather serves the window
                copies = _compute_copies(case, models, dtype)
                halves = _trainable(copies)
                window = [copies, halves, Addends(halves), 0]
            copies = window[0]
            with torch.autocast("cpu", dtype=dtype):
                # (fsdp_aux: the output layer called outside the forward, under the same autocast)
                aux = W.aux_loss(case, copies[0].out, x) if case.get("fsdp_aux") == "before" else 0.0
                outs = [c(x, **W.forward_kwargs(case, i)) for c in copies]
                if case.get("fsdp_aux") == "after":
                    aux = W.aux_loss(case, copies[0].out, x)
            loss = (W.loss_of([o.float() for o in outs], y) + aux) / case["ga"]
            if case["overflow"] is not None and case["overflow"] == (rank, i) and epoch == 0:
                loss = loss * float("inf")
            # into the 16-bit copies' .grad: FSDP2's unsharded accumulation
            (scaler.scale(loss) if scaler is not None else loss).backward()
            window[3] += 1
            if window_end:
                _step(case, params, window, opts, sched, scaler, world, trace)
                W.zero_grads(case, opts, models, params)
                window = None
    trace["final"] = [p.detach().float().clone() for p in params]
    if case["eval"]:
        trace["eval"] = evaluate(case, _eval_copy(case, models[0], dtype), dtype)
    return trace


def _reduce(grads: list, world: int) -> list:
    """The 16-bit mean over the processes of each 16-bit gradient, rounded once (module docstring)."""
    present = [g for g in grads if g is not None]
    dtypes = [g.dtype for g in present]
    if world > 1 and present:
        flat = torch.cat([g.double().reshape(-1) for g in present])
        dist.all_reduce(flat)
        present = [v.view(g.shape) for v, g in zip(flat.split([g.numel() for g in present]), present)]
    means = iter([(g.double() / world).to(dtype) for g, dtype in zip(present, dtypes)])
    return [None if g is None else next(means) for g in grads]


def _step(case, params, window, opts, sched, scaler, world, trace):
    _, halves, addends, micro = window
    for p, g in zip(params, _reduce([h.grad for h in halves], world)):
        if g is not None:
            g = g.float()  # the fp32 gradient shard
            p.grad = g if p.grad is None else p.grad + g
    scale = 1.0  # what the recorded gradients (and so the addends) were divided by
    if scaler is not None and (case["unscale_first"] or case["clip"] != "none"):
        (opt,) = opts  # one optimizer under FSDP (cases.py)
        scaler.unscale_(opt)
        scale = scaler.get_scale()
    terms = addends.take(halves, divide_by=scale)
    norm, clipped = None, W.clipped(case, params)
    if case["clip"] != "none":
        norm = W.torch_clip_norm(case, clipped)
    grads = [None if p.grad is None else p.grad.detach().float().clone() for p in params]
    rule = _sgd_rule(opts)
    skipped = step_and_schedule(opts, scaler, sched, world)
    trace["steps"].append({"params": [p.detach().float().clone() for p in params], "grads": grads,
                           "skipped": skipped, "lr": sched.get_last_lr()[0],
                           "scale": scaler.get_scale() if scaler is not None else None, "norm": norm,
                           "addends": terms, "micro_batches": micro, "sgd": rule})


def _sgd_rule(opts):
    """The update this step applies, for compare.py's parameter bound (a gradient difference
    becomes a parameter difference through it): {"lr", "momentum"} of a plain SGD (no dampening,
    Nesterov or weight decay: a linear map of the gradients), else None (the bound is derived for
    SGD only; AdamW is not drawn under bf16)."""
    (opt,) = opts  # one optimizer under FSDP (cases.py)
    g = opt.param_groups[0]
    if not isinstance(opt, torch.optim.SGD) or g["dampening"] or g["nesterov"] or g["weight_decay"]:
        return None
    return {"lr": float(g["lr"]), "momentum": float(g["momentum"])}
