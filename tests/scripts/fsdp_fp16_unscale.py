"""fp16 under full sharding (2 processes, launched by tests/test_fsdp.py): GradScaler's
unscale-once rule over the gradient shards, against torch.amp.GradScaler in the same script.

Every rank takes the same batches, so the mean the reduce-scatter takes is each rank's own
gradient (exactly: two equal fp16 halves sum to the value), and torch's autocast over fp32
parameters rounds weights and activations to fp16 as FSDP2's fp16 policy does: plain torch on
each rank is the reference.

- `window`: a clip on every micro-batch of an accumulation window. torch's GradScaler refuses the
  second unscale_() (accelerate with it); so must accelerate_c, before anything is written (the
  shards held the earlier micro-batch unscaled and the next one's sum scaled).
- `split`: one model (one shard) under two optimizers, branch a's gradients overflowing, both
  unscaled by one clip (over branch b), then b's step and a's: b's is taken (GradScaler checks
  each optimizer's own gradients), its update backs the scale off for a's recorded inf, and a's
  step, after that update, checks a's gradients again: skipped, backed off again. Parameters
  and scale as torch's.
- `gan`: two models, two optimizers, each clipped then stepped in turn (the GAN loop). accelerate's
  clip unscales every optimizer's gradients, and its step updates the scaler, which ends every
  optimizer's unscaled state: the generator's clip after the discriminator's step is a first
  unscale, of the generator's new gradients. Parameters, clip norms and the loss scale as
  torch's, step by step.
"""
from __future__ import annotations

import copy
import sys

import torch
import torch.distributed as dist
from torch import nn

from accelerate.utils import FullyShardedDataParallelPlugin, GradScalerKwargs
from accelerate_c import Accelerator

MODE = sys.argv[1]


def net(seed, i, o):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(i, 16), nn.Tanh(), nn.Linear(16, o))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)


def torch_refuses_second_unscale() -> bool:
    model = net(0, 8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    for i in range(2):
        x, y = batch(i)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x).float()
        scaler.scale(nn.functional.mse_loss(out, y) / 2).backward()
        try:
            scaler.unscale_(opt)
        except RuntimeError:
            return i == 1
    return False


plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="NO_WRAP")
if MODE == "window":
    assert torch_refuses_second_unscale()
    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin, gradient_accumulation_steps=2)
    model = net(0, 8, 1)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for i in range(2):
        x, y = batch(i)
        with acc.accumulate(model):
            acc.backward(nn.functional.mse_loss(model(x), y))
            if i == 0:
                acc.clip_grad_norm_(model.parameters(), 1e9)
            else:
                before = torch.cat([s.shard.clone() for s in acc._grads.strategy.grad_shards])
                for call in (lambda: acc.clip_grad_norm_(model.parameters(), 1e9), acc.unscale_gradients):
                    try:
                        call()
                    except RuntimeError as e:
                        assert "unscaled earlier in this step" in str(e), e
                    else:
                        raise AssertionError("a second unscale after more backward was let through")
                after = torch.cat([s.shard.clone() for s in acc._grads.strategy.grad_shards])
                assert torch.equal(before, after), "the refused call wrote to the shards"
    print(f"rank {dist.get_rank()}: fsdp fp16 window refusal OK", flush=True)
