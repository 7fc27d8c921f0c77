"""clip_grad_norm_ on one CPU process without flat buffers (torch's clip, accelerate_c/clip_math.py
clip_grad_norm_as_torch): when torch's coefficient clamps to exactly 1 the scaling pass is
skipped (multiplying by 1.0 changes no bit); otherwise it is torch's. Every norm and gradient is
compared bit for bit with torch.nn.utils.clip_grad_norm_ on a copy holding the same gradients,
and the gradients' version counters show whether a pass wrote them."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator
from clip_models import HalfAndFull  # fp32 and bf16 parameters side by side (torch's clip groups them by dtype)
from helpers import fresh_state  # noqa: F401


@pytest.fixture(autouse=True)
def _auto_buffers(monkeypatch):
    monkeypatch.delenv("ACCELERATE_C_GRAD_BUFFERS", raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _setup(kind: str, seed: int = 0):
    """A prepared model with gradients from one backward, and a copy holding the same gradients."""
    torch.manual_seed(seed)
    model = {"fp32": lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)),
             "bf16": lambda: nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(torch.bfloat16),
             "mixed": HalfAndFull}[kind]()
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    accelerator = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert accelerator._grads.groups == []  # one process: autograd's own gradient tensors
    x = torch.randn(16, 8, dtype=dtype)
    accelerator.backward(model(x).float().pow(2).mean())
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = p.grad.clone()
    return accelerator, model, ref


def _check_same(model, ref, got_norm, want_norm):
    assert got_norm.dtype == want_norm.dtype and torch.equal(_bits(got_norm), _bits(want_norm))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(_bits(p.grad), _bits(q.grad)), name


@pytest.mark.parametrize("kind", ["fp32", "bf16", "mixed"])
@pytest.mark.parametrize("where", ["far_above", "far_below", "around"])
def test_same_bits_as_torch_and_no_pass_when_nothing_is_clipped(kind, where):
    accelerator, model, ref = _setup(kind)
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    # max_norm around the norm: both sides of where the coefficient clamps to 1 (a norm within
    # 1e-6 of max_norm rounds either way), in fp32 and in the norm's own dtype
    factors = {"far_above": [1e6], "far_below": [1e-3],
               "around": [1 + k * 2.0 ** -e for e in (8, 20, 23, 24) for k in (-3, -1, 0, 1, 3)]}[where]
    seen = set()
    for f in factors:
        accelerator, model, ref = _setup(kind)
        max_norm = norm * f + (1e-6 if where == "around" else 0.0)
        versions = [p.grad._version for p in model.parameters()]
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        got = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        _check_same(model, ref, got, want)
        coef = float(torch.clamp(max_norm / (want + 1e-6), max=1.0))
        wrote = [p.grad._version != v for p, v in zip(model.parameters(), versions)]
        # the pass runs exactly when torch's coefficient is not 1
        assert all(wrote) if coef != 1.0 else not any(wrote), (f, coef)
        seen.add(coef == 1.0)
        if where == "far_above":
            assert coef == 1.0
        if where == "far_below":
            assert coef < 1.0
    if where == "around":
        assert seen == {True, False}  # both sides of the clamp were reached


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("max_norm", [1e-3, 1e30])
def test_non_finite_gradients_as_torch(bad, max_norm):
    """A NaN or infinite gradient: torch multiplies by a NaN (NaN norm) or 0 (inf norm): never
    skipped, whatever max_norm."""
    accelerator, model, ref = _setup("fp32")
    for m in (model, ref):
        next(m.parameters()).grad[0, 0] = bad
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    got = accelerator.clip_grad_norm_(model.parameters(), max_norm)
    _check_same(model, ref, got, want)


@pytest.mark.parametrize("norm_type", [1.0, 3.0, float("inf")])
def test_other_norms_as_torch(norm_type):
    for max_norm in (1e-3, 1e6):
        accelerator, model, ref = _setup("fp32", seed=3)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type=norm_type)
        got = accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
        _check_same(model, ref, got, want)


def test_parameters_without_gradients_and_a_generator():
    accelerator, model, ref = _setup("fp32")
    for m in (model, ref):
        m[0].bias.grad = None
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e6)
    got = accelerator.clip_grad_norm_((p for p in model.parameters()), 1e6)
    _check_same(model, ref, got, want)
    assert model[0].bias.grad is None
    for m in (model, ref):
        for p in m.parameters():
            p.grad = None
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1.0)
    got = accelerator.clip_grad_norm_(list(model.parameters()), 1.0)
    assert torch.equal(got, want)
