"""Plugin and kwargs-handler objects: accelerate 1.15's own objects passed to accelerate_c's
Accelerator work exactly as ours do, and as they do in accelerate's Accelerator; a default
TorchDynamoPlugin (what transformers' Trainer passes) is taken; values asking for something
accelerate_c has not built are refused with an error naming the argument and the value."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import accelerate_c.utils as ours
from accelerate_c import Accelerator
from helpers import fresh_state, loss_function, make_loader, make_model, reset_all_states  # noqa: F401
from test_launch import SCRIPTS, launch
from timeouts import wait_s

theirs = pytest.importorskip("accelerate.utils")


def _reset_reference():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _reference_accelerator(**kw):
    import accelerate

    _reset_reference()
    return accelerate.Accelerator(cpu=True, **kw)


def _ours(**kw):
    reset_all_states()
    return Accelerator(cpu=True, **kw)


# ---- TorchDynamoPlugin ------------------------------------------------------------------------
DYNAMO_ENVS = [{}, {"ACCELERATE_DYNAMO_MODE": "max-autotune", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "true",
                    "ACCELERATE_DYNAMO_USE_DYNAMIC": "0", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "yes"},
               {"ACCELERATE_DYNAMO_BACKEND": "inductor", "ACCELERATE_DYNAMO_USE_DYNAMIC": "True"}]


@pytest.mark.parametrize("env", DYNAMO_ENVS)
@pytest.mark.parametrize("kw", [{}, {"backend": "eager", "mode": "reduce-overhead"}, {"backend": "NO"},
                                {"fullgraph": True, "dynamic": False, "options": {"a": 1}, "disable": True}])
def test_dynamo_plugin_fields_and_environment_defaults_are_accelerates(env, kw, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    mine, ref = ours.TorchDynamoPlugin(**kw), theirs.TorchDynamoPlugin(**kw)
    assert vars(mine).keys() == vars(ref).keys()
    for field in vars(ref):
        a, b = getattr(mine, field), getattr(ref, field)
        assert (a.value if field == "backend" else a) == (b.value if field == "backend" else b), field
    assert mine.to_dict() == ref.to_dict()
    assert mine.to_kwargs() == ref.to_kwargs()


@pytest.mark.parametrize("make", [ours.TorchDynamoPlugin, theirs.TorchDynamoPlugin])
def test_a_default_dynamo_plugin_is_taken(make):
    plugin = make()
    acc = _ours(dynamo_plugin=plugin)
    assert acc.state.dynamo_plugin is plugin
    assert str(acc.state.dynamo_plugin.backend.value) == "NO"


def _dynamo_fields(plugin):
    return {k: str(getattr(v, "value", v)) for k, v in vars(plugin).items()}


@pytest.mark.parametrize("make", [ours.TorchDynamoPlugin, theirs.TorchDynamoPlugin])
def test_a_dynamo_backend_is_taken_as_by_accelerate(make):
    """A backend other than NO is kept in the state, as accelerate keeps it; prepare() compiles
    with it (tests/test_compile_prepared.py)."""
    plugin = make(backend="inductor", mode="max-autotune")
    assert _ours(dynamo_plugin=plugin).state.dynamo_plugin is plugin
    mine = _dynamo_fields(_ours(dynamo_backend="eager").state.dynamo_plugin)
    assert mine == _dynamo_fields(_reference_accelerator(dynamo_backend="eager").state.dynamo_plugin)
    assert mine["backend"] == "EAGER"


def test_dynamo_backend_from_the_environment_as_by_accelerate(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "aot_eager")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "true")
    mine = _dynamo_fields(_ours().state.dynamo_plugin)
    assert mine == _dynamo_fields(_reference_accelerator().state.dynamo_plugin)
    assert mine["backend"] == "AOT_EAGER" and mine["use_regional_compilation"] == "True"


def test_an_unavailable_dynamo_backend_fails_at_prepare_as_on_accelerate():
    errors = []
    for acc in (_reference_accelerator(dynamo_backend="tensorrt"), _ours(dynamo_backend="tensorrt")):
        with pytest.raises(Exception) as e:
            acc.prepare(torch.nn.Linear(2, 2))
        errors.append(e.value)
    assert type(errors[1]) is type(errors[0]) and "tensorrt" in str(errors[1])
    assert any("dynamo plugin" in n for n in getattr(errors[1], "__notes__", []))


def test_dynamo_plugin_and_backend_together_are_refused_as_by_accelerate():
    with pytest.raises(ValueError) as ref:
        _reference_accelerator(dynamo_plugin=theirs.TorchDynamoPlugin(), dynamo_backend="no")
    with pytest.raises(ValueError) as mine:
        _ours(dynamo_plugin=ours.TorchDynamoPlugin(), dynamo_backend="no")
    assert str(mine.value) == str(ref.value)


def test_an_unknown_dynamo_backend_names_the_value():
    with pytest.raises(ValueError, match="backend='nope'"):
        ours.TorchDynamoPlugin(backend="nope")


# ---- GradientAccumulationPlugin ------------------------------------------------------------------
def _sync_pattern(acc, n=7):
    """sync_gradients per batch of a 7-batch loader (the last window ends with the loader) and
    the GradientState's settings."""
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, dl = acc.prepare(model, opt, make_loader(n=4 * n, batch_size=4))
    pattern = []
    for x, y in dl:
        with acc.accumulate(model):
            acc.backward(loss_function(model(x), y))
            pattern.append(acc.sync_gradients)
            opt.step()
            opt.zero_grad()
    gs = acc.gradient_state
    return pattern, gs.num_steps, gs.sync_with_dataloader, gs.plugin_kwargs, gs.adjust_scheduler, \
        [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kw", [dict(num_steps=3), dict(num_steps=2, sync_with_dataloader=False),
                                dict(num_steps=4, sync_each_batch=True, adjust_scheduler=False)])