elif MODE == "gan":
    gen, disc = net(1, 8, 8), net(2, 8, 1)
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    ref_opts = [torch.optim.SGD(ref_disc.parameters(), lr=0.05, momentum=0.9),
                torch.optim.SGD(ref_gen.parameters(), lr=0.05, momentum=0.9)]
    # the default initial scale (2^16): the first discriminator step overflows and is skipped,
    # and the generator's clip unscales its stale infs, which back the scale off at the
    # generator's update (GradScaler.update reads every optimizer's found_inf)
    scaler = torch.amp.GradScaler("cpu")
    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin)
    opts = [torch.optim.SGD(disc.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(gen.parameters(), lr=0.05, momentum=0.9)]
    gen, disc, opt_d, opt_g = acc.prepare(gen, disc, *opts)

    def losses(g, d, x, y):
        fake = g(x)
        return nn.functional.mse_loss(d(fake.detach()).float(), y), -d(fake).float().mean()

    for step in range(6):
        x, y = batch(10 + step)
        # the reference: accelerate's calls spelled out in torch (clip = unscale every optimizer
        # not yet unscaled since the last update, then torch's clip; step = scaler.step + update)
        for which, params in ((0, ref_disc.parameters), (1, ref_gen.parameters)):
            ref_opts[which].zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = losses(ref_gen, ref_disc, x, y)[which]
            scaler.scale(loss).backward()
            for o in ref_opts:
                scaler.unscale_(o)
            want = torch.nn.utils.clip_grad_norm_(list(params()), 0.5)
            scaler.step(ref_opts[which])
            scaler.update()
            opt = (opt_d, opt_g)[which]
            opt.zero_grad()
            acc.backward(losses(gen, disc, x, y)[which])
            got = acc.clip_grad_norm_((disc, gen)[which].parameters(), 0.5)
            opt.step()
            assert torch.allclose(got.float(), want.float(), rtol=1e-5), (step, which, float(got), float(want))
        for name, m, r in (("generator", gen, ref_gen), ("discriminator", disc, ref_disc)):
            mine = acc.get_state_dict(m)  # the full dict on the main process (as accelerate's)
            for k, v in r.state_dict().items() if acc.is_main_process else ():
                torch.testing.assert_close(mine[k].float(), v.float(), rtol=1e-5, atol=1e-6,
                                           msg=lambda msg, k=k, n=name, s=step: f"{n} {k} at step {s}: {msg}")
        assert acc.scaler.get_scale() == scaler.get_scale(), (acc.scaler.get_scale(), scaler.get_scale())
    print(f"rank {dist.get_rank()}: fsdp fp16 gan OK", flush=True)
elif MODE == "split":
    class TwoBranches(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(3)
            self.a, self.b = nn.Linear(8, 1), nn.Linear(8, 1)

        def forward(self, x):  # branch a's gradients overflow fp16 at the loss scale, b's do not
            return self.a(x) * 1e6 + self.b(x)

    model = TwoBranches()
    ref = copy.deepcopy(model)
    ref_opts = [torch.optim.SGD(ref.a.parameters(), lr=0.1), torch.optim.SGD(ref.b.parameters(), lr=0.1)]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)  # (b's bias gradient overflows at 2^16)
    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=plugin,  # NO_WRAP: one shard for both
                      kwargs_handlers=[GradScalerKwargs(init_scale=2.0 ** 10)])
    opts = [torch.optim.SGD(model.a.parameters(), lr=0.1), torch.optim.SGD(model.b.parameters(), lr=0.1)]
    model, opt_a, opt_b = acc.prepare(model, *opts)
    for step in range(3):
        x = batch(20 + step)[0] * 0.1
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(x).float().mean()
        scaler.scale(loss).backward()
        for o in ref_opts:  # accelerate's clip: every optimizer unscaled, then torch's clip
            scaler.unscale_(o)
        torch.nn.utils.clip_grad_norm_(ref.b.parameters(), 1e9)
        for o in ref_opts[::-1]:  # b's step, then a's; accelerate: each is scaler.step + update
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        acc.backward(model(x).float().mean())
        # one unscale over both optimizers' gradients (one shard), the clip over b's
        acc.clip_grad_norm_(model.b.parameters(), 1e9)
        opt_b.step()
        opt_a.step()
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert [opt_a.step_was_skipped, opt_b.step_was_skipped] == [True, False], step
        assert acc.scaler.get_scale() == scaler.get_scale(), (step, acc.scaler.get_scale(), scaler.get_scale())
        mine = acc.get_state_dict(model)
        for k, v in ref.state_dict().items() if acc.is_main_process else ():
            torch.testing.assert_close(mine[k].float(), v.float(), rtol=1e-5, atol=1e-6)
    print(f"rank {dist.get_rank()}: fsdp fp16 split OK", flush=True)
