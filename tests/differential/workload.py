"""The model, data and optimizer of a case: the fixtures both sides start from.

Nothing here is under test. The subject (accelerate_c) and the reference (plain torch) each build
their own copy from the case, so both start from identical weights and see identical samples.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

IN, HID, OUT = 6, 12, 3
_DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


class Net(torch.nn.Module):
    """A small MLP whose layers the case dresses up: dtypes, a frozen layer, an unused layer, a
    stack of identical blocks,
    reentrant-checkpointed segments (one weight in two of them, or a segment per layer) or
    non-reentrant ones (the middle and the output layer each in one); under
    full sharding also a weight tied between two layers (`tied`: a second layer holding the middle
    layer's weight, as a tied embedding and output layer, two modules that do not nest) and a
    layer half frozen (`frozen_bias`: the middle layer's bias, so its unit mixes frozen and
    trainable parameters whatever the wrap policy)."""

    def __init__(self, case: dict, salt: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(case["seed"] * 7 + salt)
        self.inp = torch.nn.Linear(IN, HID)
        self.mid = torch.nn.Linear(HID, HID)
        self.out = torch.nn.Linear(HID, OUT)
        if case["unused"]:
            self.spare = torch.nn.Linear(HID, HID)  # never called
        # f64: a float64 layer beside the middle one (applied after it, as a residual)
        self.side = torch.nn.Linear(HID, HID) if case.get("f64", False) else None
        self.tied = case.get("tied", False)
        if self.tied:
            self.mid2 = torch.nn.Linear(HID, HID)  # its own bias, the middle layer's weight (below)
        # blocks: two identical layers after the input layer, in an nn.ModuleList: what regional
        # compilation compiles one by one (accelerate's compile_regions), and two more units for
        # full sharding's wrap policies and ZeRO-3 (registered last: the other layers' draws stay)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(HID, HID) for _ in range(2)) if case.get("blocks") else None
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        if self.tied:
            self.mid2.weight = self.mid.weight  # one Parameter in two modules
        dt = case["param_dtype"]
        if dt == "bf16":
            self.to(torch.float16 if case.get("fp16") else torch.bfloat16)
        elif dt == "mixed":
            self.mid.to(torch.bfloat16)
            if self.tied:
                self.mid2.to(torch.bfloat16)
        if self.side is not None:  # float64 whatever the other layers' dtype
            self.side.double()
        if case["frozen"]:
            self.inp.requires_grad_(False)
        if case.get("frozen_bias", False):
            self.mid.bias.requires_grad_(False)
        self.reentrant = case["reentrant"]
        self.nonreentrant = case.get("nonreentrant", False)

    def forward(self, x, skip_mid: bool = False):
        h = torch.tanh(self.inp(x.to(self.inp.weight.dtype)))
        for block in self.blocks if self.blocks is not None else ():
            h = torch.tanh(block(h.to(block.weight.dtype)))
        h = h.to(self.mid.weight.dtype)
        if skip_mid:  # data-dependent control flow (fsdp_skip): the middle layer left out
            pass
        elif self.reentrant == "shared":  # one weight in two segments
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
        elif self.reentrant == "separate":  # each segment its own weights, the output layer in one
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=True)
            return checkpoint(lambda t: self.out(t.to(self.out.weight.dtype)), h, use_reentrant=True).float()
        elif self.nonreentrant:  # torch's non-reentrant checkpoint: recomputed inside the backward
            h = checkpoint(lambda t: torch.tanh(self.mid(t)), h, use_reentrant=False)
        else:
            h = torch.tanh(self.mid(h))
        if self.side is not None and not skip_mid:  # (never with reentrant checkpointing: cases.py)
            h = h + torch.tanh(self.side(h.double())).to(h.dtype)
        if self.tied:  # (never with reentrant checkpointing: cases.py)
            h = torch.tanh(self.mid2(h.to(self.mid2.weight.dtype)))
        if self.nonreentrant:  # the output layer in a segment of its own too
            # the dtype read once, outside the segment: under full sharding a unit's parameter
            # reads as its fp32 shard at rest and as the bf16 gathered copy inside its unit, so a
            # read inside the segment could differ between the forward and the recomputation
            # (torch refuses recomputed tensors of another dtype; FSDP2's parameters behave alike)
            dt = self.out.weight.dtype
            return checkpoint(lambda t: self.out(t.to(dt)), h, use_reentrant=False).float()
        return self.out(h.to(self.out.weight.dtype)).float()


def forward_kwargs(case: dict, i: int, rank: int = 0) -> dict:
    """What the loop passes the model's forward besides the inputs at micro-batch i of an epoch
    on `rank`: the middle layer left out (skip_mid) at every fsdp_skip-th (the same on every
    process, whose loaders are equally long), or under rank_skip at every rank_skip-th counted
    from an offset of the rank (cases.py)."""
    period = case.get("fsdp_skip", 0)
    if period:
        return {"skip_mid": True} if i % period == period - 1 else {}
    period = case.get("rank_skip", 0)
    return {"skip_mid": True} if period and (i + rank) % period == period - 1 else {}


AUX_WEIGHT = 0.1


def aux_loss(case: dict, out_layer, x):
    """fsdp_aux: an extra loss term, the output layer called directly (outside the model's
    forward) on the inputs repeated to the hidden width; the caller provides the autocast."""
    z = torch.cat([x, x], dim=1).to(out_layer.weight.dtype if case["mp"] == "no" else x.dtype)
    return AUX_WEIGHT * out_layer(z).float().pow(2).mean()


def models(case: dict):
    return [Net(case, salt) for salt in range(2 if case["two_models"] else 1)]


def dataset(case: dict, n: int | None = None, salt: int = 1):
    """Samples (x, y) for training; n defaults to batches x batch_size x world plus a ragged end."""
    g = torch.Generator().manual_seed(case["seed"] * 13 + salt)
    if n is None:
        n = case["batches"] * case["batch_size"] * case["world"] + case["dataset_extra"]
    x = torch.randn(n, IN, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def eval_dataset(case: dict):
    return dataset(case, n=case["batch_size"] * case["world"] * 2 + 1 + case["dataset_extra"], salt=2)


def loader(ds, case: dict):
    return torch.utils.data.DataLoader(ds, batch_size=case["batch_size"], shuffle=False)


def deepspeed_16bit(case: dict) -> bool:
    """ZeRO under bf16/fp16: DeepSpeed's policy (a 16-bit model, fp32 masters), not autocast."""
    return case.get("sharding", "none") not in ("none", "fsdp") and case["mp"] != "no"


def fsdp_16bit(case: dict) -> bool:
    """FSDP under bf16 or fp16: FSDP2's policy as accelerate sets it (MixedPrecisionPolicy with
    param_dtype = reduce_dtype = the 16-bit dtype: fp32 sharded masters, 16-bit gathers and
    compute under autocast, the gradients reduced in 16 bits into fp32 gradient shards; fp16
    with ShardedGradScaler's loss scaling), reference_fsdp.py."""
    return case.get("sharding") == "fsdp" and case["mp"] != "no"


# the fp16 section of a ZeRO case's DeepSpeed config: DeepSpeed's defaults but the initial scale
# (at 2**16 this model's scaled gradients overflow on their own now and then, and whether an
# element at fp16's limit does depends on the order three ranks' gradients are summed in)
DEEPSPEED_FP16 = {"initial_scale_power": 8, "loss_scale_window": 1000, "min_loss_scale": 1, "hysteresis": 2,
                  "consecutive_hysteresis": False}


def deepspeed_fp16(case: dict) -> dict:
    """The case's fp16 section: DEEPSPEED_FP16 with the case's loss_scale_window (`ds_window`: a
    short one grows the scale within the case, where DeepSpeed unscales by the grown scale)."""
    return {**DEEPSPEED_FP16, "loss_scale_window": case.get("ds_window", DEEPSPEED_FP16["loss_scale_window"])}


def inputs(case: dict, x):
    """What the loop feeds the model: under DeepSpeed's bf16 a DeepSpeed user casts the inputs
    (its engine does not; under fp16 its auto_cast does, so they stay fp32)."""
    return x.to(torch.bfloat16) if deepspeed_16bit(case) and case["mp"] == "bf16" else x


def optimizers(case: dict, params) -> list:
    """One optimizer over every parameter, or (two_optimizers) one over the first half and one
    over the rest: each then covers part of a flat buffer."""
    if not case["two_optimizers"]:
        return [_optimizer(case, params)]
    half = len(params) // 2
    return [_optimizer(case, params[:half]), _optimizer(case, params[half:])]


def _optimizer(case: dict, params):
    kind = case["optimizer"]
    # foreach: torch's multi-tensor implementation (grouped by device and dtype), else torch's
    # default for CPU tensors (the per-parameter loop)
    foreach = True if case.get("foreach", False) else None
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.2, foreach=foreach)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
    adam = case.get("adam_kind", "adamw")  # (cases.py, ADAM_KINDS)
    if adam == "adam_l2":
        return torch.optim.Adam(params, lr=0.01, weight_decay=0.01, foreach=foreach)
    if adam == "adamw_maximize":
        return torch.optim.AdamW(params, lr=0.01, betas=(0.3, 0.95), weight_decay=0.01, maximize=True,
                                 foreach=foreach)
    amsgrad = adam == "adamw_amsgrad"
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, amsgrad=amsgrad, foreach=foreach)


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.1 * s))


