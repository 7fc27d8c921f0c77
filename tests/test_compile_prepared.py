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
    trained = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    acc.load_state(out / "state")
    seen["load_state restores the weights"] = all(torch.equal(p, q) for p, q in zip(model.parameters(), trained))
    return losses, trained, seen


@pytest.mark.parametrize("regional", [False, True])
@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_the_dynamo_plugin_compiles_in_prepare_as_accelerate(tmp_path, mixed_precision, regional):
    """Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager"[, regional])): what prepare()
    returns, what unwrap gives, the keys get_state_dict / save_model / save_state write (accelerate
    keeps `_orig_mod` in the first two), the losses and the parameters after training with
    accumulation and clipping: all as accelerate 1.15's."""
    ref_losses, ref_params, ref_seen = _plugin_run("accelerate", mixed_precision, regional, tmp_path)
    losses, params, seen = _plugin_run("accelerate_c", mixed_precision, regional, tmp_path)
    # save_model writes the model's own names (accelerate keeps torch.compile's `_orig_mod.`,
    # which from_pretrained cannot read: a difference, README)
    assert any("_orig_mod" in k for k in ref_seen.pop("save_model"))
    assert seen.pop("save_model") == seen["save_state"] == sorted(_Net().state_dict())
    assert seen == ref_seen
    assert seen["load_state restores the weights"]
    assert seen["class"] == ("_Net" if regional else "OptimizedModule")
    assert losses == ref_losses
    for p, q in zip(params, ref_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind,flow,backend", [
    ("ddp", "direct", "EAGER"), ("zero2", "direct", "EAGER"), ("fsdp", "direct", "EAGER"),
    ("fsdp", "eval_first", "EAGER"), ("ddp", "free_memory", "EAGER"),
    ("ddp", "direct", "AOT_EAGER"), ("fsdp", "direct", "AOT_EAGER")])
def test_a_launch_config_with_dynamo_compiles_on_two_processes(tmp_path, kind, flow, backend):
    """`accelerate-c launch` with a config file whose dynamo_config names a backend: the
    Accelerator compiles in prepare() under DDP, ZeRO-2 (in place) and full sharding, and trains
    as torch DDP compiled alike (tests/scripts/compile_train.py); also when the model was
    prepared for evaluation first (full sharding: the wrapper's zero_grad must reach the shards
    the training prepare sets up), and when the wrapper is prepared again after free_memory();
    with AOTAutograd too ("aot_eager": a compiled backward, the gradient hooks firing after it)."""
    import os

    from test_launch import SCRIPTS, launch

    cfg = tmp_path / "config.yaml"
    cfg.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\nuse_cpu: true\n"
                   f"dynamo_config:\n  dynamo_backend: {backend}\n")
    res = launch(["--config_file", str(cfg), "--main_process_port", "0",
                  os.path.join(SCRIPTS, "compile_train.py"), kind, flow], env={"EXPECT_DYNAMO_BACKEND": backend})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"compile OK {kind} {flow}" in res.stdout


@pytest.mark.parametrize("how", ["plugin", "user"])
def test_full_sharding_compiled_with_a_unit_run_again_outside_the_forward(how):
    """Full sharding, compiled by the dynamo plugin or by the user before prepare(), an extra loss
    from the output layer called directly: trains as plain torch on the whole batch
    (tests/scripts/fsdp_compile_aux.py; its gradient was delivered twice before
    FullShardStrategy.before_compile)."""
    import os

    from test_launch import SCRIPTS, launch

    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fsdp_compile_aux.py"), how], env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"fsdp compile aux OK ({how})" in res.stdout


# ---- what a compiled model saves, and the Trainer around it ------------------------------------
def _llama():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
    import hf_trainer_llama

    return hf_trainer_llama


