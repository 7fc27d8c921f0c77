"""AcceleratedOptimizer.zero_grad runs the wrapped optimizer's own zero_grad, as accelerate 1.15's
does: the same calls (and set_to_none values) reach it, and the gradients and parameters it
leaves are accelerate's, step after step, whatever that zero_grad does to the gradients."""
from __future__ import annotations

import pytest
import torch

from accelerate_c import Accelerator
from helpers import fresh_state, loss_function, make_loader, make_model  # noqa: F401


class RecordingSGD(torch.optim.SGD):
    """torch's zero_grad, with a log of the calls."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = []

    def zero_grad(self, set_to_none: bool = True):
        self.calls.append(set_to_none)
        super().zero_grad(set_to_none=set_to_none)


class DecayingSGD(torch.optim.SGD):
    """A zero_grad without set_to_none that keeps half of each gradient (what a user's
    gradient-smoothing trick might do): the next backward must accumulate onto it."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.calls = []

    def zero_grad(self):
        self.calls.append("decay")
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(0.5)


def _train(acc, opt_cls, zero_kwargs, model_grad_none=False):
    """Five batches, accumulation 2 (the last window ends with the loader): after every
    zero_grad, the log of calls, every .grad (None or its values); at the end, the params."""
    model = make_model(0)
    opt = opt_cls(model.parameters(), lr=0.1, momentum=0.9)
    model, popt, dl = acc.prepare(model, opt, make_loader(n=20, batch_size=4))
    records = []
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(loss_function(model(x), y))
            popt.step()
            popt.zero_grad(**zero_kwargs)
        records.append((list(opt.calls),
                        [None if p.grad is None else p.grad.clone() for p in model.parameters()]))
    return records, [p.detach().clone() for p in model.parameters()]


def _reference(**kw):
    accelerate = pytest.importorskip("accelerate")
    return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2, **kw)


def _reset_reference():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _assert_same(ours, theirs):
    (o_rec, o_params), (t_rec, t_params) = ours, theirs
    assert len(o_rec) == len(t_rec)
    for i, ((o_calls, o_grads), (t_calls, t_grads)) in enumerate(zip(o_rec, t_rec)):
        assert o_calls == t_calls, f"batch {i}: zero_grad calls {o_calls} vs accelerate's {t_calls}"
        for j, (a, b) in enumerate(zip(o_grads, t_grads)):
            assert (a is None) == (b is None), f"batch {i}, param {j}: .grad {a} vs accelerate's {b}"
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(o_params, t_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("zero_kwargs", [{}, {"set_to_none": True}, {"set_to_none": False}])
def test_a_subclass_zero_grad_runs_as_with_accelerate(zero_kwargs):
    theirs = _train(_reference(), RecordingSGD, zero_kwargs)
    _reset_reference()
    ours = _train(Accelerator(cpu=True, gradient_accumulation_steps=2), RecordingSGD, zero_kwargs)
    assert ours[0][-1][0], "zero_grad never reached the optimizer"
    _assert_same(ours, theirs)


def test_a_zero_grad_that_keeps_gradients_is_obeyed():
    theirs = _train(_reference(), DecayingSGD, {})
    _reset_reference()
    ours = _train(Accelerator(cpu=True, gradient_accumulation_steps=2), DecayingSGD, {})
    _assert_same(ours, theirs)


def test_set_to_none_for_a_zero_grad_without_it_is_refused_as_by_accelerate():
    with pytest.raises(ValueError) as theirs:
        _train(_reference(), DecayingSGD, {"set_to_none": False})
    _reset_reference()
    with pytest.raises(ValueError, match="set_to_none") as ours:
        _train(Accelerator(cpu=True, gradient_accumulation_steps=2), DecayingSGD, {"set_to_none": False})
    assert "DecayingSGD" in str(ours.value), (str(ours.value), str(theirs.value))


def test_fp16_step_after_zero_grad_is_not_skipped_for_an_old_overflow():
    """fp16 loss scaling with the buffers: an overflowing step, then zero_grad, then a clean
    step trains like torch's GradScaler loop (skip, back off, then step)."""
    model = make_model(0)
    ref = make_model(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    opt = RecordingSGD(model.parameters(), lr=0.1)
    model, popt = acc.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(make_loader(n=4, batch_size=4)))
    for scale_loss in (float("inf"), 1.0):
        with torch.autocast("cpu", dtype=torch.float16):
            ref_out = ref(x)
        scaler.scale(loss_function(ref_out.float(), y) * scale_loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
        acc.backward(loss_function(model(x), y) * scale_loss)
        popt.step()
        popt.zero_grad()
    assert opt.calls == [True, True]
    assert acc.scaler.get_scale() == scaler.get_scale()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("custom", [False, True])
def test_fp16_step_with_no_new_gradient_after_zero_grad_to_zeros(custom):
    """fp16: a step overflows, torch's own zero_grad(set_to_none=False) leaves zeros, and the next
    step comes before any backward: GradScaler unscales the zeros, finds nothing and steps, so
    that step is not skipped for the old overflow (and the scale is not backed off twice). A
    subclass's zero_grad (here one that only calls torch's) must not be taken for torch's own
    without looking: the result is the same either way, since it too leaves zeros."""
    cls = RecordingSGD if custom else torch.optim.SGD
    model, ref = make_model(0), make_model(0)
    acc = Accelerator(cpu=True, mixed_precision="fp16")
    model, popt = acc.prepare(model, cls(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")
    x, y = next(iter(make_loader(n=4, batch_size=4)))
    with torch.autocast("cpu", dtype=torch.float16):
        ref_out = ref(x)
    scaler.scale(loss_function(ref_out.float(), y) * float("inf")).backward()
    scaler.step(ref_opt)
    scaler.update()
    ref_opt.zero_grad(set_to_none=False)
    acc.backward(loss_function(model(x), y) * float("inf"))
    popt.step()
    popt.zero_grad(set_to_none=False)
    before = scaler.get_scale()
    scaler.step(ref_opt)  # no backward since: zeros
    scaler.update()
    ref_skipped = scaler.get_scale() < before
    popt.step()
    assert popt.step_was_skipped == ref_skipped
    assert acc.scaler.get_scale() == scaler.get_scale()
