"""clip_grad_norm_ on one process over the sums of squares the gradient hooks took.

Once clip_grad_norm_ has asked for a 2-norm, the backward that ends a step measures each
gradient's range right after it is written (csrc/python/reducer_py.c, Reducer.sums), so the
clip reads the buffer no more: one scaling pass. These tests check that a real loop takes that
path (no sumsq/stats read of the buffer at clip time), that it is not taken when anything wrote
the buffer after (or in the middle of) the measurements, and in every case that the norm and the
clipped gradients are torch's: each is compared with torch.nn.utils.clip_grad_norm_ on a copy of
the model given the same gradients and the same writes.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator, _C
from accelerate_c import grads as grads_mod
from clip_models import Checkpointed, HalfAndFull, run_write_scenario
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
def _flat_buffers(monkeypatch):
    """These tests are about the flat buffers, which one CPU process leaves out by default
    (accelerate_c/loose_grads.py; tests/test_loose_grads.py tests that path)."""
    monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "flat")


def hook_sums_match_the_buffer(accelerator):
    """The hooks' sums, where valid, agree with a read of the buffer (the same fp32-block kernel
    over other block boundaries: ~1e-7 relative) and with a sum in double; the rounded one with
    torch's per-tensor norms in the gradients' dtype, squared and added (fp32: the exact sum)."""
    for g in accelerator._grads.groups:
        got = g.reducer.sums(g.flat._version)
        if got is None:
            continue
        ref, ref_nf = _C.sumsq(g.buf)
        exact = float(g.flat.double().pow(2).sum())
        assert got[2] == ref_nf
        assert abs(got[0] - ref) <= 1e-6 * ref and abs(got[0] - exact) <= 1e-6 * exact, (got, ref, exact)
        if g.dtype == torch.float32:
            assert got[1] == got[0]
        else:
            torchs = sum(float(torch.linalg.vector_norm(v)) ** 2 for v in g.views)
            assert got[1] == torchs, (got, torchs)


# --------------------------------------------------------------------------------------------
# the cached path is used in a real loop
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reset", ["set_to_none", "zeros"])
@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16", "fp16"])
def test_clip_in_a_real_loop_reads_no_buffer_after_the_first_step(mixed_precision, accum, reset):
    """The accelerate idiom (accumulate, backward, clip on sync steps, step, zero_grad): the
    first clip reads the buffer (nothing was measured yet); every later one uses the hooks'
    sums, and the norms and parameters are torch's."""
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
    norms, reads, measured = [], [], []
    for inputs, targets in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_function(model(inputs), targets))
            measured.append(accelerator._grads.groups[0].reducer.measure)
            if accelerator.sync_gradients:
                hook_sums_match_the_buffer(accelerator)
                with counting_reads() as c:
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), max_norm))
                reads.append(c.reads)
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    assert len(norms) == len(ref_norms)
    for i, (got, want) in enumerate(zip(norms, ref_norms)):
        assert_rel(got, want, msg=f"step {i} norm")
    assert reads == [1] + [0] * (len(reads) - 1), reads
    # only the backwards that end a step measure (accumulation micro-batches are rewritten)
    assert measured == [False] * accum + [(i + 1) % accum == 0 for i in range(accum, n_batches)], measured
    rtol, atol = tols(mixed_precision)
    assert_params_close(model, ref_model, rtol=rtol, atol=atol)


def test_bf16_and_fp32_buffers_both_use_their_hook_sums():
    model = make_model(0, cls=HalfAndFull)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    assert len(accelerator._grads.groups) == 2
    batches = batches_of(make_loader(n=12, batch_size=4))
    for step, (inputs, targets) in enumerate(batches):
        accelerator.backward(loss_function(model(inputs), targets))
        loss_function(ref_model(inputs), targets).backward()
        # the independent reference: torch's own gradients, their norm in double
        exact = math.sqrt(sum(float(q.grad.double().pow(2).sum()) for q in ref_model.parameters()))
        with counting_reads() as c:
            got = accelerator.clip_grad_norm_(model.parameters(), 0.01)
        ref = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.01)
        assert c.reads == (2 if step == 0 else 0)
        assert abs(float(got) - exact) <= 2 ** -8 * exact  # the norm comes out in bf16, as torch's
        torch.testing.assert_close(got.float(), ref.float(), rtol=2 ** -8, atol=0)
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2 ** -7, atol=1e-6)
        for m in (model, ref_model):
            m.zero_grad()


# --------------------------------------------------------------------------------------------
# the cached path is not used once something wrote the buffer after the measurements
# --------------------------------------------------------------------------------------------
# what is done to the gradients on step 2, and whether its clip may use the hooks' sums
WRITES = {
    "none": True,
    # resync writes these ranges and measures each right after its write, as a hook would
    "grad_assign": True,  # .grad = a new tensor: copied into the range
    "no_grad_param": True,  # no gradient (set_to_none): its range zeroed
    # writes the sums cannot follow: clip must read the buffer
    "grad_mul": False,  # p.grad.mul_() after backward
    # p.grad.data.mul_(): torch's `.data` has a version counter of its own, which no cache
    # could see; a gradient view's `.data` shares the view's (grad_layout.GradView)
    "grad_data_mul": False,
    # p.grad.data = a new tensor: the view no longer points into the buffer (the step's .grad
    # walk rebuilds it; GradView leaves the assignment to torch)
    "grad_data_assign": False,
    "grad_data_read": True,  # p.grad.data.norm() (logging): a read, not a write
    "grad_assign_and_grad_mul": False,  # both of the above on two parameters
    "no_grad_param_zeros": False,  # no gradient, zero_grad(set_to_none=False): unmeasured zeros
    "unscale_fp16": False,  # unscale_gradients() before clip
    "clip_twice": True,  # the first clip may; the second must read (checked apart)
    "hook_mul": False,  # a user's hook scales one gradient in the middle of the backward
}


