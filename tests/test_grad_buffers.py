"""The flat gradient buffers behind prepare(): layout, frozen parameters, and training results
that do not depend on how (or whether) the user resets gradients, each against plain torch.

Tolerances: see helpers.py (fp32 1e-6 relative; these runs are in practice bit-identical,
except where the fused clip's double-precision norm enters)."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator
from helpers import (  # noqa: F401
    AMP_ATOL,
    AMP_RTOL,
    assert_params_close,
    batches_of,
    fresh_state,
    loss_function,
    make_loader,
    make_model,
    make_optimizer,
    torch_reference_train,
)


@pytest.fixture(autouse=True)
def _flat_buffers(monkeypatch):
    """These tests are about the flat buffers, which one CPU process leaves out by default
    (accelerate_c/loose_grads.py; tests/test_loose_grads.py tests that path)."""
    monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "flat")


def storage_ptr(t):
    return t.untyped_storage().data_ptr()


def probe_backward(accelerator, model, inputs, targets):
    """One backward to give every trainable parameter its gradient (None before, as in torch);
    the caller zero_grad()s it away afterwards, so training is unaffected."""
    accelerator.backward(loss_function(model(inputs), targets))


def grads_share_one_storage(params):
    ptrs = {storage_ptr(p.grad) for p in params}
    return len(ptrs) == 1


def assert_no_overlap(params):
    spans = sorted((p.grad.data_ptr(), p.grad.data_ptr() + p.grad.numel() * p.grad.element_size()) for p in params)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "gradient views overlap"


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------
def test_grads_are_views_of_one_flat_buffer():
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    params = list(model.parameters())
    assert all(p.grad is None for p in params)  # as in torch, until a backward
    first_inputs, first_targets = next(iter(make_loader(n=4, batch_size=4)))
    accelerator.backward(loss_function(model(first_inputs), first_targets))
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params)
    assert grads_share_one_storage(params)
    assert_no_overlap(params)
    storage = storage_ptr(params[0].grad)
    optimizer.zero_grad()

    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step, (inputs, targets) in enumerate(make_loader(n=12, batch_size=4)):
        accelerator.backward(loss_function(model(inputs), targets))
        loss_function(ref_model(inputs), targets).backward()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(p.grad, q.grad)
            assert storage_ptr(p.grad) == storage
        optimizer.step()
        ref_opt.step()
        # a different way of resetting each step; the buffer must survive all of them
        if step == 0:
            optimizer.zero_grad()  # set_to_none, as torch: the next backward copies into the buffer
            assert all(p.grad is None for p in model.parameters())
        elif step == 1:
            model.zero_grad()
        ref_opt.zero_grad()
    assert_params_close(model, ref_model)
    # after model.zero_grad() and one more backward, the grads are back in the buffer
    inputs, targets = next(iter(make_loader(n=4, batch_size=4)))
    accelerator.backward(loss_function(model(inputs), targets))
    assert {storage_ptr(p.grad) for p in model.parameters()} == {storage}


class TwoDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4).to(torch.float64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).double()).float()


def test_float64_params_stay_ordinary_grads_and_train_like_torch():
    """float64 has no C kernels: such parameters stay outside the buffers, keep torch's own
    gradients, and the model trains exactly as in plain torch."""
    model = make_model(0, cls=TwoDtypes)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    probe_backward(accelerator, model, *next(iter(make_loader(n=4, batch_size=4))))
    assert model.b.weight.grad.dtype == torch.float64 and model.a.weight.grad is not None
    assert grads_share_one_storage(model.a.parameters())
    optimizer.zero_grad()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for inputs, targets in batches_of(make_loader(n=16, batch_size=4)):
        optimizer.zero_grad()
        accelerator.backward(loss_function(model(inputs), targets))
        optimizer.step()
        ref_opt.zero_grad()
        loss_function(ref_model(inputs), targets).backward()
        ref_opt.step()
    assert model.b.weight.grad is not None and model.b.weight.grad.dtype == torch.float64
    assert_params_close(model, ref_model)


class HalfAndFull(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


def test_one_buffer_per_dtype_fp32_bf16_params_and_training_matches_torch():
    model = make_model(0, cls=HalfAndFull)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    probe_backward(accelerator, model, *next(iter(make_loader(n=4, batch_size=4))))
    assert grads_share_one_storage(model.a.parameters())
    assert grads_share_one_storage(model.b.parameters())
    assert storage_ptr(model.a.weight.grad) != storage_ptr(model.b.weight.grad)
    assert model.b.weight.grad.dtype == torch.bfloat16
    optimizer.zero_grad()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for inputs, targets in make_loader(n=16, batch_size=4):
        optimizer.zero_grad()
        accelerator.backward(loss_function(model(inputs), targets))
        optimizer.step()
        ref_opt.zero_grad()
        loss_function(ref_model(inputs), targets).backward()
        ref_opt.step()
    assert_params_close(model, ref_model, rtol=0, atol=0)


class LoRALinear(nn.Module):
    def __init__(self, d=64, r=2):
        super().__init__()
        self.base = nn.Linear(d, d)
        self.A = nn.Parameter(torch.randn(r, d) * 0.1)
        self.B = nn.Parameter(torch.randn(d, r) * 0.1)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + x @ self.A.t() @ self.B.t()


class LoRAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = LoRALinear()
        self.l2 = LoRALinear()
        self.head = nn.Linear(64, 4)
        for p in self.head.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.relu(self.l2(torch.relu(self.l1(x)))))


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
def test_lora_frozen_params_get_no_buffer_and_no_grad(optim):
    model = make_model(0, cls=LoRAModel)
    ref_model = copy.deepcopy(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    accelerator = Accelerator()
    optimizer = make_optimizer(optim, trainable)
    model, optimizer = accelerator.prepare(model, optimizer)
    probe_backward(accelerator, model, torch.randn(4, 64), torch.randn(4, 4))
    assert all(p.grad is None for p in frozen)
    assert grads_share_one_storage(trainable)
    buf_bytes = trainable[0].grad.untyped_storage().nbytes()
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    assert trainable_bytes <= buf_bytes < frozen_bytes, (buf_bytes, trainable_bytes, frozen_bytes)
    optimizer.zero_grad()

    ref_opt = make_optimizer(optim, [p for p in ref_model.parameters() if p.requires_grad])
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(4, 64, generator=g), torch.randn(4, 4, generator=g)
        optimizer.zero_grad()
        accelerator.backward(loss_function(model(x), y))
        assert all(p.grad is None for p in frozen)
        optimizer.step()
        ref_opt.zero_grad()
        loss_function(ref_model(x), y).backward()
        ref_opt.step()
    assert all(p.grad is None for p in frozen)
    assert_params_close(model, ref_model)


# --------------------------------------------------------------------------------------------
# results do not depend on how gradients are reset
# --------------------------------------------------------------------------------------------
def _reset_fn(kind, model, optimizer):
    if kind == "optimizer.zero_grad":
        return optimizer.zero_grad
    if kind == "model.zero_grad":
        return lambda: model.zero_grad()  # set_to_none=True
    if kind == "optimizer.zero_grad(set_to_none=False)":
        return lambda: optimizer.zero_grad(set_to_none=False)
    if kind == "model.zero_grad(set_to_none=False)":
        return lambda: model.zero_grad(set_to_none=False)
    if kind == "grad=None":
        def f():
            for p in model.parameters():
                p.grad = None
        return f
    if kind == "grad=zeros_like":
        def f():
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        return f
    raise ValueError(kind)




RESETS = ["optimizer.zero_grad", "model.zero_grad", "grad=None", "grad=zeros_like",
          "optimizer.zero_grad(set_to_none=False)", "model.zero_grad(set_to_none=False)"]


@pytest.mark.parametrize("optim", ["sgd", "adamw"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("reset", RESETS)
def test_grad_reset_method_does_not_change_results(reset, accum, optim):
    n_batches = 7  # with accum 2: a partial last window
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer(optim, ref_model.parameters())
    torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=4 * n_batches, batch_size=4)),
                          accum=accum)

    accelerator = Accelerator(gradient_accumulation_steps=accum)
    optimizer = make_optimizer(optim, model.parameters())
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    do_reset = _reset_fn(reset, model, optimizer)
    if accum == 1:  # tutorial order: reset first
        for inputs, targets in loader:
            do_reset()
            accelerator.backward(loss_function(model(inputs), targets))
            optimizer.step()
    else:
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_function(model(inputs), targets))
                optimizer.step()
                # optimizer.zero_grad is a no-op while accumulating; the others are not, so
                # they are called only after a real step
                if reset.startswith("optimizer.zero_grad") or accelerator.sync_gradients:
                    do_reset()
    assert_params_close(model, ref_model, msg=reset)


@pytest.mark.parametrize("reset", RESETS)
def test_grad_reset_after_backward_before_step(reset):
    """Resetting between backward and step means the step sees no (or zero) gradient: torch's
    SGD skips None grads and applies zeros; so must the buffers."""
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    do_reset = _reset_fn(reset, model, optimizer)
    ref_reset = _reset_fn(reset, ref_model, ref_opt)
    for i, (inputs, targets) in enumerate(make_loader(n=16, batch_size=4)):
        accelerator.backward(loss_function(model(inputs), targets))
        loss_function(ref_model(inputs), targets).backward()
        if i == 2:
            do_reset()
            ref_reset()
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
    assert_params_close(model, ref_model, msg=reset)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x, use_branch):
        h = torch.relu(self.trunk(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.head(h)


@pytest.mark.parametrize("reset", [
    "optimizer.zero_grad", "model.zero_grad", "grad=None", "grad=zeros_like",
    "model.zero_grad(set_to_none=False)",
    "optimizer.zero_grad(set_to_none=False)",
])
@pytest.mark.parametrize("clip", [None, 0.2], ids=["noclip", "clip"])
@pytest.mark.parametrize("optim", ["adamw", "sgd"])
@pytest.mark.parametrize("accum", [1, 2])
def test_param_without_grad_in_some_steps_like_torch(accum, optim, clip, reset):
    """A branch used only in some steps: with a set_to_none reset torch's optimizers skip it
    (grad None) in the other steps; with a zeroing reset they apply a zero-gradient update.
    The same reset, at the same points, must give the same parameters through the Accelerator."""
    n_batches = 8

    def use_branch(i):
        return i % (2 * accum) == 0  # accum 1: even steps; accum 2: first micro-batch of every other window

    model = make_model(0, cls=Branchy)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer(optim, ref_model.parameters())
    ref_reset = _reset_fn(reset, ref_model, ref_opt)
    batches = batches_of(make_loader(n=4 * n_batches, batch_size=4))
    for i, (inputs, targets) in enumerate(batches):
        (loss_function(ref_model(inputs, use_branch(i)), targets) / accum).backward()
        if (i + 1) % accum == 0:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
            ref_opt.step()
            ref_reset()

    accelerator = Accelerator(gradient_accumulation_steps=accum)
    optimizer = make_optimizer(optim, model.parameters())
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    do_reset = _reset_fn(reset, model, optimizer)
    for i, (inputs, targets) in enumerate(loader):
        with accelerator.accumulate(model):
            accelerator.backward(loss_function(model(inputs, use_branch(i)), targets))
            if clip is not None and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            if reset.startswith("optimizer.zero_grad") or accelerator.sync_gradients:
                do_reset()
    assert_params_close(model, ref_model, msg=f"{optim}/{reset}")
    # the optimizer saw the branch exactly as often as torch's did
    ref_state = ref_opt.state[ref_model.branch.weight]
    state = optimizer.state[model.branch.weight]
    if optim == "adamw":
        assert float(state["step"]) == float(ref_state["step"])
        if reset in ("optimizer.zero_grad", "model.zero_grad", "grad=None"):
            assert float(state["step"]) < float(ref_opt.state[ref_model.head.weight]["step"])
    else:
        torch.testing.assert_close(state["momentum_buffer"], ref_state["momentum_buffer"], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("retain", [False, True], ids=["two-forwards", "retain_graph"])
def test_two_backwards_before_one_step(retain):
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    batches = batches_of(make_loader(n=32, batch_size=4))
    for (x1, y1), (x2, y2) in zip(batches[::2], batches[1::2]):
        optimizer.zero_grad()
        ref_opt.zero_grad()
        if retain:
            out, ref_out = model(x1), ref_model(x1)
            accelerator.backward(loss_function(out, y1), retain_graph=True)
            accelerator.backward((out ** 2).mean())
            loss_function(ref_out, y1).backward(retain_graph=True)
            (ref_out ** 2).mean().backward()
        else:
            accelerator.backward(loss_function(model(x1), y1))
            accelerator.backward(loss_function(model(x2), y2))
            loss_function(ref_model(x1), y1).backward()
            loss_function(ref_model(x2), y2).backward()
        optimizer.step()
        ref_opt.step()
    assert_params_close(model, ref_model)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.emb.weight  # shared parameter, used twice per forward

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.emb(x))))[:, :4]


def test_shared_parameter_accumulates_both_uses():
    model = make_model(0, cls=Tied)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    for inputs, targets in make_loader(n=16, batch_size=4):
        optimizer.zero_grad()
        accelerator.backward(loss_function(model(inputs), targets))
        ref_opt.zero_grad()
        loss_function(ref_model(inputs), targets).backward()
        assert torch.equal(model.emb.weight.grad, ref_model.emb.weight.grad)
        optimizer.step()
        ref_opt.step()
    assert model.out.weight is model.emb.weight
    assert_params_close(model, ref_model)


# --------------------------------------------------------------------------------------------
# fp16 and resets / parameters outside the model
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overflow", [False, True])
@pytest.mark.parametrize("reset", ["model.zero_grad", "grad=None", "grad=zeros_like"])
def test_fp16_model_zero_grad_and_clip_matches_gradscaler(reset, overflow):
    bad = 3 if overflow else None

    def hook(i, loss):
        return loss * 1e30 if i == bad else loss

    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer("adamw", ref_model.parameters())
    ref = torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=32, batch_size=4)),
                                mixed_precision="fp16", max_norm=0.5, loss_hook=hook,
                                reset=_reset_fn(reset, ref_model, ref_opt))
    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = make_optimizer("adamw", model.parameters())
    loader = make_loader(n=32, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    do_reset = _reset_fn(reset, model, optimizer)
    skipped = []
    for i, (inputs, targets) in enumerate(loader):
        do_reset()
        accelerator.backward(hook(i, loss_function(model(inputs), targets)))
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        skipped.append(accelerator.optimizer_step_was_skipped)
    ref_steps = [r for r in ref if "batch" in r]
    assert skipped == [r["skipped"] for r in ref_steps]
    assert accelerator.scaler.state_dict() == ref[-1]["scaler_state"]
    assert_params_close(model, ref_model, rtol=AMP_RTOL, atol=AMP_ATOL)


def test_fp16_model_under_fp16_loss_scaling_clips_the_unscaled_norm():
    """An fp16 model under mixed_precision="fp16" (torch's GradScaler refuses to unscale fp16
    gradients; accelerate_c unscales them): clip rounds each gradient's norm to fp16 after
    unscaling, as torch's clip over the unscaled gradients does. The scaled norms are past
    65504: rounded before unscaling they were inf, and every gradient was zeroed by a 0
    coefficient with the step not skipped."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)).half()
    ref = copy.deepcopy(model)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    x = torch.randn(16, 256).half()
    accelerator.backward(model(x).float().pow(2).mean() * 4)
    scale = accelerator.scaler.get_scale()
    (ref(x).float().pow(2).mean() * 4 * scale).backward()
    # the scaled per-gradient norms overflow fp16, no scaled element does
    assert all(bool(torch.isfinite(p.grad).all()) for p in ref.parameters())
    assert max(float(p.grad.float().norm()) for p in ref.parameters()) > 65504
    for p in ref.parameters():  # GradScaler's unscale, written out: x inv_scale in the gradients' dtype
        p.grad.mul_(1.0 / scale)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    got = accelerator.clip_grad_norm_(model.parameters(), 0.5)
    assert got.dtype == want.dtype == torch.float16 and torch.isfinite(got)
    torch.testing.assert_close(got, want, rtol=2 ** -10, atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2 ** -9, atol=1e-6)
    opt.step()
    assert not accelerator.optimizer_step_was_skipped


