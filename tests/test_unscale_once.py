"""fp16 on one CPU process (autograd's gradients, and the flat buffers): a gradient unscaled
earlier in a step that a backward has added to since holds an unscaled part and a scaled one.
torch's GradScaler refuses the second unscale_() before the optimizer step; accelerate_c refuses
it too (unscaling again would divide the first part twice), checked against GradScaler in the
same test. What GradScaler would refuse but leaves the numbers right (a second unscale with no
backward in between) stays allowed; tests/test_loose_grads.py checks its numbers."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accelerate_c import Accelerator
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)


@pytest.fixture(params=["auto", "flat"])
def buffers(request, monkeypatch):
    if request.param == "flat":
        monkeypatch.setenv("ACCELERATE_C_GRAD_BUFFERS", "flat")
    else:
        monkeypatch.delenv("ACCELERATE_C_GRAD_BUFFERS", raising=False)
    return request.param


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(n)]


def _torch_second_unscale_raises(batches):
    """torch: unscale_ after micro-batch 1, backward of micro-batch 2, unscale_ again."""
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x).float()
        scaler.scale(nn.functional.mse_loss(out, y) / 2).backward()
        try:
            scaler.unscale_(opt)
        except RuntimeError:
            return i
    return None


@pytest.mark.parametrize("call", ["clip_grad_norm_", "unscale_gradients", "clip_grad_value_"])
def test_unscaling_again_after_more_backward_is_refused_as_gradscaler_does(buffers, call):
    batches = _batches(2)
    assert _torch_second_unscale_raises(batches) == 1
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    assert (len(accelerator._grads.groups) == 1) == (buffers == "flat")
    for i, (x, y) in enumerate(batches):
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            before = [p.grad.clone() for p in model.parameters()]
            do = {"clip_grad_norm_": lambda: accelerator.clip_grad_norm_(model.parameters(), 1e9),
                  "unscale_gradients": accelerator.unscale_gradients,
                  "clip_grad_value_": lambda: accelerator.clip_grad_value_(model.parameters(), 1e9)}[call]
            if i == 0:
                do()
            else:
                with pytest.raises(RuntimeError, match=r"unscaled earlier in this step"):
                    do()
                # refused before anything was written: the gradients are as the backward left them
                for p, b in zip(model.parameters(), before):
                    assert torch.equal(p.grad, b)
            opt.step()
            opt.zero_grad()


def test_after_the_step_the_next_window_unscales_again(buffers):
    """The refusal ends at the optimizer step: clipping once per window (the accelerate idiom)
    goes on as torch's GradScaler + clip, step after step."""
    batches = _batches(6)
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, gradient_accumulation_steps=2)
    model = copy.deepcopy(ref)
    model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    norms = []
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            out = ref(x).float()
        scaler.scale(nn.functional.mse_loss(out, y) / 2).backward()
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.mse_loss(model(x), y))
            if accelerator.sync_gradients:
                scaler.unscale_(ref_opt)
                want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                got = accelerator.clip_grad_norm_(model.parameters(), 0.5)
                norms.append((float(got), float(want)))
                scaler.step(ref_opt)
                scaler.update()
                ref_opt.zero_grad()
            opt.step()
            opt.zero_grad()
    assert len(norms) == 3
    for got, want in norms:
        assert got == pytest.approx(want, rel=1e-5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_gan_loop_clips_each_model_after_the_others_step_as_gradscaler(buffers):
    """Two models, two optimizers, each clipped and stepped in turn (the GAN loop). accelerate's
    clip unscales every optimizer's gradients (the generator's with the discriminator's), and
    its step updates the scaler, which ends GradScaler's unscaled state of every optimizer: the
    generator's clip after the discriminator's step is a first unscale, not a refused second
    one. Norms and parameters as torch's GradScaler with accelerate's calls spelled out.
    (tests/scripts/fsdp_fp16_unscale.py: the same over full sharding's gradient shards.)"""
    def net(seed, o):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, o))

    gen, disc = net(1, 8), net(2, 1)
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref_disc, ref_gen)]
    scaler = torch.amp.GradScaler("cpu")
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (disc, gen)]
    gen, disc, opt_d, opt_g = accelerator.prepare(gen, disc, *opts)

    def losses(g, d, x, y):
        fake = g(x)
        return nn.functional.mse_loss(d(fake.detach()).float(), y), -d(fake).float().mean()

    for x, y in _batches(5):
        for which, (m, r) in enumerate(((disc, ref_disc), (gen, ref_gen))):
            ref_opts[which].zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = losses(ref_gen, ref_disc, x[:, :8], y[:, :1])[which]
            scaler.scale(loss).backward()
            for o in ref_opts:  # accelerate's clip: unscale_gradients() over every optimizer
                scaler.unscale_(o)
            want = torch.nn.utils.clip_grad_norm_(r.parameters(), 0.5)
            scaler.step(ref_opts[which])
            scaler.update()
            opt = (opt_d, opt_g)[which]
            opt.zero_grad()
            accelerator.backward(losses(gen, disc, x[:, :8], y[:, :1])[which])
            got = accelerator.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            assert float(got) == pytest.approx(float(want), rel=1e-5), (which, float(got), float(want), accelerator.scaler.get_scale(), scaler.get_scale())
    for m, r in ((gen, ref_gen), (disc, ref_disc)):
        for p, q in zip(m.parameters(), r.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert accelerator.scaler.get_scale() == scaler.get_scale()


class _TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)

    def forward(self, x):  # branch a's gradients overflow fp16 at the loss scale, b's do not
        return self.a(x) * 1e6 + self.b(x)


def test_one_model_under_two_optimizers_one_overflowing_then_clipped_as_gradscaler(buffers):
    """One model, two optimizers over its two branches, branch a's gradients overflowing, both
    unscaled by accelerate's clip (whose NaN coefficient, from a's inf, reaches b's gradients too):
    a's step skipped and the scale backed off; GradScaler's update ends every optimizer's state,
    so b's step checks b's gradients again and finds the clip's NaN: skipped, backed off again.
    Parameters and scale as torch's, step by step."""
    from accelerate_c.utils import GradScalerKwargs

    model = _TwoBranches()
    ref = copy.deepcopy(model)
    ref_opts = [torch.optim.SGD(ref.a.parameters(), lr=0.1), torch.optim.SGD(ref.b.parameters(), lr=0.1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    accelerator = Accelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[GradScalerKwargs(init_scale=2.0 ** 10)])
    opts = [torch.optim.SGD(model.a.parameters(), lr=0.1), torch.optim.SGD(model.b.parameters(), lr=0.1)]
    model, opt_a, opt_b = accelerator.prepare(model, *opts)
    for step, (x, _) in enumerate(_batches(3)):
        x = x * 0.1
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(x).float().mean()
        scaler.scale(loss).backward()
        for o in ref_opts:
            scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
        for o in ref_opts:
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        accelerator.backward(model(x).float().mean())
        accelerator.clip_grad_norm_(model.parameters(), 1e9)
        opt_a.step()
        opt_b.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert accelerator.scaler.get_scale() == scaler.get_scale(), step
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