def test_gradient_accumulation_plugin_of_either_package_reaches_the_gradient_state(kw):
    ref = _sync_pattern(_reference_accelerator(gradient_accumulation_plugin=theirs.GradientAccumulationPlugin(**kw)))
    for plugin in (ours.GradientAccumulationPlugin(**kw), theirs.GradientAccumulationPlugin(**kw)):
        got = _sync_pattern(_ours(gradient_accumulation_plugin=plugin))
        assert got[:5] == ref[:5], (type(plugin).__module__, got[:5], ref[:5])
        for a, b in zip(got[5], ref[5]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# ---- ProjectConfiguration -----------------------------------------------------------------------
def _checkpoints(acc, config):
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc.prepare(model, opt)
    iterations = []
    for _ in range(3):
        acc.save_state()
        iterations.append(config.iteration)
    root = os.path.join(config.project_dir, "checkpoints")
    return (sorted(os.listdir(root)), iterations, acc.project_dir == config.project_dir,
            acc.logging_dir == config.logging_dir, acc.save_iteration)


def test_project_configuration_of_either_package_names_and_prunes_checkpoints_alike(tmp_path):
    def config(cls, name):
        return cls(project_dir=str(tmp_path / name), automatic_checkpoint_naming=True, total_limit=2)

    c = config(theirs.ProjectConfiguration, "ref")
    ref = _checkpoints(_reference_accelerator(project_config=c), c)
    for cls, name in ((ours.ProjectConfiguration, "ours"), (theirs.ProjectConfiguration, "theirs")):
        c = config(cls, name)
        assert _checkpoints(_ours(project_config=c), c) == ref, cls.__module__


# ---- DataLoaderConfiguration --------------------------------------------------------------------
def _order(acc):
    dl = acc.prepare(DataLoader(TensorDataset(torch.arange(20)), batch_size=3, shuffle=True))
    dl.set_epoch(1)
    return [b[0].tolist() for b in dl], acc.split_batches, acc.even_batches, acc.use_seedable_sampler


def test_dataloader_configuration_of_either_package_shuffles_alike():
    kw = dict(use_seedable_sampler=True, data_seed=123, even_batches=False)
    ref = _order(_reference_accelerator(dataloader_config=theirs.DataLoaderConfiguration(**kw)))
    for cls in (ours.DataLoaderConfiguration, theirs.DataLoaderConfiguration):
        assert _order(_ours(dataloader_config=cls(**kw))) == ref, cls.__module__


def test_split_batches_argument_is_written_into_accelerates_configuration_object():
    for cls in (ours.DataLoaderConfiguration, theirs.DataLoaderConfiguration):
        c = cls()
        _ours(dataloader_config=c, split_batches=True)
        assert c.split_batches is True, cls.__module__


def test_dispatch_batches_of_either_configuration_object_dispatches():
    from torch.utils.data import DataLoader

    ref = _reference_accelerator(dataloader_config=theirs.DataLoaderConfiguration(dispatch_batches=True))
    want = type(ref.prepare(DataLoader(list(range(8)), batch_size=2))).__name__
    for cls in (ours.DataLoaderConfiguration, theirs.DataLoaderConfiguration):
        dl = _ours(dataloader_config=cls(dispatch_batches=True)).prepare(DataLoader(list(range(8)), batch_size=2))
        assert type(dl).__name__ == want == "DataLoaderDispatcher", cls.__module__


# ---- AutocastKwargs, GradScalerKwargs --------------------------------------------------------------
def test_autocast_kwargs_of_either_package_turn_autocast_off_alike():
    x = torch.randn(3, 8)

    def forward(acc):
        model = acc.prepare(make_model(0))
        with acc.autocast():
            return model(x), torch.is_autocast_enabled("cpu")

    ref = forward(_reference_accelerator(mixed_precision="bf16", kwargs_handlers=[theirs.AutocastKwargs(enabled=False)]))
    for cls in (ours.AutocastKwargs, theirs.AutocastKwargs):
        out, enabled = forward(_ours(mixed_precision="bf16", kwargs_handlers=[cls(enabled=False)]))
        assert torch.equal(out, ref[0]) and enabled == ref[1], cls.__module__


def test_grad_scaler_kwargs_of_either_package_configure_the_loss_scale_as_torch():
    kw = dict(init_scale=1024.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    ref = torch.amp.GradScaler("cpu", **kw)
    for cls in (ours.GradScalerKwargs, theirs.GradScalerKwargs):
        acc = _ours(mixed_precision="fp16", kwargs_handlers=[cls(**kw)])
        assert acc.scaler.state_dict() == ref.state_dict(), cls.__module__


def test_one_handler_of_a_kind_whichever_package_it_comes_from():
    with pytest.raises(ValueError, match="only pass one DistributedDataParallelKwargs"):
        _ours(kwargs_handlers=[ours.DistributedDataParallelKwargs(), theirs.DistributedDataParallelKwargs()])


# ---- features not built: refused, naming the argument and the value --------------------------------
def test_megatron_plugin_is_refused_naming_it():
    with pytest.raises(NotImplementedError, match=r"megatron_lm_plugin=.*Megatron"):
        _ours(megatron_lm_plugin="anything")


def test_a_wrong_object_for_a_configuration_argument_is_a_type_error():
    with pytest.raises(TypeError, match=r"project_config=.*ProjectConfiguration.*got builtins.dict"):
        _ours(project_config={"project_dir": "x"})
    with pytest.raises(TypeError, match="gradient_accumulation_plugin"):
        _ours(gradient_accumulation_plugin=theirs.ProjectConfiguration())


# ---- DistributedDataParallelKwargs, InitProcessGroupKwargs on 2 processes --------------------------
def test_ddp_and_init_kwargs_of_either_package_configure_the_reducer_alike():
    """tests/scripts/plugin_handlers.py prints the bucket plan, the process group's timeout and
    the trained parameters; accelerate's objects and ours must print the same, and torch DDP
    (run in the same script) must agree with both on the parameters."""
    outs = {}
    for source in ("accelerate_c", "accelerate"):
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                      os.path.join(SCRIPTS, "plugin_handlers.py"), source], timeout=wait_s(300))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        outs[source] = [line for line in res.stdout.splitlines() if line.startswith("result ")]
    assert outs["accelerate_c"] and outs["accelerate_c"] == outs["accelerate"]


@pytest.mark.parametrize("word", ["1", "true", "t", "yes", "y", "on", "0", "false", "f", "no", "n", "off", "TRUE"])
def test_flag_words_are_accelerates(monkeypatch, word):
    """The ACCELERATE_* flags take the words accelerate's str_to_bool takes, with its meaning."""
    from accelerate.utils.environment import parse_flag_from_env as theirs_flag

    from accelerate_c.utils.dataclasses import parse_flag_from_env as ours_flag

    monkeypatch.setenv("ACCELERATE_TEST_FLAG", word)
    assert ours_flag("ACCELERATE_TEST_FLAG") == theirs_flag("ACCELERATE_TEST_FLAG")
