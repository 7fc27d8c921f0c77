"""One CPU process without flat buffers (accelerate_c/loose_grads.py): gradients stay autograd's
tensors; clip_grad_norm_ is torch's, except under fp16, where the unscale is folded into it (one
C read pass per gradient, then one multiply). Every norm, gradient and parameter here is
compared with torch's (clip_grad_norm_, GradScaler) on a copy of the model given the same data
and the same writes; the read counts show which path clip took."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator
from clip_models import Checkpointed, HalfAndFull, WithBranch, run_write_scenario
from counting_kernels import counting_reads
from helpers import (  # noqa: F401
    FP32_ATOL,
    FP32_RTOL,
    assert_params_close,
    assert_rel,
    batches_of,
    fresh_state,
    loss_function,
    make_loader,
    make_model,
    make_optimizer,
    tols,
    torch_reference_train,
)


@pytest.fixture(autouse=True)
def _auto_buffers(monkeypatch):
    monkeypatch.delenv("ACCELERATE_C_GRAD_BUFFERS", raising=False)


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("reset", ["set_to_none", "zeros"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_a_real_loop_is_torchs(mixed_precision, accum, reset):
    """The accelerate idiom (accumulate, backward, clip on sync steps, step, zero_grad): no
    flat buffer; under fp16 each clip reads every gradient once (unscale and norm in one pass),
    otherwise it is torch's own (none of our passes); norms and parameters are torch's."""
    n_batches, max_norm = 12, 0.05
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    ref_opt = make_optimizer("sgd", ref_model.parameters())
    set_to_none = reset == "set_to_none"
    ref = torch_reference_train(ref_model, ref_opt, None, batches_of(make_loader(n=4 * n_batches, batch_size=4)),
                                mixed_precision=mixed_precision, accum=accum, max_norm=max_norm,
                                reset=lambda: ref_opt.zero_grad(set_to_none=set_to_none))
    ref_norms = [r["norm"] for r in ref if "norm" in r]

    accelerator = Accelerator(mixed_precision=mixed_precision, gradient_accumulation_steps=accum, cpu=True)
    optimizer = make_optimizer("sgd", model.parameters())
    loader = make_loader(n=4 * n_batches, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert accelerator._grads.groups == [] and len(accelerator._grads.loose.params) == len(_trainable(model))
    norms, reads, separate = [], [], []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_function(model(inputs), targets))
            if accelerator.sync_gradients:
                with counting_reads() as c:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm))
                # after each sync backward: every gradient its own tensor, none a view of a buffer
                storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
                separate.append(len(storages) == len(_trainable(model)) and
                                all(p.grad._base is None for p in model.parameters()))
                reads.append(c.reads)
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    assert len(norms) == len(ref_norms)
    for i, (got, want) in enumerate(zip(norms, ref_norms)):
        assert_rel(got, want, msg=f"step {i} norm")
        assert got.dtype == want.dtype
    per_clip = len(_trainable(model)) if mixed_precision == "fp16" else 0
    assert reads == [per_clip] * len(reads), reads
    rtol, atol = tols(mixed_precision)
    assert_params_close(model, ref_model, rtol=rtol, atol=atol)
    # the gradients are autograd's own tensors, not views of one buffer
    assert separate and all(separate), separate


# what is done to the gradients on step 2 (clip_models.run_write_scenario); every norm, gradient
# and parameter is checked against torch's given the same writes
WRITES = ["none", "grad_assign", "no_grad_param", "grad_mul", "grad_data_mul", "grad_data_assign", "grad_data_read",
          "grad_assign_and_grad_mul", "no_grad_param_zeros", "unscale_fp16", "clip_twice", "hook_mul"]


@pytest.mark.parametrize("write", WRITES)
def test_writes_between_backward_and_clip_clip_as_torch(write):
    """The loop of clip_models.run_write_scenario. unscale_fp16 is the one fp16 case: its clips
    read each of the 6 gradients once (unscale folded in), except on step 2, where
    unscale_gradients() came first and the clip is torch's."""
    reads, _ = run_write_scenario(write, second_clip_reads=0)
    want_reads = [6, 6, 0, 6] if write == "unscale_fp16" else [0, 0, 0, 0]
    assert reads == want_reads, f"{write}: gradients read per clip {reads}, expected {want_reads}"


