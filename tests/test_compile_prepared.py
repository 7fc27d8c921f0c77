"""torch.compile and the prepared model, against accelerate 1.15 (and, for fp16, plain torch).

Under mixed precision prepare() replaces the model's forward (autocast, fp32 outputs). torch.compile
of the prepared model asks for the source file of that forward's function; accelerate_c's was a
callable instance (no file), so compiling after prepare() failed under bf16 and fp16 while
accelerate's worked. Each case trains a few steps (clip, AdamW) with torch.compile before or
after prepare(), on accelerate and on accelerate_c from the same seed and data, and compares the
losses and the parameters bitwise (the "eager" backend runs the same torch ops as the eager
model, so nothing is left to compiler rounding). fp16: accelerate on CPU refuses fp16 in some
versions, so the reference there is torch's own autocast + GradScaler loop, compiled alike.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from helpers import _reset_accelerate_reference, fresh_state, reset_all_states  # noqa: F401

STEPS = 3


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _train_on(package, mixed_precision, order):
    reset_all_states()
    _reset_accelerate_reference()
    Accelerator = importlib.import_module(package).Accelerator
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = Accelerator(mixed_precision=mixed_precision, cpu=True)
    if order == "before":
        model = torch.compile(model, backend="eager")
    prepared, opt = acc.prepare(model, opt)
    if order == "after":
        prepared = torch.compile(prepared, backend="eager")
    losses = []
    for x in _batches():
        out = prepared(x)
        assert out.dtype == torch.float32  # the fp32-output wrapper ran inside the compiled forward
        loss = out.square().mean()
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _train_torch_fp16(order):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    fwd = torch.compile(model, backend="eager")
    losses = []
    for x in _batches():
        with torch.autocast("cpu", dtype=torch.float16):
            out = fwd(x)
        loss = out.float().square().mean()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("order", ["before", "after"])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_compiled_training_matches_accelerate(mixed_precision, order):
    ref_losses, ref_params = _train_on("accelerate", mixed_precision, order)
    losses, params = _train_on("accelerate_c", mixed_precision, order)
    assert losses == ref_losses
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("order", ["before", "after"])
def test_compiled_fp16_training_matches_torch(order):
    ref_losses, ref_params = _train_torch_fp16(order)
    losses, params = _train_on("accelerate_c", "fp16", order)
    assert losses == ref_losses
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_the_prepared_forward_is_a_function_reaching_its_wrapper_as_accelerates_is():
    """What torch.compile and unwrapping rely on: the bound forward's function is a real
    function (it has a source file) with `__wrapped__`, as accelerate's is."""
    import inspect

    shapes = []
    for package in ("accelerate", "accelerate_c"):
        reset_all_states()
        _reset_accelerate_reference()
        acc = importlib.import_module(package).Accelerator(mixed_precision="bf16", cpu=True)
        fwd = acc.prepare(_model()).forward
        assert inspect.getfile(fwd.__func__).endswith(".py")
        shapes.append((inspect.isfunction(fwd.__func__), hasattr(fwd.__func__, "__wrapped__"),
                       fwd.__self__ is not None))
    assert shapes[0] == shapes[1] == (True, True, True)


# ---- the dynamo plugin: prepare() compiles, as accelerate's does -------------------------------
class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) + x


class _Net(torch.nn.Module):
    """Repeated blocks, so that regional compilation has regions to compile."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(3))
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


def _plugin_run(package, mixed_precision, regional, tmp_path):
    from safetensors.torch import load_file

    reset_all_states()
    _reset_accelerate_reference()
    mod = importlib.import_module(package)
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plugin = mod.utils.TorchDynamoPlugin(backend="eager", use_regional_compilation=regional)
    acc = mod.Accelerator(mixed_precision=mixed_precision, cpu=True, dynamo_plugin=plugin,
                          gradient_accumulation_steps=2)
    prepared, opt = acc.prepare(model, opt)
    losses = []
    for x in _batches() * 2:
        with acc.accumulate(prepared):
            loss = prepared(x).square().mean()
            acc.backward(loss)
            acc.clip_grad_norm_(prepared.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    out = tmp_path / package
    acc.save_model(prepared, out / "model")
    acc.save_state(out / "state")
    seen = {
        "class": type(prepared).__name__, "is_model": prepared is model,
        "unwrap": type(acc.unwrap_model(prepared)).__name__,
        "unwrap_without_compile_is_model": acc.unwrap_model(prepared, keep_torch_compile=False) is model,
        "get_state_dict": sorted(acc.get_state_dict(prepared)),
        "save_model": sorted(load_file(out / "model" / "model.safetensors")),
        "save_state": sorted(load_file(out / "state" / "model.safetensors")),
        "output dtype": prepared(_batches()[0]).dtype,
    }
    acc.load_state(out / "state")
    return losses, [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_the_dynamo_plugin_compiles_in_prepare_as_accelerate(tmp_path, mixed_precision, regional):
    """Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager"[, regional])): what prepare()
    returns, what unwrap gives, the keys get_state_dict / save_model / save_state write (accelerate
    keeps `_orig_mod` in the first two), the losses and the parameters after training with
    accumulation and clipping: all as accelerate 1.15's."""
    ref_losses, ref_params, ref_seen = _plugin_run("accelerate", mixed_precision, regional, tmp_path)
    losses, params, seen = _plugin_run("accelerate_c", mixed_precision, regional, tmp_path)
    assert seen == ref_seen
    assert seen["class"] == ("_Net" if regional else "OptimizedModule")
    assert losses == ref_losses
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["ddp", "zero2", "fsdp"])
def test_a_launch_config_with_dynamo_compiles_on_two_processes(tmp_path, kind):
    """`accelerate-c launch` with a config file whose dynamo_config names a backend: the
    Accelerator compiles in prepare() under DDP, ZeRO-2 (in place) and full sharding, and trains
    as torch DDP compiled alike (tests/scripts/compile_train.py)."""
    import os

    from test_launch import SCRIPTS, launch

    cfg = tmp_path / "config.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
                   "dynamo_config:\n  dynamo_backend: EAGER\n")
    res = launch(["--config_file", str(cfg), "--main_process_port", "0",
                  os.path.join(SCRIPTS, "compile_train.py"), kind])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"compile OK {kind}" in res.stdout