def test_norm_dtype_is_that_of_the_gradients_present():
    """torch stacks the norms of the gradients present: a bf16 model whose fp32 layer got no
    gradient is clipped in bf16 (norm and coefficient), and with no gradient at all the norm is
    torch's fp32 zero."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8).to(torch.bfloat16)
            self.b = nn.Linear(8, 8)  # fp32, left out of the loss

        def forward(self, x):
            return self.a(x.to(torch.bfloat16))

    model = Net()
    ref = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    assert len(accelerator._grads.groups) == 2
    none = accelerator.clip_grad_norm_(model.parameters(), 0.01)
    want_none = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert none.dtype == want_none.dtype and torch.equal(none, want_none)
    x = torch.randn(4, 8)
    accelerator.backward(model(x).float().pow(2).sum())
    ref(x).float().pow(2).sum().backward()
    got = accelerator.clip_grad_norm_(model.parameters(), 0.01)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want), (got, want)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None)
        assert p.grad is None or torch.equal(p.grad, q.grad)


def test_fp16_parameter_outside_the_model_is_unscaled_like_gradscaler():
    """A learnable parameter that is in the optimizer but in no prepared model (a loss
    temperature, say) lives outside the buffers; under fp16 it must still be unscaled once."""
    model = make_model(0)
    temp = nn.Parameter(torch.tensor(1.5))
    ref_model = copy.deepcopy(model)
    ref_temp = nn.Parameter(temp.detach().clone())
    ref_opt = torch.optim.SGD(list(ref_model.parameters()) + [ref_temp], lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for inputs, targets in make_loader(n=16, batch_size=4):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref_model(inputs)
        loss = loss_function(out.float() * ref_temp, targets)
        scaler.scale(loss).backward()
        scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(list(ref_model.parameters()) + [ref_temp], 0.5)
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()

    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = torch.optim.SGD(list(model.parameters()) + [temp], lr=0.05)
    loader = make_loader(n=16, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        accelerator.backward(loss_function(model(inputs) * temp, targets))
        accelerator.clip_grad_norm_(list(model.parameters()) + [temp], 0.5)
        optimizer.step()
        optimizer.zero_grad()
    assert_params_close(model, ref_model, rtol=AMP_RTOL, atol=AMP_ATOL)
    torch.testing.assert_close(temp.detach(), ref_temp.detach(), rtol=AMP_RTOL, atol=AMP_ATOL)


def test_fp16_parameter_outside_the_model_no_clip():
    model = make_model(0)
    temp = nn.Parameter(torch.tensor(1.5))
    ref_model = copy.deepcopy(model)
    ref_temp = nn.Parameter(temp.detach().clone())
    ref_opt = torch.optim.SGD(list(ref_model.parameters()) + [ref_temp], lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    for inputs, targets in make_loader(n=16, batch_size=4):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref_model(inputs)
        scaler.scale(loss_function(out.float() * ref_temp, targets)).backward()
        scaler.step(ref_opt)
        scaler.update()
        ref_opt.zero_grad()
    accelerator = Accelerator(mixed_precision="fp16")
    optimizer = torch.optim.SGD(list(model.parameters()) + [temp], lr=0.05)
    loader = make_loader(n=16, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for inputs, targets in loader:
        accelerator.backward(loss_function(model(inputs) * temp, targets))
        optimizer.step()
        optimizer.zero_grad()
    assert_params_close(model, ref_model, rtol=AMP_RTOL, atol=AMP_ATOL)
    torch.testing.assert_close(temp.detach(), ref_temp.detach(), rtol=AMP_RTOL, atol=AMP_ATOL)


# --------------------------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------------------------
def test_torch_compiled_model_prepare_unwrap_and_train():
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    compiled = torch.compile(model, backend="eager")
    accelerator = Accelerator()
    optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    loader = make_loader(n=24, batch_size=4)
    prepared, optimizer, loader = accelerator.prepare(compiled, optimizer, loader)
    assert prepared is compiled
    assert accelerator.unwrap_model(prepared) is compiled
    assert accelerator.unwrap_model(prepared, keep_torch_compile=False) is model
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for inputs, targets in loader:
        optimizer.zero_grad()
        accelerator.backward(loss_function(prepared(inputs), targets))
        optimizer.step()
        ref_opt.zero_grad()
        loss_function(ref_model(inputs), targets).backward()
        ref_opt.step()
    assert grads_share_one_storage(model.parameters())
    assert_params_close(model, ref_model)


# --------------------------------------------------------------------------------------------
# free_memory
# --------------------------------------------------------------------------------------------
def test_free_memory_releases_buffers_and_hooks():
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    inputs, targets = next(iter(make_loader(n=4, batch_size=4)))
    accelerator.backward(loss_function(model(inputs), targets))
    assert grads_share_one_storage(model.parameters())
    accelerator.free_memory()
    # grads are now ordinary, separate tensors
    params = list(model.parameters())
    assert len({storage_ptr(p.grad) for p in params}) == len(params)
    # a plain torch loop works as on an unprepared model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for inputs, targets in make_loader(n=12, batch_size=4):
        opt.zero_grad()
        loss_function(model(inputs), targets).backward()
        assert all(p.grad._base is None for p in model.parameters())
        assert len({storage_ptr(p.grad) for p in model.parameters()}) == len(params)
        opt.step()
        ref_opt.zero_grad()
        loss_function(ref_model(inputs), targets).backward()
        ref_opt.step()
    # ref_model missed the first (pre-free_memory) backward but no step used it: same params
    assert_params_close(model, ref_model)


class Wide16(nn.Module):
    """Many small 16-bit tensors of different sizes: the total norm over per-tensor norms each
    rounded to 16 bits (torch's) and the exact one round apart often enough to show."""

    def __init__(self, dtype):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.head = nn.Linear(8, 4)
        self.to(dtype)

    def forward(self, x):
        x = x.to(self.head.weight.dtype)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).float()


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
@pytest.mark.parametrize("kind", ["fp32+bf16", "bf16", "fp16"])
def test_clip_grad_norm_of_16bit_params_is_torchs_bit_for_bit(norm_type, kind):
    """16-bit parameters (their own buffer): torch's clip_grad_norm_ takes each gradient's norm
    in the gradient's dtype (rounded to 16 bits) and the total over those, so the Accelerator
    rounds each parameter's norm the same way (GradLayout.sums) before the total: the norm, the
    clipped gradients and the parameters after each step are torch's exactly. Step 0 reads the
    buffer; later steps use the sums the hooks took (checked apart in test_clip_hook_sums)."""
    make = (lambda: make_model(0, cls=HalfAndFull)) if kind == "fp32+bf16" else \
        (lambda: make_model(0, cls=Wide16, dtype=torch.bfloat16 if kind == "bf16" else torch.float16))
    model = make()
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for step, (inputs, targets) in enumerate(batches_of(make_loader(n=48, batch_size=8))):
        accelerator.backward(loss_function(model(inputs), targets))
        loss_function(ref_model(inputs), targets).backward()
        got = accelerator.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type)
        ref = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01, norm_type=norm_type)
        assert got.dtype == ref.dtype
        if kind == "fp32+bf16":
            # a total in fp32 (the dtypes mix): torch's fp32 per-tensor norms and summation
            # order are an fp32 ulp or two from the exact sum; the bf16 part is rounded as torch's
            close = dict(rtol=1e-6, atol=0)
            torch.testing.assert_close(got, ref, **close)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                torch.testing.assert_close(p.grad, q.grad, **close)
        else:
            assert torch.equal(got, ref), (step, got, ref)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                assert p.grad.dtype == q.grad.dtype and torch.equal(p.grad, q.grad), step
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref_model.parameters()):
            if kind == "fp32+bf16":
                torch.testing.assert_close(p, q, **close)
            else:
                assert torch.equal(p, q), step