@pytest.mark.parametrize("write", list(WRITES))
def test_clip_uses_the_hook_sums_only_when_nothing_else_wrote_the_buffer(write):
    """Step 0 asks for 2-norms; steps 1-3 are measured in their hooks, and on step 2 `write`
    changes the gradients after backward (or, for "hook_mul", a user's post-accumulate-grad hook
    scales one gradient in place in the middle of the backward, after the hooks measured it but
    before others are; for "no_grad_param*", a parameter gets no gradient: with set_to_none its
    range is zeroed by resync, else it holds zero_grad's zeros while its slot still holds step
    1's sum). The clip of step 2 reads the buffer unless WRITES says the sums still hold; those
    of steps 1 and 3 never do; every norm and gradient is torch's, from a copy given the same
    writes."""
    reads, accelerator = run_write_scenario(write, second_clip_reads=1)
    assert accelerator._grads.groups[0].reducer.measure  # steps after the first were measured
    expect = [1, 0, 0 if WRITES[write] else 1, 0]
    assert reads == expect, f"{write}: buffer reads per clip {reads}, expected {expect}"


def test_accumulation_without_accumulate_measures_the_sum_of_both_backwards():
    """Two backwards before one clip (no accumulate(): both are measured); the second
    accumulates in place into the views, and its hooks measure the sums the clip needs."""
    model = make_model(0)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    batches = batches_of(make_loader(n=24, batch_size=4))
    for step in range(3):
        for inputs, targets in batches[2 * step:2 * step + 2]:
            accelerator.backward(loss_function(model(inputs), targets))
            loss_function(ref_model(inputs), targets).backward()
        with counting_reads() as c:
            got = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        assert c.reads == (1 if step == 0 else 0)
        assert_rel(got, want, msg=f"step {step}")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=FP32_RTOL, atol=FP32_ATOL)
        model.zero_grad()
        ref_model.zero_grad()


def test_reentrant_checkpointing_norm_is_torchs():
    model = make_model(0, cls=Checkpointed)
    ref_model = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(model)
    reads = []
    for step, (inputs, targets) in enumerate(batches_of(make_loader(n=12, batch_size=4))):
        inputs = inputs.requires_grad_()
        accelerator.backward(loss_function(model(inputs), targets))
        loss_function(ref_model(inputs.detach().requires_grad_()), targets).backward()
        with counting_reads() as c:
            got = accelerator.clip_grad_norm_(model.parameters(), 0.05)
        reads.append(c.reads)
        want = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 0.05)
        assert_rel(got, want, msg=f"step {step}")
        for p, q in zip(model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=FP32_RTOL, atol=FP32_ATOL)
        model.zero_grad()
        ref_model.zero_grad()
    assert reads == [1, 0, 0], reads


def test_clip_coefficient_is_torchs_bit_for_bit():
    """clip_coef (fp32 in Python floats) against torch's formula on the same total norm: the
    norm and the coefficient equal torch's exactly, non-finite and overflowing cases included,
    for fp32; bf16/fp16 use torch's ops."""
    import random

    rng = random.Random(0)
    specials = [0.0, 1e-45, 1e-30, 1e-6, 0.3, 1.0, 3.0, 1e19, 1e30, 3.4e38, 3.41e38, 1e300, math.inf, math.nan]
    cases = [(t, m) for t in specials for m in [0.0, 1e-3, 0.7, 1.0, 5.0, 1e30, 3.4e38, math.inf, -1.0]]
    cases += [(10 ** rng.uniform(-12, 12), 10 ** rng.uniform(-8, 8)) for _ in range(20000)]
    cases += [(t, t * rng.uniform(0.2, 1.2)) for t in (rng.uniform(0.5, 4) for _ in range(20000))]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for total, max_norm in cases if dtype == torch.float32 else cases[:500]:
            norm, coef = grads_mod.clip_coef(total, max_norm, dtype)
            want = torch.tensor(total, dtype=dtype)
            want_coef = float(torch.clamp(max_norm / (want + 1e-6), max=1.0))
            assert norm.dtype == dtype and norm.shape == ()
            assert torch.equal(norm, want) or (norm.isnan() and want.isnan()), (dtype, total, norm, want)
            assert coef == want_coef or (math.isnan(coef) and math.isnan(want_coef)), (dtype, total, max_norm)


def test_reading_grad_data_leaves_a_graph_that_saved_the_gradient_alone():
    """A graph that saved a gradient (here as the factor of a product) still backpropagates after
    `p.grad.data` is read, as in torch: reading `.data` of a gradient view is not a write."""
    results = []
    for ours in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        if ours:
            model = Accelerator(cpu=True).prepare(model)
        model(torch.randn(2, 4)).sum().backward()
        w = torch.ones(3, requires_grad=True)
        aux = (w * model.bias.grad).sum()  # saves model.bias.grad for w's gradient
        float(model.bias.grad.data.norm())
        aux.backward()
        results.append(w.grad.clone())
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