def loss_of(outs, y):
    return sum(torch.nn.functional.mse_loss(o, y) for o in outs)


def bucket_cap_mb(case: dict) -> float:
    return 0.0004 if case["tiny_buckets"] else 25.0  # 0.0004 MiB: a few hundred bytes a bucket


def clipped(case, params):
    """What the loop clips: every trainable parameter, or (clip_subset) the later half only, which
    covers part of a flat buffer and so takes the Accelerator's generic path."""
    return params[len(params) // 2:] if case["clip_subset"] else params


def torch_clip_norm(case, params) -> float:
    """The references' clip by norm: torch.nn.utils.clip_grad_norm_ over what the loop clips
    (twice under clip_twice, as the loop calls it); the norm it reports."""
    norm_type = 2.0 if case["clip"] == "norm2" else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, case["max_norm"], norm_type=norm_type)
    if case["clip_twice"]:
        norm = torch.nn.utils.clip_grad_norm_(params, case["max_norm"], norm_type=norm_type)
    return float(norm)


def _first_with_grad(params, reverse=False):
    seq = reversed(params) if reverse else params
    return next(p for p in seq if p.grad is not None)


def touch_grads(case, params, step: int):
    """What the loop does to the gradients between backward and the step: a NaN in the last
    one at step `nan_grad_step`, (assign_grad) the first one replaced by a new tensor, and
    (grad_data) the last one halved through `.data`."""
    if case["nan_grad_step"] == step:
        with torch.no_grad():
            _first_with_grad(params, reverse=True).grad.view(-1)[0] = float("nan")
    if case["assign_grad"]:
        p = _first_with_grad(params)
        p.grad = p.grad.detach().clone() * 0.5
    if case.get("grad_data", False):  # through .data, whose version counter is its own
        _first_with_grad(params, reverse=True).grad.data.mul_(0.5)


def zero_grads(case, opts, models, params, engine: bool = False):
    """The loop's zero_grad call, in the style the case asks for. "never" (drawn under DeepSpeed
    only): the loop calls none, and DeepSpeed's engine clears the gradients after its step, which
    a reference (engine=True) does in its place."""
    style = case["zero_grad"]
    if style == "never":
        if engine:
            for p in params:
                p.grad = None
    elif style == "opt_none":
        for opt in opts:
            opt.zero_grad()
    elif style == "opt_zeros":
        for opt in opts:
            opt.zero_grad(set_to_none=False)
    elif style == "model":
        for m in models:
            m.zero_grad()
    else:
        for p in params:
            p.grad = None