# --------------------------------------------------------------------------------------------
# things users do that must not make the buffers silently diverge from torch
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cast", ["double", "bfloat16"])
def test_model_cast_after_prepare_rebuilds_the_buffers(cast):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    getattr(model, cast)()
    getattr(ref, cast)()
    dtype = model.weight.dtype
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g).to(dtype)
        opt.zero_grad()
        accelerator.backward(model(x).pow(2).sum())
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        ref_opt.zero_grad()
        ref(x).pow(2).sum().backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
        torch.testing.assert_close(norm.double(), ref_norm.double(), rtol=1e-2 if cast == "bfloat16" else 1e-6,
                                   atol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-2 if cast == "bfloat16" else 1e-6, atol=1e-6)


def test_parameter_shared_by_two_models_counts_twice_when_listed_twice():
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    a, b = nn.Sequential(shared, nn.Linear(4, 1)), nn.Sequential(shared, nn.Linear(4, 1))
    ra, rb = copy.deepcopy((a, b))
    accelerator = Accelerator()
    opt = torch.optim.SGD(list(a.parameters()) + list(b[1].parameters()), lr=0.1)
    a, b, opt = accelerator.prepare(a, b, opt)
    x = torch.randn(3, 4)
    accelerator.backward(a(x).sum() + b(x).sum())
    norm = accelerator.clip_grad_norm_(list(a.parameters()) + list(b.parameters()), 0.1)
    (ra(x).sum() + rb(x).sum()).backward()
    ref = torch.nn.utils.clip_grad_norm_(list(ra.parameters()) + list(rb.parameters()), 0.1)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(a[0].weight.grad, ra[0].weight.grad, rtol=1e-6, atol=1e-7)


