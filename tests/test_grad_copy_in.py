"""The gradient hooks' copy-in in C (csrc/python/reducer_py.c, fast_copy_in).

After zero_grad(set_to_none=True), backward hands every parameter a new gradient tensor; the
hook copies it into the parameter's range of the flat buffer and points `.grad` there. For a plain
contiguous CPU tensor of the buffer's dtype that copy is made in C (measured for clip on the way);
everything else goes to GradLayout._copy_in in Python. These tests check that the C path is the one
a real loop takes, that what it leaves behind is what torch leaves (the gradients bit for bit
against a plain torch model's, the version counter moved as torch's copy_ moves it, the clip norm
against torch.nn.utils.clip_grad_norm_), and that the cases it must not handle still reach Python.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator
from accelerate_c.grad_layout import GradLayout
from helpers import fresh_state  # noqa: F401


@pytest.fixture(autouse=True)
def _flat_buffers(monkeypatch):
    """These tests are about the flat buffers, which one CPU process leaves out by default
    (accelerate_c/loose_grads.py; tests/test_loose_grads.py tests that path)."""
    monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "flat")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(24, 300)  # 7,200 + 300 elements
        self.b = nn.Linear(300, 300)  # 90,000: above the size where the copy runs without the GIL
        self.c = nn.Linear(300, 5)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def _prepared_beside_a_copy():
    """(torch's model, the same weights prepared on one CPU process, its Accelerator)."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    accelerator = Accelerator(cpu=True)
    return ref, accelerator.prepare(model), accelerator


@pytest.fixture
def slow_calls(monkeypatch):
    """Counts the Python copy-ins (the reducer binds GradLayout._copy_in when a buffer is built,
    so the patch must precede prepare())."""
    calls = []
    real = GradLayout._copy_in

    def counting(self, i, p):
        calls.append(i)
        return real(self, i, p)

    monkeypatch.setattr(GradLayout, "_copy_in", counting)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_real_loop_copies_in_c_and_matches_torch(fresh_state, slow_calls, dtype):  # noqa: F811
    torch.manual_seed(0)
    ref = Net().to(dtype)
    model = copy.deepcopy(ref)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    (group,) = accelerator._grads.groups
    params, ref_params = list(model.parameters()), list(ref.parameters())
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        x = torch.randn(16, 24, generator=gen).to(dtype)
        for p, q in zip(params, ref_params):
            p.grad = q.grad = None
        before = group.flat._version
        accelerator.backward(model(x).float().square().mean())
        ref(x).float().square().mean().backward()
        for i, (p, q, v) in enumerate(zip(params, ref_params, group.views)):
            assert p.grad is v, f"step {step}: .grad of parameter {i} is not its view of the buffer"
            assert torch.equal(p.grad, q.grad), f"step {step}: gradient {i} differs from torch's"
        # torch's copy_ bumps the (shared) version once per gradient; so must the C copy
        assert group.flat._version == before + len(params)
        max_norm = 0.5
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        assert math.isclose(float(norm), float(ref_norm), rel_tol=tol), (float(norm), float(ref_norm))
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=tol, atol=0)
    assert slow_calls == [], f"the Python copy-in ran for gradients {sorted(set(slow_calls))}"


def test_the_hooks_measure_in_the_copy_what_a_read_pass_measures(fresh_state, slow_calls):  # noqa: F811
    """From the second backward on (the first clip asks for 2-norms) the C copy measures each
    gradient as it writes it: Reducer.sums equals a read pass of the buffer, bit for bit (the same
    chunks), and an fp64 sum within 1e-6; the clip then reads no buffer."""
    from accelerate_c import _C

    torch.manual_seed(0)
    model = Net()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    (group,) = accelerator._grads.groups
    x = torch.randn(16, 24)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        accelerator.backward(model(x).square().mean())
        got = group.reducer.sums(group.flat._version)
        if got is not None:
            # the hooks sum each range on its own (parameter order); the read pass sums the
            # whole buffer in its own chunks, so agreement is to rounding, not to the bit
            whole, nf = _C.sumsq(group.buf)
            exact = float(group.flat.double().pow(2).sum())
            assert got[2] == nf is False and got[1] == got[0]  # fp32: no per-gradient rounding
            assert abs(got[0] - exact) <= 1e-6 * exact and abs(whole - exact) <= 1e-6 * exact
            per = [_C.sumsq(v.detach().reshape(-1))[0] for v in group.views]
            assert math.fsum(per) == pytest.approx(got[0], rel=1e-12)
        accelerator.clip_grad_norm_(model.parameters(), 1e9)
    assert got is not None, "the hooks did not measure the copied gradients"
    assert slow_calls == []


