"""Accelerator.profile() with ProfileKwargs, and the Accelerator names a loop or a library reads
beside the training mechanics (multi_device, dispatch_batches, the parallel ranks, FP8 and LOMO
as reported when unused, verify_device_map, the even_batches setter, deepcopy), each compared
with accelerate 1.15's own objects built in the same test."""
from __future__ import annotations

import copy
import json
import os
import sys
import types

import accelerate
import accelerate.utils as acc_utils
import pytest
import torch
from torch import nn

import accelerate_c
from helpers import fresh_state, make_loader, make_model  # noqa: F401  (fresh_state: autouse)


def _pair(**kwargs):
    theirs = accelerate.Accelerator(cpu=True, **kwargs)
    ours = accelerate_c.Accelerator(cpu=True, **kwargs)
    return theirs, ours


def _train_profiled(acc, handler_override=None, steps=6):
    """A prepared loop of `steps` steps inside acc.profile(), prof.step() after each; returns
    the profiler and the names of the aten operators it recorded."""
    torch.manual_seed(0)
    model = make_model(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = acc.prepare(model, opt, make_loader(n=4 * steps, batch_size=4))
    with acc.profile(handler_override) as prof:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            prof.step()
    return prof


def _aten_names(prof):
    return {e.key for e in prof.key_averages() if e.key.startswith("aten::")}


@pytest.mark.parametrize("config", ["default", "schedule", "shapes_flops_modules", "trace_dir"])
def test_profile_as_accelerate(config, tmp_path):
    ready = {"ours": 0, "theirs": 0}

    def kwargs_for(who):
        if config == "default":
            return {}
        if config == "schedule":
            def on_ready(prof):
                ready[who] += 1
            return dict(schedule_option=dict(wait=1, warmup=1, active=2, repeat=1), on_trace_ready=on_ready,
                        activities=["cpu"])
        if config == "shapes_flops_modules":
            return dict(record_shapes=True, with_flops=True, with_modules=True, profile_memory=True,
                        with_stack=True)
        return dict(output_trace_dir=str(tmp_path / who))

    results = {}
    for who, lib in (("theirs", accelerate), ("ours", accelerate_c)):
        handler = lib.utils.ProfileKwargs(**kwargs_for(who))
        acc = lib.Accelerator(cpu=True, kwargs_handlers=[handler])
        assert acc.profile_handler is handler
        prof = _train_profiled(acc)
        results[who] = prof
        accelerate_c.state.AcceleratorState._reset_state()
        accelerate_c.state.GradientState._reset_state()
        accelerate.state.AcceleratorState._reset_state(True)
        accelerate.state.GradientState._reset_state()
    ours, theirs = results["ours"], results["theirs"]
    assert type(ours) is type(theirs) is torch.profiler.profile
    for field in ("activities", "record_shapes", "profile_memory", "with_stack", "with_flops", "with_modules"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ready["ours"] == ready["theirs"]
    if config == "schedule":
        assert ready["ours"] == 1  # one cycle: wait 1, warm up 1, record 2
        assert [ours.schedule(i) for i in range(6)] == [theirs.schedule(i) for i in range(6)]
    # the user's own operators were recorded under both
    assert {"aten::linear", "aten::mse_loss"} <= _aten_names(ours)
    assert {"aten::linear", "aten::mse_loss"} <= _aten_names(theirs)
    if config == "trace_dir":
        assert sorted(os.listdir(tmp_path / "ours")) == sorted(os.listdir(tmp_path / "theirs")) == ["profile_0.json"]
        for who in ("ours", "theirs"):
            trace = json.load(open(tmp_path / who / "profile_0.json"))
            names = {e.get("name") for e in trace["traceEvents"]}
            assert "aten::linear" in names, who


def test_profile_handler_argument_overrides_the_accelerators(tmp_path):
    theirs, ours = _pair(kwargs_handlers=[acc_utils.ProfileKwargs(record_shapes=True)])
    for who, acc, lib in (("ours", ours, accelerate_c), ("theirs", theirs, accelerate)):
        override = lib.utils.ProfileKwargs(output_trace_dir=str(tmp_path / who))
        with acc.profile(override) as prof:
            torch.ones(3).add(1)
        assert prof.record_shapes is False  # the override's settings, not the Accelerator's
    assert os.listdir(tmp_path / "ours") == os.listdir(tmp_path / "theirs") == ["profile_0.json"]
    # accelerate's handler object works in our Accelerator, ours by name in accelerate's place
    with ours.profile(accelerate_c.ProfileKwargs(record_shapes=True)) as prof:
        torch.ones(3).add(1)
    assert prof.record_shapes is True


def test_profile_errors_as_accelerate():
    for lib in (accelerate, accelerate_c):
        with pytest.raises(ValueError, match="gpu"):
            lib.utils.ProfileKwargs(activities=["gpu"]).build()
        with pytest.raises(TypeError, match="waits"):
            lib.utils.ProfileKwargs(schedule_option={"waits": 1}).build()
    ours = accelerate_c.Accelerator(cpu=True)
    with pytest.raises(TypeError, match="ProfileKwargs"):
        with ours.profile(dict(record_shapes=True)):
            pass


def test_profile_kwargs_fields_match():
    import dataclasses
    theirs = {f.name: f.default for f in dataclasses.fields(acc_utils.ProfileKwargs)}
    ours = {f.name: f.default for f in dataclasses.fields(accelerate_c.ProfileKwargs)}
    assert ours == theirs
    assert accelerate_c.ProfileKwargs(with_flops=True).to_kwargs() == acc_utils.ProfileKwargs(with_flops=True).to_kwargs()


@pytest.mark.parametrize("config", ["plain", "seedable_dispatch"])
def test_settings_names_as_accelerate(config):
    pairs = []
    for lib in (accelerate, accelerate_c):
        dl = lib.utils.DataLoaderConfiguration(use_seedable_sampler=config != "plain",
                                               dispatch_batches=True if config != "plain" else None)
        pairs.append(lib.Accelerator(cpu=True, dataloader_config=dl))
    theirs, ours = pairs
    for name in ("multi_device", "dispatch_batches", "use_stateful_dataloader", "profile_handler", "fp8_enabled",
                 "has_fp8_handler", "delayed_fp8_autocast", "fp8_recipe_handler", "ao_recipe_handler",
                 "te_recipe_handler", "msamp_recipe_handler", "has_lomo_optimizer", "deepspeed_plugin"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.fp8_backend == theirs.fp8_backend == "NO"
    assert type(ours.fp8_backend).__name__ == type(theirs.fp8_backend).__name__ == "FP8BackendType"


def test_fp8_backend_reads_the_environment_as_accelerate(monkeypatch):
    monkeypatch.setenv("ACCELERATE_FP8_BACKEND", "TE")
    theirs, ours = _pair()
    assert ours.fp8_backend == theirs.fp8_backend == "TE"


def test_parallel_ranks_raise_as_accelerate():
    theirs, ours = _pair()
    for name in ("tensor_parallel_rank", "data_parallel_rank", "data_parallel_shard_rank", "pipeline_parallel_rank",
                 "context_parallel_rank"):
        with pytest.raises(Exception) as t:
            getattr(theirs, name)
        with pytest.raises(Exception) as o:
            getattr(ours, name)
        assert type(o.value) is type(t.value) and str(o.value) == str(t.value), name


def test_verify_device_map_as_accelerate():
    theirs, ours = _pair()
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    assert ours.verify_device_map(model) is theirs.verify_device_map(model) is False
    model[1].hf_device_map = {"": "cpu"}
    assert ours.verify_device_map(model) is theirs.verify_device_map(model) is False
    model[1].hf_device_map = {"0": "cpu", "1": "disk"}
    assert ours.verify_device_map(model) is theirs.verify_device_map(model) is True


def test_even_batches_setter_and_deepcopy_as_accelerate():
    theirs, ours = _pair()
    for acc in (theirs, ours):
        acc.even_batches = False
        assert acc.even_batches is False and acc.dataloader_config.even_batches is False
        assert copy.deepcopy(acc) is acc
        assert copy.deepcopy({"acc": acc})["acc"] is acc


def test_lomo_backward_errors_and_lomo_refused():
    theirs, ours = _pair()
    loss = torch.ones((), requires_grad=True)
    with pytest.raises(ValueError, match="learning rate"):
        ours.lomo_backward(loss, None)
    with pytest.raises(ValueError, match="LOMO"):
        ours.lomo_backward(loss, 0.1)
    # a LOMO optimizer (recognised by its package, which need not be installed) is refused
    module = types.ModuleType("lomo_optim.lomo")
    Lomo = type("Lomo", (torch.optim.SGD,), {"__module__": "lomo_optim.lomo"})
    module.Lomo = Lomo
    sys.modules.setdefault("lomo_optim.lomo", module)
    try:
        model = make_model(seed=1)
        with pytest.raises(NotImplementedError, match="LOMO"):
            ours.prepare(model, Lomo(model.parameters(), lr=0.1))
        assert ours._optimizers == [] and ours.has_lomo_optimizer is False
    finally:
        sys.modules.pop("lomo_optim.lomo", None)


def test_top_level_names_as_accelerate():
    for name in ("ProfileKwargs", "DDPCommunicationHookType", "FullyShardedDataParallelPlugin",
                 "find_executable_batch_size", "synchronize_rng_states", "DistributedType"):
        assert hasattr(accelerate, name) and hasattr(accelerate_c, name), name