def test_grad_is_none_until_backward_and_for_params_without_gradient():
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.a(x)

    model = TwoHeads()
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert model.a.weight.grad is None and model.b.weight.grad is None
    accelerator.backward(model(torch.randn(3, 2)).sum())
    opt.step()
    assert model.a.weight.grad is not None and model.b.weight.grad is None  # as torch leaves them


def test_create_graph_gradient_penalty_matches_torch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).pow(2).sum().backward(create_graph=True)
        assert m.weight.grad.requires_grad  # the graph survives, for a penalty on the gradient
        penalty = m.weight.grad.pow(2).sum()
        for p in m.parameters():
            p.grad = None
        penalty.backward()
        o.step()
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7)


def test_fp16_overflow_in_one_optimizers_params_skips_only_that_optimizer():
    from accelerate_c.utils import GradScalerKwargs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    ref = copy.deepcopy(model)
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=4.0)])
    o1, o2 = torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)
    model, o1, o2 = accelerator.prepare(model, o1, o2)
    x = torch.randn(3, 2)
    accelerator.backward(model(x).sum())
    with torch.no_grad():
        model[1].weight.grad[0, 0] = float("inf")
    o1.step()
    o2.step()
    assert not o1.step_was_skipped and o2.step_was_skipped
    # torch: autocast fp16 + GradScaler, step + update per optimizer (what accelerate does)
    r1, r2 = torch.optim.SGD(ref[0].parameters(), lr=0.1), torch.optim.SGD(ref[1].parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with torch.autocast("cpu", dtype=torch.float16):
        out = ref(x)
    scaler.scale(out.float().sum()).backward()
    with torch.no_grad():
        ref[1].weight.grad[0, 0] = float("inf")
    scaler.step(r1)
    scaler.update()
    scaler.step(r2)
    scaler.update()
    assert accelerator.scaler.get_scale() == scaler.get_scale()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_zero_grad_keep_zeros_drops_a_replaced_gradient_like_torch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    ref = copy.deepcopy(model)
    accelerator = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 3)
    for m, o, back in ((model, opt, accelerator.backward), (ref, ref_opt, lambda l: l.backward())):
        back(m(x).sum())
        m.weight.grad = m.weight.grad * 3  # a library replaces the gradient
        o.step()
        o.zero_grad(set_to_none=False)
        back(m(x).sum())
        o.step()
    torch.testing.assert_close(model.weight, ref.weight, rtol=1e-6, atol=1e-7)


