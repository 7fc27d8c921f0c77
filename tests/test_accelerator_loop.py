"""Training loops through accelerate_c.Accelerator vs hand-written torch loops (and, for step
counting, accelerate 1.15 itself), on CPU.

Tolerances (see helpers.py): mixed_precision "no" -> 1e-6 relative (atol 1e-7);
bf16/fp16 -> 1e-5 relative (atol 1e-6) on paper, since parameters stay fp32 under autocast the
observed difference is ~1e-7 or exactly zero. clip_grad_norm_'s return value: 1e-6 relative.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from accelerate_c import Accelerator, GradScalerKwargs
from helpers import (  # noqa: F401  (fresh_state is an autouse fixture)
    NORM_RTOL,
    assert_params_close,
    assert_rel,
    batches_of,
    fresh_state,
    loss_function,
    make_loader,
    make_model,
    make_optimizer,
    make_scheduler,
    tols,
    torch_reference_train,
)

pytestmark = pytest.mark.filterwarnings(r"ignore:Seems like `optimizer.step\(\)` has been overridden")

MIXED = ["no", "bf16", "fp16"]
OPTIMS = ["sgd", "adamw"]


# --------------------------------------------------------------------------------------------
# 1. the tutorial loops
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("mixed_precision", MIXED)
def test_tutorial_loop_matches_torch(mixed_precision, optim):
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer(optim, ref_model.parameters())
    ref_sched = make_scheduler(ref_opt)
    ref_records = torch_reference_train(ref_model, ref_opt, ref_sched, batches_of(make_loader(n=32, batch_size=4)),
                                        mixed_precision=mixed_precision)

    accelerator = Accelerator(mixed_precision=mixed_precision)
    optimizer = make_optimizer(optim, model.parameters())
    scheduler = make_scheduler(optimizer)
    training_dataloader = make_loader(n=32, batch_size=4)

    # --- verbatim from accelerate's docs, except the import ---
    model, optimizer, training_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, scheduler
    )
    for batch in training_dataloader:
        optimizer.zero_grad()
        inputs, targets = batch
        outputs = model(inputs)
        loss = loss_function(outputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
    # ----------------------------------------------------------

    rtol, atol = tols(mixed_precision)
    assert_params_close(model, ref_model, rtol=rtol, atol=atol, msg=f"{mixed_precision}/{optim}")
    assert scheduler.last_epoch == ref_sched.last_epoch == 8
    assert scheduler.get_last_lr() == ref_sched.get_last_lr()
    if mixed_precision == "fp16":
        assert accelerator.scaler.get_scale() == ref_records[-1]["scaler_state"]["scale"]


def _accumulate_loop(accelerator, model, optimizer, scheduler, loader, max_norm, loss_hook=None, log=None):
    norms = []
    for i, batch in enumerate(loader):
        with accelerator.accumulate(model):
            inputs, targets = batch
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            if loss_hook is not None:
                loss = loss_hook(i, loss)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm))
            before = [p.detach().clone() for p in model.parameters()]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if log is not None:
                log.append(dict(batch=i, sync=accelerator.sync_gradients,
                                skipped=accelerator.optimizer_step_was_skipped,
                                changed=any(not torch.equal(b, p) for b, p in zip(before, model.parameters())),
                                scale=accelerator.scaler.get_scale() if accelerator.scaler is not None else None))
    return norms


@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("mixed_precision", MIXED)
def test_accumulate_loop_with_clipping_matches_torch(mixed_precision, optim):
    max_norm = 0.3
    n, bs, accum = 36, 4, 2  # 9 batches: steps after batches 2, 4, 6, 8 and 9 (the last, partial window)
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer(optim, ref_model.parameters())
    ref_sched = make_scheduler(ref_opt)
    ref = torch_reference_train(ref_model, ref_opt, ref_sched, batches_of(make_loader(n=n, batch_size=bs)),
                                mixed_precision=mixed_precision, accum=accum, max_norm=max_norm)
    ref_steps = [r for r in ref if "batch" in r]
    assert [r["batch"] for r in ref_steps] == [1, 3, 5, 7, 8]

    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=accum)
    optimizer = make_optimizer(optim, model.parameters())
    scheduler = make_scheduler(optimizer)
    loader = make_loader(n=n, batch_size=bs)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    norms = _accumulate_loop(accelerator, model, optimizer, scheduler, loader, max_norm)

    rtol, atol = tols(mixed_precision)
    assert_params_close(model, ref_model, rtol=rtol, atol=atol, msg=f"{mixed_precision}/{optim}")
    assert len(norms) == len(ref_steps)
    for k, (got, r) in enumerate(zip(norms, ref_steps)):
        assert_rel(got, r["norm"], NORM_RTOL, msg=f"clip_grad_norm_ return at step {k}")
    assert any(float(r["norm"]) > max_norm for r in ref_steps), "the test should actually clip"
    assert scheduler.last_epoch == ref_sched.last_epoch == 5
    assert scheduler.get_last_lr() == ref_sched.get_last_lr()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clip_returned_norm_fp16_is_unscaled(norm_type):
    """Under fp16 the norm returned by clip_grad_norm_ is the one of the unscaled gradients."""
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer("sgd", ref_model.parameters())
    ref = torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=16, batch_size=4)),
                                mixed_precision="fp16", max_norm=0.5, norm_type=norm_type)
    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = make_optimizer("sgd", model.parameters())
    loader = make_loader(n=16, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for inputs, targets in loader:
        accelerator.backward(loss_function(model(inputs), targets))
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type))
        optimizer.step()
        optimizer.zero_grad()
    for got, r in zip(norms, [r for r in ref if "batch" in r]):
        assert_rel(got, r["norm"], NORM_RTOL, msg=f"norm_type={norm_type}")
    assert_params_close(model, ref_model, *tols("fp16"))


# --------------------------------------------------------------------------------------------
# 2. fp16 overflow and the loss scaler
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", OPTIMS)
@pytest.mark.parametrize("accum", [1, 2])
def test_fp16_overflow_step_is_skipped_like_gradscaler(optim, accum):
    bad = 5 if accum == 1 else 4  # accum 2: the window (4, 5) overflows -> 3rd optimizer step skipped
    skip_at = 5  # the batch whose optimizer.step() is the skipped one

    def hook(i, loss):
        return loss * 1e30 if i == bad else loss

    n, bs, max_norm = 32, 4, 1.0
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer(optim, ref_model.parameters())
    ref_sched = make_scheduler(ref_opt)
    ref = torch_reference_train(ref_model, ref_opt, ref_sched, batches_of(make_loader(n=n, batch_size=bs)),
                                mixed_precision="fp16", accum=accum, max_norm=max_norm, loss_hook=hook)
    ref_steps = [r for r in ref if "batch" in r]
    assert sum(r["skipped"] for r in ref_steps) == 1, "the reference should skip exactly one step"

    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=accum)
    assert accelerator.scaler.get_scale() == 65536.0
    optimizer = make_optimizer(optim, model.parameters())
    scheduler = make_scheduler(optimizer)
    loader = make_loader(n=n, batch_size=bs)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    log = []
    norms = _accumulate_loop(accelerator, model, optimizer, scheduler, loader, max_norm, loss_hook=hook, log=log)

    steps = [e for e in log if e["sync"]]
    assert len(steps) == len(ref_steps)
    prev_scale = 65536.0
    for e, r in zip(steps, ref_steps):
        assert e["skipped"] == r["skipped"], f"batch {e['batch']}"
        if r["skipped"]:
            assert e["batch"] == skip_at
            assert not e["changed"], "params changed on the overflow step"
            assert e["scale"] == prev_scale / 2
        else:
            assert e["changed"]
        assert e["scale"] == r["scale"], f"scale after batch {e['batch']}"
        prev_scale = e["scale"]
    for got, r in zip(norms, ref_steps):
        if r["skipped"]:
            assert not math.isfinite(float(got)) and not math.isfinite(float(r["norm"]))
        else:
            assert_rel(got, r["norm"], NORM_RTOL)
    # As in accelerate, optimizer_step_was_skipped tells whether the *last real* step was
    # skipped: True from the overflow step until the next synchronising step, False otherwise.
    expected = [skip_at <= e["batch"] < skip_at + accum for e in log]
    assert [e["skipped"] for e in log] == expected
    assert_params_close(model, ref_model, *tols("fp16"))
    assert scheduler.last_epoch == ref_sched.last_epoch == len(ref_steps) - 1
    assert accelerator.scaler.state_dict() == ref[-1]["scaler_state"]


def _plain_fp16_run(scaler_kwargs, n_batches, bad=None):
    def hook(i, loss):
        return loss * 1e30 if i == bad else loss

    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer("sgd", ref_model.parameters())
    ref = torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=4 * n_batches, batch_size=4)),
                                mixed_precision="fp16", scaler_kwargs=scaler_kwargs, loss_hook=hook)
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(**scaler_kwargs)])
    optimizer = make_optimizer("sgd", model.parameters())
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scales = []
    for i, (inputs, targets) in enumerate(loader):
        optimizer.zero_grad()
        loss = loss_function(model(inputs), targets)
        accelerator.backward(hook(i, loss))
        optimizer.step()
        scales.append(accelerator.scaler.get_scale())
    return accelerator, model, ref_model, scales, ref


def test_gradscaler_kwargs_growth_interval_honoured():
    kw = dict(init_scale=2.0 ** 10, growth_interval=2, growth_factor=4.0)
    accelerator, model, ref_model, scales, ref = _plain_fp16_run(kw, 6)
    ref_scales = [r["scale"] for r in ref if "scale" in r]
    assert ref_scales == [2.0 ** 10, 2.0 ** 12, 2.0 ** 12, 2.0 ** 14, 2.0 ** 14, 2.0 ** 16]
    assert scales == ref_scales
    assert accelerator.scaler.state_dict() == ref[-1]["scaler_state"]
    assert_params_close(model, ref_model, *tols("fp16"))


def test_gradscaler_kwargs_with_overflow_and_backoff():
    kw = dict(init_scale=2.0 ** 12, growth_interval=2, backoff_factor=0.25)
    accelerator, model, ref_model, scales, ref = _plain_fp16_run(kw, 7, bad=3)
    ref_scales = [r["scale"] for r in ref if "scale" in r]
    assert ref_scales[3] == ref_scales[2] / 4
    assert scales == ref_scales
    state = accelerator.scaler.state_dict()
    ref_state = ref[-1]["scaler_state"]
    assert sorted(state) == sorted(ref_state)
    assert state == ref_state
    assert_params_close(model, ref_model, *tols("fp16"))


# --------------------------------------------------------------------------------------------
# 3. optimizer / scheduler step counts under accumulation (vs torch and accelerate 1.15)
# --------------------------------------------------------------------------------------------
class CountingStepLR(torch.optim.lr_scheduler.StepLR):
    def __init__(self, *a, **k):
        self.calls = 0
        super().__init__(*a, **k)

    def step(self, *a, **k):
        self.calls += 1
        return super().step(*a, **k)


def _count_run(accelerator_cls, accum, step_with_opt, n_batches=8):
    model = make_model(0)
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = CountingStepLR(inner_opt, step_size=1, gamma=0.9)
    init_calls = sched.calls  # the constructor's own step
    opt_calls = []
    orig_step = inner_opt.step

    def counting_step(*a, **k):
        opt_calls.append(1)
        return orig_step(*a, **k)

    inner_opt.step = counting_step
    acc = accelerator_cls(gradient_accumulation_steps=accum, step_scheduler_with_optimizer=step_with_opt)
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, optimizer, loader, scheduler = acc.prepare(model, inner_opt, loader, sched)
    for inputs, targets in loader:
        with acc.accumulate(model):
            acc.backward(loss_function(model(inputs), targets))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    p0 = next(iter(model.parameters()))
    return dict(opt_calls=len(opt_calls), sched_calls=sched.calls - init_calls, last_epoch=sched.last_epoch,
                step_count=sched._step_count, adam_step=float(inner_opt.state[p0]["step"]),
                lr=sched.get_last_lr(), params=[p.detach().clone() for p in model.parameters()])


def _accelerate_reference():
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState as A
    from accelerate.state import GradientState as G

    A._reset_state(True)
    G._reset_state()

    def make(**kw):
        return accelerate.Accelerator(cpu=True, mixed_precision="no", **kw)

    return make


@pytest.mark.parametrize("step_with_opt", [True, False])
@pytest.mark.parametrize("accum", [1, 2])
def test_step_counts_match_accelerate(accum, step_with_opt):
    ours = _count_run(Accelerator, accum, step_with_opt)
    ref_make = _accelerate_reference()
    theirs = _count_run(ref_make, accum, step_with_opt)
    expected_opt = 8 // accum
    assert ours["opt_calls"] == theirs["opt_calls"] == expected_opt
    assert ours["adam_step"] == theirs["adam_step"] == expected_opt
    expected_sched = expected_opt if step_with_opt else 8
    assert ours["sched_calls"] == theirs["sched_calls"] == expected_sched
    assert ours["last_epoch"] == theirs["last_epoch"] == expected_sched
    assert ours["lr"] == theirs["lr"]
    if accum == 1 or not step_with_opt:
        assert ours["step_count"] == theirs["step_count"]
    for a, b in zip(ours["params"], theirs["params"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)




def test_scheduler_step_count_not_inflated_by_accumulation():
    ours = _count_run(Accelerator, 2, True)
    ref_make = _accelerate_reference()
    theirs = _count_run(ref_make, 2, True)
    # torch: the constructor's step makes _step_count 1, then one per real step
    assert theirs["step_count"] == 1 + 4
    assert ours["step_count"] == theirs["step_count"]


def test_onecycle_lr_under_accumulation_matches_torch_and_accelerate():
    def run(accelerator_cls):
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=4)
        acc = accelerator_cls(gradient_accumulation_steps=2)
        loader = make_loader(n=32, batch_size=4)  # 8 batches -> 4 optimizer steps
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        lrs = []
        for inputs, targets in loader:
            with acc.accumulate(model):
                acc.backward(loss_function(model(inputs), targets))
                opt.step()
                sched.step()
                opt.zero_grad()
                if acc.sync_gradients:
                    lrs.append(sched.get_last_lr()[0])
        return lrs

    # plain torch: one scheduler step per optimizer step
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=4)
    torch_lrs = []
    for _ in range(4):
        opt.step()
        sched.step()
        torch_lrs.append(sched.get_last_lr()[0])
    theirs = run(_accelerate_reference())
    assert theirs == torch_lrs
    from accelerate_c.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()
    ours = run(Accelerator)
    assert ours == torch_lrs


def test_scheduler_not_stepped_on_fp16_overflow():
    accelerator = Accelerator(mixed_precision="fp16", gradient_accumulation_steps=2)
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = CountingStepLR(opt, step_size=1, gamma=0.9)
    init_calls = sched.calls
    loader = make_loader(n=32, batch_size=4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, opt, loader, sched)
    skipped = []
    for i, (inputs, targets) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = loss_function(model(inputs), targets)
            accelerator.backward(loss * 1e30 if i == 2 else loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            skipped.append(accelerator.optimizer_step_was_skipped)
    # True from the skipped step (batch 3) until the next real step (batch 5), as in accelerate
    assert skipped == [False, False, False, True, True, False, False, False]
    assert sched.calls - init_calls == 3
    assert sched.last_epoch == 3


# --------------------------------------------------------------------------------------------
# 4. clip_grad_norm_ / clip_grad_value_ vs torch
# --------------------------------------------------------------------------------------------
class Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 16)
        self.fc3 = torch.nn.Linear(16, 4)
        for p in self.fc2.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _one_backward(mixed_precision, frozen=False, scale_up=1.0):
    cls = Frozen if frozen else None
    model = make_model(0, cls=cls) if cls else make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(mixed_precision=mixed_precision)
    model = accelerator.prepare(model)
    inputs, targets = next(iter(make_loader(n=8, batch_size=8)))
    accelerator.backward(loss_function(model(inputs), targets) * scale_up)
    ref_loss = loss_function(ref_model(inputs), targets) * scale_up
    ref_loss.backward()
    return accelerator, model, ref_model


@pytest.mark.parametrize("frozen", [False, True], ids=["all-trainable", "with-frozen"])
@pytest.mark.parametrize("norm_type", [2, 2.0, math.inf, 1, 3.0])
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["clips", "no-clip"])
def test_clip_grad_norm_equals_torch(norm_type, frozen, max_norm):
    accelerator, model, ref_model = _one_backward("no", frozen=frozen)
    got = accelerator.clip_grad_norm_(model.parameters(), max_norm, norm_type=norm_type)
    ref = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm, norm_type=norm_type)
    assert torch.is_tensor(got)
    assert_rel(got, ref, NORM_RTOL, msg=f"norm_type={norm_type}")
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_clip_grad_norm_subset_of_parameters_equals_torch(norm_type):
    accelerator, model, ref_model = _one_backward("no")
    got = accelerator.clip_grad_norm_(model.fc2.parameters(), 0.01, norm_type=norm_type)
    ref = torch.nn.utils.clip_grad_norm_(ref_model.fc2.parameters(), 0.01, norm_type=norm_type)
    assert_rel(got, ref, NORM_RTOL)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)
    # the fc1 gradients were not touched
    assert float(ref) > 0.01


def test_clip_grad_norm_single_tensor_and_generator():
    accelerator, model, ref_model = _one_backward("no")
    got = accelerator.clip_grad_norm_(model.fc1.weight, 0.01)
    ref = torch.nn.utils.clip_grad_norm_(ref_model.fc1.weight, 0.01)
    assert_rel(got, ref)
    got2 = accelerator.clip_grad_norm_((p for p in model.parameters()), 0.02)
    ref2 = torch.nn.utils.clip_grad_norm_((p for p in ref_model.parameters()), 0.02)
    assert_rel(got2, ref2)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("frozen", [False, True])
def test_clip_grad_value_equals_torch(frozen):
    accelerator, model, ref_model = _one_backward("no", frozen=frozen)
    accelerator.clip_grad_value_(model.parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(ref_model.parameters(), 0.01)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        if q.grad is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, q.grad)
    assert any((q.grad.abs() == 0.01).any() for q in ref_model.parameters() if q.grad is not None)


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_clip_grad_norm_fp16_with_frozen_equals_torch_gradscaler(norm_type):
    model = make_model(0, cls=Frozen)
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.SGD([p for p in ref_model.parameters() if p.requires_grad], lr=0.1)
    ref = torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=12, batch_size=4)),
                                mixed_precision="fp16", max_norm=0.05, norm_type=norm_type)
    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    loader = make_loader(n=12, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    norms = []
    for inputs, targets in loader:
        accelerator.backward(loss_function(model(inputs), targets))
        norms.append(accelerator.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type))
        optimizer.step()
        optimizer.zero_grad()
    for got, r in zip(norms, [r for r in ref if "batch" in r]):
        assert_rel(got, r["norm"])
    assert_params_close(model, ref_model, *tols("fp16"))


def test_scaler_state_dict_types_and_round_trip_with_gradscaler():
    kw = dict(init_scale=2.0 ** 12, growth_interval=2, backoff_factor=0.25)
    accelerator, model, ref_model, scales, ref = _plain_fp16_run(kw, 5, bad=1)
    ours = accelerator.scaler.state_dict()
    theirs = ref[-1]["scaler_state"]
    assert ours == theirs
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}
    # a GradScaler loads our state and vice versa
    g = torch.amp.GradScaler("cpu")
    g.load_state_dict(ours)
    assert g.state_dict() == theirs
    other = torch.amp.GradScaler("cpu", init_scale=8.0, growth_factor=3.0, backoff_factor=0.125,
                                 growth_interval=7)
    accelerator.scaler.load_state_dict(other.state_dict())
    assert accelerator.scaler.state_dict() == other.state_dict()
    assert accelerator.scaler.get_scale() == 8.0