def test_gradients_the_c_copy_must_not_take_reach_python(fresh_state, slow_calls):  # noqa: F811
    """A gradient with a graph (backward(create_graph=True)) stays as it is until the step, and a
    parameter cast after prepare() rebuilds the buffer: both are the Python path's, and the
    results are still torch's."""
    ref, model, accelerator = _prepared_beside_a_copy()
    x = torch.randn(8, 24)
    accelerator.backward(model(x).square().mean(), create_graph=True)
    ref(x).square().mean().backward(create_graph=True)
    assert len(slow_calls) == len(list(model.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad.requires_grad
        assert torch.equal(p.grad.detach(), q.grad.detach())
    del slow_calls[:]
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    model.double()
    ref.double()
    accelerator.backward(model(x.double()).square().mean())
    ref(x.double()).square().mean().backward()
    assert slow_calls, "a parameter cast after prepare() did not reach the Python copy-in"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_gradient_with_the_negative_bit_is_copied_as_it_reads(fresh_state, slow_calls):  # noqa: F811
    """A `.grad` assigned as a lazily negated view keeps its bit when backward accumulates into
    it: its memory holds the negated values, so a raw copy would flip the sign (copy_ resolves
    the bit). The gradient must equal torch's."""
    ref, model, accelerator = _prepared_beside_a_copy()
    x = torch.randn(8, 24)
    for m in (model, ref):
        for p in m.parameters():
            p.grad = torch._neg_view(torch.ones_like(p))
    accelerator.backward(model(x).square().mean())
    ref(x).square().mean().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_parameter_cast_after_prepare_keeps_its_gradient_dtype_check(fresh_state, slow_calls):  # noqa: F811
    """torch's grad_dtype lets a bf16 parameter take fp32 gradients: the gradient then matches
    the buffer's dtype while the parameter no longer does; the buffer must still be rebuilt for
    the parameter (the Python path), not fed behind its back."""
    if not hasattr(torch.nn.Parameter(torch.zeros(1)), "grad_dtype"):
        pytest.skip("this torch has no Parameter.grad_dtype")
    torch.manual_seed(0)
    model = Net()
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    (group,) = accelerator._grads.groups
    p = model.a.weight
    with torch.no_grad():
        p.data = p.data.bfloat16()
    p.grad_dtype = torch.float32
    model.a.weight = p
    x = torch.randn(8, 24)
    out = torch.nn.functional.linear(x, p.float(), model.a.bias)
    accelerator.backward(model.c(torch.tanh(model.b(torch.relu(out)))).square().mean())
    assert group.broken, "a parameter cast after prepare() was fed by the C copy-in"


def test_the_version_bump_works_with_a_torch_that_takes_only_one_tensor(monkeypatch):
    """torch before 2.5 refuses a tuple in _increment_version (pyproject allows torch >= 2.4): the
    bump the C hooks call with (view,) must then pass the tensor alone, and move its version by
    exactly one, as torch's copy_ does."""
    from accelerate_c import grad_layout

    real = torch._C._increment_version

    def one_tensor_only(t):
        if not isinstance(t, torch.Tensor):
            raise TypeError("increment_version expect a Tensor as input")
        real((t,))

    monkeypatch.setattr(torch._C, "_increment_version", one_tensor_only)
    bump = grad_layout._version_bump()
    t = torch.zeros(3)
    before = t._version
    bump((t,))
    assert t._version == before + 1
    monkeypatch.setattr(torch._C, "_increment_version", real)
    t2 = torch.zeros(3)
    grad_layout._version_bump()((t2,))
    assert t2._version == 1