# ---- the C bookkeeping behind intact()/resync(), and the huge-page buffers ------------------------------
def test_grad_views_reports_loose_gradients_and_broken_groups():
    from accelerate_c import _C

    params = [nn.Parameter(torch.randn(5)) for _ in range(4)]
    views = [torch.zeros(5) for _ in params]
    ptrs = [v.data_ptr() for v in views]
    for p, v in zip(params, views):
        p.grad = v
    assert _C.grad_views(params, views, ptrs, torch.float32, -1) == []
    params[1].grad = None
    params[3].grad = torch.ones(5)  # assigned: not the view
    # the reference: the same answer computed in Python
    assert _C.grad_views(params, views, ptrs, torch.float32, -1) == [i for i, (p, v) in enumerate(zip(params, views))
                                                                      if p.grad is not v] == [1, 3]
    assert _C.grad_views(params, views, ptrs, torch.float64, -1) is None  # a dtype other than the group's
    assert _C.grad_views(params, views, ptrs, torch.float32, 0) is None  # a device other than the group's
    views[0].data = torch.zeros(5)  # what module._apply does to `.grad.data`: the view's memory moved
    assert _C.grad_views(params, views, ptrs, torch.float32, -1) is None
    with pytest.raises(ValueError, match="4 params but 3 views"):
        _C.grad_views(params, views[:3], ptrs, torch.float32, -1)
    with pytest.raises(TypeError, match="must be lists"):
        _C.grad_views(tuple(params), views, ptrs, torch.float32, -1)


def test_big_cpu_gradient_buffers_start_on_a_huge_page_and_train_like_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 8))  # 2.1 MB of fp32 gradients
    ref = copy.deepcopy(model)
    acc = Accelerator(cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    (g,) = acc._grads.groups
    assert g.flat.data_ptr() % (2 << 20) == 0 and g.flat.numel() * 4 >= (2 << 20)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = torch.randn(16, 512), torch.randn(16, 8)
    for _ in range(3):
        for m, o, backward in ((model, opt, acc.backward), (ref, opt_ref, torch.Tensor.backward)):
            o.zero_grad()
            backward(nn.functional.mse_loss(m(x), y))
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0)
    from accelerate_c import _C

    # madvise(MADV_HUGEPAGE) succeeds wherever the kernel has THP at all (even set to "never")
    assert _C.advise_hugepages(g.flat) is os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    with pytest.raises(TypeError):
        _C.advise_hugepages(torch.zeros(4, dtype=torch.int64))