@pytest.mark.parametrize("cls,backwards", [(HalfAndFull, 1), (Checkpointed, 1), (None, 2)])
def test_mixed_dtypes_reentrant_and_two_backwards_clip_as_torch(cls, backwards):
    """bf16 beside fp32 gradients (the norm comes out in fp32, the bf16 norms rounded as
    torch's), a weight accumulated twice in one backward, two backwards before one clip."""
    model = make_model(0, **({} if cls is None else {"cls": cls}))
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    batches = batches_of(make_loader(n=8 * backwards, batch_size=4 // backwards if backwards == 2 else 4))
    reads = []
    for step in range(3):
        for inputs, targets in batches[backwards * step:backwards * step + backwards] or batches[:backwards]:
            if cls is Checkpointed:
                inputs = inputs.requires_grad_()
            accelerator.backward(loss_function(model(inputs), targets))
            loss_function(ref_model(inputs.detach().requires_grad_(cls is Checkpointed)), targets).backward()
        with counting_reads() as c:
            got = accelerator.clip_grad_norm_(model.parameters(), 0.01)
        reads.append(c.reads)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
        assert got.dtype == want.dtype
        rtol = 2 ** -8 if cls is HalfAndFull else 1e-6
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=0)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2 ** -7 if cls is HalfAndFull else FP32_RTOL,
                                       atol=1e-6 if cls is HalfAndFull else FP32_ATOL)
        model.zero_grad()
        ref_model.zero_grad()
    assert reads == [0, 0, 0], reads  # torch's clip


def test_the_buffers_switch(monkeypatch):
    """ACCELERATE_C_GRAD_BUFFERS=flat keeps the flat buffers on one process; another value is
    refused by name at prepare."""
    monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "flat")
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(nn.Linear(4, 3))
    assert len(accelerator._grads.groups) == 1 and not accelerator._grads.loose.params
    monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "loose-ish")
    with pytest.raises(ValueError, match="ACCELERATE_C_GRAD_BUFFERS='loose-ish'"):
        Accelerator(cpu=True).prepare(nn.Linear(4, 3))


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)
        self.extra = nn.Parameter(torch.ones(4))  # trainable, but no optimizer holds it

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.extra


def _fp16_step(model, opt, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x).float()
    scaler.scale(loss_function(out, y)).backward()
    scaler.unscale_(opt)


def test_a_trainable_parameter_no_optimizer_holds_stays_scaled_as_in_torch():
    """fp16: GradScaler unscales the optimizers' gradients only; clip over all parameters then
    counts the other one still scaled, as torch and accelerate do."""
    model = make_model(0, cls=Two)
    ref = copy.deepcopy(model)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    opt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "extra"], lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters() if n != "extra"], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for step, (x, y) in enumerate(batches_of(make_loader(n=12, batch_size=4))):
        _fp16_step(ref, ref_opt, scaler, x, y)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        scaler.step(ref_opt)
        scaler.update()
        accelerator.backward(loss_function(model(x), y))
        got = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        assert_rel(got, want, msg=f"step {step}")
        torch.testing.assert_close(model.extra.grad, ref.extra.grad, rtol=1e-6, atol=0)
        opt.step()
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m.extra.grad = None


def test_kept_gradients_survive_the_idioms_of_older_loops():
    """zero_grad(set_to_none=False) keeps the gradient objects, autograd's own tensors (no
    view of a buffer): `p.grad.detach_()`, torch's swap of parameters on conversion, and
    `.data` assigned twice all behave as in torch, and the norm stays torch's."""
    model = make_model(0, cls=WithBranch)
    ref = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    opt = make_optimizer("sgd", model.parameters())
    model, opt = accelerator.prepare(model, opt)
    ref_opt = make_optimizer("sgd", ref.parameters())
    for step, (x, y) in enumerate(batches_of(make_loader(n=16, batch_size=4))):
        for m in (model, ref):
            loss_function(m(x), y).backward() if m is ref else accelerator.backward(loss_function(m(x), y))
            for _ in range(2):
                m.fc2.bias.grad.data = m.fc2.bias.grad * 1.5
        got = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert_rel(got, want, msg=f"step {step}")
        g = model.fc1.weight.grad
        assert g._base is None and not g._is_view()
        opt.step()
        ref_opt.step()
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad.detach_()
            p.grad.zero_()
    assert_params_close(model, ref)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to(torch.float64)
        ref.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert model.fc1.weight.grad.dtype == torch.float64