def test_save_model_of_a_compiled_model_writes_the_models_own_names(tmp_path):
    """save_model of the compiled wrapper writes the weights under the model's own names, so
    from_pretrained of the folder (config.json included, an accelerate_c addition) loads the
    trained weights. accelerate writes torch.compile's `_orig_mod.` names there (a folder
    from_pretrained refuses): a difference from accelerate, in README."""
    import transformers

    llama = _llama()
    reset_all_states()
    acc = importlib.import_module("accelerate_c").Accelerator(cpu=True, dynamo_backend="eager")
    model = llama.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prepared, opt = acc.prepare(model, opt)
    batch = llama.make_data(2, seed=1)
    ids = torch.stack([b["input_ids"] for b in batch])
    acc.backward(prepared(input_ids=ids, labels=ids).loss)
    opt.step()
    acc.save_model(prepared, tmp_path / "m")
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "m")
    mine = model.state_dict()  # the trained model itself, the reference
    theirs = loaded.state_dict()
    assert sorted(theirs) == sorted(mine)
    for k in mine:
        assert torch.equal(theirs[k], mine[k]), k


def test_accelerate_c_trainer_with_torch_compile_saves_and_predicts_as_transformers(tmp_path):
    """accelerate_c's own Trainer with torch_compile (eager backend), beside transformers'
    Trainer on accelerate with the same arguments: the same training losses; save_model writes
    a folder from_pretrained loads with the trained weights; predict() on a dataset with a
    column the model's forward does not take drops it (remove_unused_columns reads the model's
    own forward, not the compiled wrapper's (*args, **kwargs)) and gives transformers' numbers."""
    import transformers

    import accelerate_c

    llama = _llama()
    train = llama.make_data(8, seed=1)
    extra = [dict(d, idx=torch.tensor(i)) for i, d in enumerate(llama.make_data(4, seed=2))]
    out = {}
    for name, trainer_cls, args_cls in (("transformers", transformers.Trainer, transformers.TrainingArguments),
                                        ("accelerate_c", accelerate_c.Trainer, accelerate_c.TrainingArguments)):
        reset_all_states()
        _reset_accelerate_reference()
        args = args_cls(output_dir=str(tmp_path / name), torch_compile=True, torch_compile_backend="eager",
                        max_steps=2, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
                        save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True)
        trainer = trainer_cls(model=llama.make_model(), args=args, train_dataset=train)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        pred = trainer.predict(extra)
        trainer.save_model(str(tmp_path / name / "final"))
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / name / "final")
        trained = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False).state_dict()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items()), name
        out[name] = (losses, pred.predictions, pred.metrics["test_loss"])
    (ref_losses, ref_pred, ref_loss), (losses, pred, loss) = out["transformers"], out["accelerate_c"]
    assert len(losses) == 2
    torch.testing.assert_close(losses, ref_losses, rtol=1e-4, atol=0)  # logged rounded to 4 decimals
    torch.testing.assert_close(torch.as_tensor(pred), torch.as_tensor(ref_pred), rtol=1e-5, atol=1e-6)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)


def test_unwrap_without_the_fp32_wrapper_of_a_model_compiled_before_prepare():
    """A model compiled before prepare() under bf16: unwrap_model(keep_fp32_wrapper=False) gives
    back the compiled model running its own forward (fp32, no autocast), equal to the plain
    model's. (accelerate 1.15 raises a TypeError there; accelerate_c recursed: prepare() kept the
    original forward on the module inside torch.compile's wrapper, which passes new attributes
    on to it.)"""
    reset_all_states()
    model = _model()
    acc = importlib.import_module("accelerate_c").Accelerator(mixed_precision="bf16", cpu=True)
    prepared = acc.prepare(torch.compile(model, backend="eager"))
    x = _batches()[0]
    assert prepared(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(prepared(x), model(x).float())  # prepared: autocast, fp32 outputs
    unwrapped = acc.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert unwrapped is prepared and "_original_forward" not in model.__dict__
    assert torch.equal(unwrapped(x), model(x))  # the model's own fp32 forward
