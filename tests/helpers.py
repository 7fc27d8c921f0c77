"""Shared helpers for the Accelerator-level tests (loop, API, gradient buffers, data loaders).

Every behaviour of accelerate_c is compared against a plain-PyTorch reference computed in the
same test with the same seed and data; nothing here computes an expected value with
accelerate_c itself.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accelerate_c.state import AcceleratorState, GradientState

# Tolerances. Parameters are fp32 in every mode (autocast only lowers the forward's compute),
# and gradient accumulation into the flat buffers adds the same values in the same order as
# torch, so most comparisons are exact in practice. The Accelerator's fused clip computes the
# global norm in double (torch: per-tensor fp32 norms, then the norm of those), so the clip
# coefficient may differ in the last bit: params after a few steps agree to ~1e-7 relative.
FP32_RTOL, FP32_ATOL = 1e-6, 1e-7  # "no": 1e-6 relative
AMP_RTOL, AMP_ATOL = 1e-5, 1e-6  # bf16/fp16: looser on paper; ~1e-6 in practice
NORM_RTOL = 1e-6  # clip_grad_norm_ return value vs torch's

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

IN_DIM, HID, OUT_DIM = 8, 16, 4


def reset_all_states():
    AcceleratorState._reset_state()
    GradientState._reset_state()


def _reset_accelerate_reference():
    """Resets the upstream accelerate package's singletons, if it was imported."""
    import sys

    if "accelerate.state" in sys.modules:
        st = sys.modules["accelerate.state"]
        st.AcceleratorState._reset_state(True)
        st.GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_state():
    """Every test starts and ends with fresh Accelerator/Gradient states and the original
    environment variables."""
    env = dict(os.environ)
    reset_all_states()
    _reset_accelerate_reference()
    yield
    reset_all_states()
    _reset_accelerate_reference()
    os.environ.clear()
    os.environ.update(env)


class MLP(nn.Module):
    """Linear-ReLU-Linear."""

    def __init__(self, in_dim=IN_DIM, hid=HID, out_dim=OUT_DIM):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hid)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hid, out_dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def make_model(seed=0, cls=MLP, **kw):
    torch.manual_seed(seed)
    return cls(**kw)


def make_dataset(n=32, seed=1, in_dim=IN_DIM, out_dim=OUT_DIM):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_dim, generator=g)
    y = torch.randn(n, out_dim, generator=g)
    return TensorDataset(x, y)


def make_loader(n=32, batch_size=4, seed=1, **kw):
    kw.setdefault("shuffle", False)
    return DataLoader(make_dataset(n, seed), batch_size=batch_size, **kw)


def make_optimizer(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    raise ValueError(name)


def make_scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def clone_setup(model):
    """An independent deep copy of a model (same initial parameters)."""
    return copy.deepcopy(model)


def loss_function(outputs, targets):
    return nn.functional.mse_loss(outputs, targets)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_params_close(got_model, ref_model, rtol=FP32_RTOL, atol=FP32_ATOL, msg=""):
    got = dict(got_model.named_parameters())
    ref = dict(ref_model.named_parameters())
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name].detach(), ref[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=name: f"{msg} param {n}: {m}")


def assert_rel(got, ref, rtol=NORM_RTOL, msg=""):
    got, ref = float(got), float(ref)
    assert abs(got - ref) <= rtol * max(abs(ref), 1e-30), f"{msg}: got {got!r}, torch {ref!r} (rtol {rtol})"


def tols(mixed_precision):
    return (FP32_RTOL, FP32_ATOL) if mixed_precision == "no" else (AMP_RTOL, AMP_ATOL)


def torch_forward(model, inputs, mixed_precision):
    """The forward as a hand-written torch AMP loop does it: autocast, fp32 outputs."""
    if mixed_precision == "no":
        return model(inputs)
    with torch.autocast("cpu", dtype=AMP_DTYPES[mixed_precision]):
        out = model(inputs)
    return out.float()


def torch_reference_train(model, optimizer, scheduler, batches, mixed_precision="no", accum=1, max_norm=None,
                          norm_type=2.0, scaler_kwargs=None, loss_hook=None, reset="optimizer"):
    """A hand-written torch training loop with accelerate's accumulation semantics: each loss
    is divided by `accum`; the optimizer steps (and the scheduler with it) at every accum-th
    batch and at the last batch; gradients are clipped right before a step; under fp16 a
    torch.amp.GradScaler scales the loss, is unscaled before clipping and skips overflow steps
    (the scheduler does not step then).

    Returns a list of per-step records: dict(norm=..., skipped=..., scale=...)."""
    scaler = torch.amp.GradScaler("cpu", **(scaler_kwargs or {})) if mixed_precision == "fp16" else None
    records = []
    n = len(batches)
    for i, (inputs, targets) in enumerate(batches):
        outputs = torch_forward(model, inputs, mixed_precision)
        loss = loss_function(outputs, targets)
        if loss_hook is not None:
            loss = loss_hook(i, loss)
        loss = loss / accum
        if scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        sync = (i + 1) % accum == 0 or i == n - 1
        if not sync:
            continue
        rec = {"batch": i}
        if scaler is not None:
            scaler.unscale_(optimizer)
        if max_norm is not None:
            rec["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        if scaler is not None:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            rec["skipped"] = scaler.get_scale() < before
            rec["scale"] = scaler.get_scale()
        else:
            optimizer.step()
            rec["skipped"] = False
        if scheduler is not None and not rec["skipped"]:
            scheduler.step()
        if reset == "optimizer":
            optimizer.zero_grad()
        elif reset is not None:
            reset()
        records.append(rec)
    if scaler is not None:
        records.append({"scaler_state": scaler.state_dict()})
    return records


def batches_of(loader):
    return [tuple(t.clone() for t in b) for b in loader]
