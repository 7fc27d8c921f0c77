"""DeepSpeed configuration as users write it (accelerate_c/deepspeed_config/): the plugin against
accelerate 1.15's own DeepSpeedPlugin, the "auto" fills against accelerate's rules, the schedules
against DeepSpeed's documented formulas (computed here, independently), the optimizer/scheduler
block contract, every refusal, the launcher's flags and variables against accelerate's launcher,
TrainingArguments(deepspeed=...), and the Accelerator's refusal after the checks."""
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch

from accelerate_c import Accelerator, DistributedType, TrainingArguments
from accelerate_c.commands import launch as launch_cmd
from accelerate_c.commands.main import build_parser
from accelerate_c.deepspeed_config import (
    DeepSpeedConfigError,
    DeepSpeedFeatureError,
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    build_optimizer,
    build_scheduler,
    fill_for_prepare,
    fill_from_training_steps,
    resolve_sharding,
    sharding_from_config,
)
from accelerate_c.utils import DeepSpeedPlugin as UtilsPlugin
from timeouts import wait_s

theirs = pytest.importorskip("accelerate.utils")

DS_ENV = ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING",
          "ACCELERATE_DEEPSPEED_ZERO_STAGE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
          "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH",
          "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
          "ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_CONFIG_DS_FIELDS",
          "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "ACCELERATE_FP8_BACKEND", "ACCELERATE_MIXED_PRECISION",
          "WORLD_SIZE")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for k in DS_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))


# the ZeRO-2 example of transformers' DeepSpeed documentation, "auto" everywhere it allows
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


class Loader:
    def __init__(self, batch_size):
        self.batch_size = batch_size


# ---------------------------------------------------------------- the plugin, against accelerate's
PLUGIN_CASES = [
    {}, {"zero_stage": 1, "gradient_clipping": 1.0}, {"zero_stage": 2, "offload_optimizer_device": "cpu"},
    {"gradient_accumulation_steps": 4, "zero3_save_16bit_model": True}, {"zero_stage": 3, "zero3_init_flag": False},
    {"hf_ds_config": {"zero_optimization": {"stage": 1}, "gradient_clipping": "auto", "fp16": {"enabled": "auto"}}},
    {"hf_ds_config": {"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"}}},
     "zero_stage": 1, "offload_optimizer_device": "cpu", "gradient_clipping": 0.5},
]
FIELDS = ("zero_stage", "gradient_accumulation_steps", "gradient_clipping", "offload_optimizer_device",
          "offload_param_device", "zero3_init_flag", "zero3_save_16bit_model", "is_train_batch_min")


@pytest.mark.parametrize("kw", PLUGIN_CASES)
def test_plugin_builds_accelerates_config(kw):
    ours, ref = DeepSpeedPlugin(**kw), theirs.DeepSpeedPlugin(**kw)
    assert ours.deepspeed_config == ref.deepspeed_config
    assert {f: getattr(ours, f) for f in FIELDS} == {f: getattr(ref, f) for f in FIELDS}
    assert UtilsPlugin is DeepSpeedPlugin


def test_plugin_reads_accelerates_variables(monkeypatch, tmp_path):
    env = {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "3", "ACCELERATE_GRADIENT_CLIPPING": "0.7",
           "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
           "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ours, ref = DeepSpeedPlugin(), theirs.DeepSpeedPlugin()
    assert ours.deepspeed_config == ref.deepspeed_config and ours.deepspeed_config["gradient_clipping"] == 0.7
    # a config file through the variable, its "auto" filled from the other variables
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": "auto"}, "gradient_accumulation_steps": "auto"}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
    ours, ref = DeepSpeedPlugin(), theirs.DeepSpeedPlugin()
    assert ours.deepspeed_config == ref.deepspeed_config == {
        "zero_optimization": {"stage": 1}, "gradient_accumulation_steps": 3, "steps_per_print": float("inf")}
    assert ours.config_file == str(path)


@pytest.mark.parametrize("case", ["no_zero", "fields_clash"])
def test_plugin_errors_are_accelerates(monkeypatch, case):
    if case == "no_zero":
        kw, match = {"hf_ds_config": {"train_batch_size": 8}}, "zero_optimization"
    else:
        monkeypatch.setenv("ACCELERATE_CONFIG_DS_FIELDS", "deepspeed_config_file,zero_stage")
        kw, match = {"hf_ds_config": {"zero_optimization": {"stage": 2}}}, "zero_stage"
    with pytest.raises(ValueError):
        theirs.DeepSpeedPlugin(**kw)
    with pytest.raises(ValueError, match=match):
        DeepSpeedPlugin(**kw)


MP_CASES = [({}, "fp16"), ({}, "bf16"), ({}, "no"), ({"fp16": {"enabled": "auto"}}, "bf16"),
            ({"bf16": {"enabled": True}}, "no"), ({"fp16": {"enabled": False}}, "fp16"),
            ({"bf16": {"enabled": True}}, "fp16")]


@pytest.mark.parametrize("extra,mp", MP_CASES)
def test_mixed_precision_rules_are_accelerates(extra, mp):
    cfg = {"zero_optimization": {"stage": 2}, **extra}
    ours, ref = DeepSpeedPlugin(hf_ds_config=cfg), theirs.DeepSpeedPlugin(hf_ds_config=cfg)
    try:
        ref.set_mixed_precision(mp)
    except ValueError:
        with pytest.raises(ValueError, match="contradicts"):
            ours.set_mixed_precision(mp)
        with pytest.raises(ValueError, match="contradicts"):  # and so does the Accelerator's path
            resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg), mixed_precision=mp)
        return
    ours.set_mixed_precision(mp)
    assert ours.deepspeed_config == ref.deepspeed_config
    # what accelerate then reports as the mixed precision: the config's enabled section
    want = "fp16" if ref.deepspeed_config["fp16"]["enabled"] else ("bf16" if ref.deepspeed_config["bf16"]["enabled"]
                                                                    else "no")
    assert resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg), mixed_precision=mp).mixed_precision == want


# ---------------------------------------------------------------- "auto", as accelerate fills it
def test_auto_values_filled_as_accelerate_fills_them():
    """accelerate's _prepare_deepspeed fills from: the data loader's batch size, the accumulation
    steps, 1.0 for clipping, the model's hidden size, the DummyOptim and the DummyScheduler. The
    same fills, applied with accelerate's own plugin methods, give the same config."""
    world, accum, batch, hidden = 2, 3, 4, 8
    model = torch.nn.Linear(2, 2)
    model.config = type("Cfg", (), {"hidden_size": hidden})()
    cfg = dict(HF_ZERO2, zero_optimization=dict(HF_ZERO2["zero_optimization"], reduce_bucket_size="auto"),
               optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}})
    ref = theirs.DeepSpeedPlugin(hf_ds_config=cfg)
    ref.set_mixed_precision("bf16")
    ref.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=accum)
    opt = DummyOptim(model.parameters(), lr=0.01, weight_decay=0.1)
    sched = DummyScheduler(opt, total_num_steps=101, warmup_num_steps=5)
    ref.deepspeed_config_process(must_match=False, **{
        "gradient_clipping": 1.0, "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
        "train_micro_batch_size_per_gpu": batch, "train_batch_size": batch * accum * world,
        "zero_optimization.reduce_bucket_size": hidden * hidden,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "zero_optimization.stage3_param_persistence_threshold": 10 * hidden,
        "optimizer.params.lr": 0.01, "optimizer.params.weight_decay": 0.1,
        "scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": 0.01,
        "scheduler.params.warmup_num_steps": 5, "scheduler.params.total_num_steps": math.ceil(101 / world)})

    sharding = resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg), mixed_precision="bf16",
                                gradient_accumulation_steps=accum, num_processes=world)
    assert set(sharding.pending) >= {"train_micro_batch_size_per_gpu", "optimizer.params.lr"}
    done = fill_for_prepare(sharding, dataloaders=[Loader(batch), Loader(16)], model=model, optimizer=opt,
                            scheduler=sched)
    assert dict(done.config) == ref.deepspeed_config
    assert done.pending == () and done.micro_batch_size == batch and done.train_batch_size == batch * accum * world
    assert done.reduce_bucket_size == hidden * hidden and done.allgather_bucket_size == 200_000_000
    assert done.reduce_bucket_bytes(2) == 2 * hidden * hidden
    assert dict(done.optimizer.params) == {"lr": 0.01, "weight_decay": 0.1}
    assert done.scheduler.params["warmup_num_steps"] == 5 and done.gradient_clipping == 1.0
    assert done.mixed_precision == "bf16" and done.offload_optimizer == "cpu" and done.stage == 2


def test_micro_batch_rules():
    s = resolve_sharding(DeepSpeedPlugin(zero_stage=1), num_processes=2)
    assert fill_for_prepare(s, dataloaders=[Loader(8), Loader(4)]).micro_batch_size == 4
    assert fill_for_prepare(s, dataloaders=[Loader(8)], split_batches=True).micro_batch_size == 4
    s_max = resolve_sharding(DeepSpeedPlugin(zero_stage=1, is_train_batch_min=False))
    assert fill_for_prepare(s_max, dataloaders=[Loader(8), Loader(4)]).micro_batch_size == 8
    # accelerate's error, in meaning: "auto" needs a data loader in the same prepare() call
    with pytest.raises(ValueError, match="no(ne)? .*data loader|none was passed"):
        fill_for_prepare(s, model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="batch_size None"):
        fill_for_prepare(s, dataloaders=[Loader(None)])


@pytest.mark.parametrize("cfg,world,want", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4}, 2, (32, 4, 4)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),  # micro derived, as DeepSpeed
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 2, (12, 3, 2)),
])
def test_batch_sizes_follow_deepspeeds_rules(cfg, world, want):
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, **cfg}),
                         gradient_accumulation_steps=cfg["gradient_accumulation_steps"], num_processes=world)
    assert (s.train_batch_size, s.micro_batch_size, s.gradient_accumulation_steps) == want


def test_inconsistent_batch_sizes_name_the_three_values():
    cfg = {"zero_optimization": {"stage": 1}, "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
           "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError, match=r"train_batch_size=30 .*\(4\).*\(2\).*\(2\)"):
        resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=2, num_processes=2)
    # and when the micro batch size comes from the data loader at prepare()
    cfg.update(train_micro_batch_size_per_gpu="auto")
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=2, num_processes=2)
    with pytest.raises(ValueError, match=r"train_batch_size=30 .*\(5\)"):
        fill_for_prepare(s, dataloaders=[Loader(5)])


def test_accumulation_given_both_ways_takes_deepspeeds_with_a_warning():
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4})
    with pytest.warns(UserWarning, match="the Accelerator has 2, the DeepSpeed config has 4"):
        assert resolve_sharding(plugin, gradient_accumulation_steps=2).gradient_accumulation_steps == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_sharding(DeepSpeedPlugin(zero_stage=2), gradient_accumulation_steps=2
                                ).gradient_accumulation_steps == 2


@pytest.mark.parametrize("cfg,want", [({}, None), ({"gradient_clipping": 0}, None), ({"gradient_clipping": 2}, 2.0),
                                      ({"gradient_clipping": "auto"}, 1.0)])
def test_gradient_clipping(cfg, want):
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 1}, **cfg}))
    assert s.gradient_clipping == want
    # the field-built config clips at accelerate's default unless told otherwise
    assert resolve_sharding(DeepSpeedPlugin(zero_stage=1)).gradient_clipping == 1.0


def test_fp16_loss_scale_settings_map_onto_the_scaler():
    cfg = {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "initial_scale_power": 12,
                                                       "loss_scale_window": 500, "hysteresis": 1,
                                                       "min_loss_scale": 0.5}}
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg))
    assert s.mixed_precision == "fp16" and s.dynamic_loss_scale
    assert s.scaler_kwargs() == {"init_scale": 4096.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                 "growth_interval": 500}
    from accelerate_c.scaler import LossScaler

    scaler = LossScaler(**s.scaler_kwargs())
    assert scaler.get_scale() == 4096.0 and scaler.get_growth_interval() == 500
    assert [d.split("=")[0] for d in s.scaler_differences()] == ["min_loss_scale"]
    cfg["fp16"].update(loss_scale=128, hysteresis=2)
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg))
    assert not s.dynamic_loss_scale and s.scaler_kwargs()["init_scale"] == 128.0
    assert [d.split("=")[0] for d in s.scaler_differences()] == ["loss_scale", "hysteresis", "min_loss_scale"]
    # DeepSpeed's defaults when the section says only enabled
    s = resolve_sharding(DeepSpeedPlugin(zero_stage=2), mixed_precision="fp16")
    assert (s.initial_scale_power, s.loss_scale_window, s.hysteresis, s.min_loss_scale) == (16, 1000, 2, 1)


# ---------------------------------------------------------------- optimizer and scheduler blocks
def _prepared(cfg, optimizer, scheduler=None, model=None):
    model = model or torch.nn.Linear(3, 1)
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=dict(cfg, train_micro_batch_size_per_gpu=2)))
    return fill_for_prepare(s, model=model, optimizer=optimizer, scheduler=scheduler)


def test_dummy_contract():
    model = torch.nn.Linear(3, 1)
    real = torch.optim.SGD(model.parameters(), lr=0.1)
    block = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    plain = {"zero_optimization": {"stage": 2}}
    with pytest.raises(ValueError, match="optimizer block, and prepare.. got a real optimizer"):
        _prepared(block, real)
    with pytest.raises(ValueError, match="DummyOptim but the DeepSpeed config has no optimizer block"):
        _prepared(plain, DummyOptim(model.parameters()))
    sched_block = dict(plain, scheduler={"type": "WarmupLR", "params": {}})
    with pytest.raises(ValueError, match="scheduler block, and prepare.. got a real scheduler"):
        _prepared(sched_block, real, torch.optim.lr_scheduler.StepLR(real, 1))
    with pytest.raises(ValueError, match="DummyScheduler but the DeepSpeed config has no scheduler block"):
        _prepared(plain, real, DummyScheduler(real))
    assert _prepared(plain, real, DummyScheduler(real, lr_scheduler_callable=lambda o: None)).scheduler is None
    with pytest.raises(ValueError, match="must be a DummyScheduler"):
        _prepared(block, DummyOptim(model.parameters()), torch.optim.lr_scheduler.StepLR(real, 1))
    # accelerate's own Dummy objects are recognised too
    # accelerate.utils exports it only when deepspeed is installed
    from accelerate.utils.deepspeed import DummyOptim as TheirDummyOptim

    s = _prepared(block, TheirDummyOptim(model.parameters(), lr=0.02))
    assert s.optimizer.params["lr"] == 0.02


@pytest.mark.parametrize("block,cls,kw", [
    ({"type": "AdamW", "params": {"lr": 0.01, "betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}},
     torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)),
    # DeepSpeed's Adam runs in AdamW mode unless adam_w_mode is false; its weight_decay defaults to 0
    ({"type": "Adam", "params": {"lr": 0.01}}, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.0)),
    ({"type": "adam", "params": {"lr": 0.01, "adam_w_mode": False, "weight_decay": 0.1}}, torch.optim.Adam,
     dict(lr=0.01, weight_decay=0.1)),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}}, torch.optim.SGD,
     dict(lr=0.1, momentum=0.9, nesterov=True)),
])
def test_optimizer_block_builds_torch_optimizer(block, cls, kw):
    s = _prepared({"zero_optimization": {"stage": 1}, "optimizer": block},
                  DummyOptim(torch.nn.Linear(3, 1).parameters()))
    opt = build_optimizer(s.optimizer.block(), torch.nn.Linear(3, 1).parameters())
    assert type(opt) is cls
    for k, v in kw.items():
        assert opt.defaults[k] == v, k


def _run(kind, params, steps, base_lrs=(0.5,)):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": lr} for lr in base_lrs]
    opt = torch.optim.SGD(groups, lr=base_lrs[0])
    sched = build_scheduler({"type": kind, "params": params}, opt)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def _ds_lr(kind, p, it, group, base):
    """DeepSpeed's schedules as deepspeed/runtime/lr_schedules.py runs them today (WarmupCosineLR:
    every group at 0 before the first step, the cosine's progress clamped at 1), written out here."""
    w = max(2, p.get("warmup_num_steps", 1000))
    t = p.get("total_num_steps")
    log = p.get("warmup_type", "log") == "log"
    frac = (math.log(it + 1) / math.log(w) if log else it / w) if it >= 0 else None
    if kind == "WarmupCosineLR":
        if it < 0:
            return 0.0
        lo, cmin = p.get("warmup_min_ratio", 0.0), p.get("cos_min_ratio", 0.0001)
        if it < w:
            return base * (lo + frac * (1 - lo))
        progress = min(1.0, (it - w + 1) / max(1, t - w))
        return base * max(0.0, cmin + (1 - cmin) * 0.5 * (1 + math.cos(math.pi * progress)))
    lo, hi = p.get("warmup_min_lr", 0.0), p.get("warmup_max_lr", 0.001)
    if it < 0:
        return lo
    if it < w:
        return lo + (hi - lo) * frac
    if kind == "WarmupDecayLR":
        return lo + (hi - lo) * max(0.0, (t - it) / max(1.0, t - w))
    return hi


@pytest.mark.parametrize("kind,params", [
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 5}),
    ("WarmupLR", {"warmup_max_lr": 0.1, "warmup_num_steps": 4, "warmup_type": "linear"}),
    ("WarmupLR", {"warmup_num_steps": 1}),  # DeepSpeed warms up over at least 2 steps
    ("WarmupDecayLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.2, "warmup_num_steps": 3, "total_num_steps": 10}),
    ("WarmupCosineLR", {"total_num_steps": 12, "warmup_num_steps": 3, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05, "warmup_type": "linear"}),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_num_steps": 4}),  # 14 steps: past the end, held
    ("WarmupCosineLR", {"total_num_steps": 4, "warmup_num_steps": 4}),  # no cosine part: at the floor
])
def test_schedules_follow_deepspeeds_formulas(kind, params):
    bases = (0.5, 0.25)
    got = _run(kind, params, 14, bases)
    # the lr an optimizer step uses after n scheduler steps is DeepSpeed's at it = n - 1
    want = [[_ds_lr(kind, params, n - 1, g, b) for g, b in enumerate(bases)] for n in range(14)]
    flat = [lr for row in got for lr in row]
    assert flat == pytest.approx([lr for row in want for lr in row], rel=1e-12, abs=1e-15)


def test_scheduler_block_values_from_the_dummy_scheduler():
    model = torch.nn.Linear(3, 1)
    opt = DummyOptim(model.parameters(), lr=0.3)
    cfg = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                             "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=dict(cfg, train_micro_batch_size_per_gpu=1)), num_processes=3)
    s = fill_for_prepare(s, model=model, optimizer=opt, scheduler=DummyScheduler(opt, total_num_steps=10))
    assert dict(s.scheduler.params) == {"warmup_min_lr": 0, "warmup_max_lr": 0.3, "warmup_num_steps": 1,
                                        "total_num_steps": 4}
    real = build_optimizer(s.optimizer.block(), model.parameters())
    assert build_scheduler(s.scheduler.block(), real).get_last_lr() == [0]
    with pytest.raises(ValueError, match="scheduler.params.total_num_steps"):  # nothing fills it without a count
        fill_for_prepare(resolve_sharding(DeepSpeedPlugin(hf_ds_config=dict(cfg, train_micro_batch_size_per_gpu=1))),
                         model=model, optimizer=opt, scheduler=DummyScheduler(opt))


# ---------------------------------------------------------------- refusals
def _zero(**kw):
    return {"zero_optimization": {"stage": 2, **kw}}


REFUSALS = [
    (_zero(offload_optimizer={"device": "nvme", "nvme_path": "/nvme"}),
     "zero_optimization.offload_optimizer.device='nvme'", DeepSpeedFeatureError),
    (_zero(offload_optimizer={"device": "cpu", "nvme_path": "/local_nvme"}),
     "zero_optimization.offload_optimizer.nvme_path='/local_nvme'", DeepSpeedFeatureError),
    (_zero(offload_optimizer={"device": "cpu", "buffer_count": 4}),
     "zero_optimization.offload_optimizer.buffer_count", DeepSpeedFeatureError),
    (_zero(offload_param={"device": "nvme"}), "zero_optimization.offload_param.device='nvme'", DeepSpeedFeatureError),
    (_zero(offload_param={"device": "cpu"}), "zero_optimization.offload_param.device='cpu': parameter offload at "
                                             "ZeRO stage 2", DeepSpeedFeatureError),
    ({**_zero(), "aio": {"block_size": 1048576}}, "aio=", DeepSpeedFeatureError),
    (_zero(zero_quantized_weights=True), "zero_optimization.zero_quantized_weights=True", DeepSpeedFeatureError),
    (_zero(zero_quantized_gradients=True), "zero_optimization.zero_quantized_gradients=True", DeepSpeedFeatureError),
    (_zero(zero_hpz_partition_size=8), "zero_optimization.zero_hpz_partition_size=8", DeepSpeedFeatureError),
    (_zero(mics_shard_size=4), "zero_optimization.mics_shard_size=4", DeepSpeedFeatureError),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage=4: unknown ZeRO stage", DeepSpeedConfigError),
    ({"zero_optimization": {"stage": True}}, "zero_optimization.stage=True", DeepSpeedConfigError),
    (_zero(cpu_offload=True), "zero_optimization.cpu_offload=True", DeepSpeedFeatureError),
    (_zero(reduce_bucket_sizes=5), "unknown key 'zero_optimization.reduce_bucket_sizes'", DeepSpeedConfigError),
    ({**_zero(), "train_batch_sizes": 8}, "unknown key 'train_batch_sizes'", DeepSpeedConfigError),
    ({**_zero(), "tensor_parallel": {"autotp_size": 2}}, "tensor_parallel=", DeepSpeedFeatureError),
    ({**_zero(), "pipeline": {"stages": 2}}, "pipeline=", DeepSpeedFeatureError),
    ({**_zero(), "moe": {"enabled": True}}, "moe=", DeepSpeedFeatureError),
    ({**_zero(), "tensorboard": {"enabled": True}}, "tensorboard.enabled=True", DeepSpeedFeatureError),
    ({**_zero(), "optimizer": {"type": "Lamb", "params": {}}}, "optimizer.type='Lamb'", DeepSpeedFeatureError),
    ({**_zero(), "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
     "optimizer.params.max_grad_norm", DeepSpeedConfigError),
    ({**_zero(), "optimizer": {"type": "AdamW", "params": {"lr": "auto", "amsgrad": True}}},
     "optimizer.params.amsgrad=True", DeepSpeedFeatureError),
    ({**_zero(), "scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type='OneCycle'", DeepSpeedFeatureError),
    ({**_zero(), "scheduler": {"type": "WarmupDecayLR", "params": {}}}, "scheduler.params.total_num_steps",
     DeepSpeedConfigError),
    ({**_zero(), "scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cosine"}}},
     "scheduler.params.warmup_type='cosine'", DeepSpeedConfigError),
    ({**_zero(), "fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     "fp16.fp16_master_weights_and_grads=True", DeepSpeedFeatureError),
    ({**_zero(), "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true", ValueError),
    ({**_zero(), "bfloat16": {"enabled": True}}, "bfloat16=", DeepSpeedConfigError),
    ({**_zero(), "communication_data_type": "fp32"}, "communication_data_type='fp32'", DeepSpeedFeatureError),
    ({**_zero(), "fp16": {"loss_scale_window": "auto"}}, "fp16.loss_scale_window='auto': nothing fills",
     DeepSpeedConfigError),
    ({**_zero(), "train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu=0: out of range",
     DeepSpeedConfigError),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload without ZeRO", DeepSpeedFeatureError),
]


@pytest.mark.parametrize("cfg,match,error", REFUSALS, ids=[m[:40] for _, m, _ in REFUSALS])
def test_refusals_name_the_key_and_the_file(tmp_path, cfg, match, error):
    with pytest.raises(error, match=_re(match)):
        resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg))
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(error, match=_re(str(path))):
        resolve_sharding(DeepSpeedPlugin(hf_ds_config=str(path)))
    with pytest.raises(error, match=_re(match)):  # accelerate's own plugin goes through the same checks
        resolve_sharding(theirs.DeepSpeedPlugin(hf_ds_config=cfg))


def _re(text):
    import re

    return re.escape(text)


def test_moe_and_fp8_are_refused(monkeypatch):
    with pytest.raises(DeepSpeedFeatureError, match="transformer_moe_cls_names='MixtralSparseMoeBlock'"):
        resolve_sharding(DeepSpeedPlugin(transformer_moe_cls_names="MixtralSparseMoeBlock"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", "JetMoEBlock")
    with pytest.raises(DeepSpeedFeatureError, match="ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES='JetMoEBlock'"):
        resolve_sharding(DeepSpeedPlugin())
    monkeypatch.delenv("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES")
    with pytest.raises(DeepSpeedFeatureError, match="msamp="):
        resolve_sharding(DeepSpeedPlugin(enable_msamp=True))


def test_keys_that_change_nothing_are_accepted():
    cfg = dict(HF_ZERO2, wall_clock_breakdown=True, memory_breakdown=False, dump_state=False,
               zero_allow_untested_optimizer=True, tensorboard={"enabled": False, "output_path": "x"},
               flops_profiler={"enabled": False}, activation_checkpointing={"partition_activations": False},
               checkpoint={"tag_validation": "Warn"}, prescale_gradients=False, gradient_predivide_factor=1.0)
    cfg["zero_optimization"] = dict(cfg["zero_optimization"], round_robin_gradients=True,
                                    stage3_gather_16bit_weights_on_model_save=True, sub_group_size=1e9,
                                    zero_quantized_weights=False, zero_hpz_partition_size=1)
    s = resolve_sharding(DeepSpeedPlugin(hf_ds_config=cfg))
    assert (s.overlap_comm, s.contiguous_gradients, s.reduce_scatter) == (True, True, True)
    assert s.stage == 2 and s.offload_optimizer == "cpu" and s.offload_optimizer_pin_memory


# ---------------------------------------------------------------- the Accelerator
def test_accelerator_runs_stages_1_2_and_3_and_checks_the_rest(tmp_path):
    for stage in (1, 2, 3):
        for plugin in (DeepSpeedPlugin(zero_stage=stage), theirs.DeepSpeedPlugin(zero_stage=stage)):
            acc = Accelerator(cpu=True, deepspeed_plugin=plugin)
            assert acc.distributed_type == DistributedType.DEEPSPEED and acc.sharding.stage == stage
            assert acc.deepspeed_plugin is plugin
            assert acc.sharding.gradient_clipping == 1.0  # accelerate's "auto"
    acc = Accelerator(cpu=True, mixed_precision="fp16",
                      deepspeed_plugins={"a": DeepSpeedPlugin(zero_stage=3), "b": DeepSpeedPlugin()})
    assert (acc.sharding.stage, acc.sharding.mixed_precision) == (3, "fp16")  # the first plugin is the active one
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero(offload_optimizer={"device": "nvme"})))
    with pytest.raises(DeepSpeedFeatureError, match=_re(f"DeepSpeed config {path}: zero_optimization.offload_optimizer"
                                                        ".device='nvme'")):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=str(path)))
    with pytest.raises(ValueError, match="both"):
        Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(), deepspeed_plugins=DeepSpeedPlugin())
    with pytest.raises(TypeError, match=r"deepspeed_plugin\[.*expected a DeepSpeedPlugin"):  # a dict: named plugins
        Accelerator(cpu=True, deepspeed_plugin={"zero_optimization": {"stage": 2}})
    assert Accelerator(cpu=True).deepspeed_plugin is None


def test_accelerator_builds_the_plugin_from_the_launchers_variables(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert Accelerator(cpu=True).sharding.stage == 3
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    assert Accelerator(cpu=True).sharding.stage == 2
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "3")
    acc = Accelerator(cpu=True)
    assert (acc.sharding.stage, acc.gradient_accumulation_steps) == (1, 3)
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "nvme")
    with pytest.raises(DeepSpeedFeatureError, match="offload_optimizer.device='nvme'"):
        Accelerator(cpu=True)


def test_sharding_from_config_refuses_what_the_engine_does_not_run():
    assert sharding_from_config(DeepSpeedPlugin(zero_stage=1)).stage == 1
    assert sharding_from_config(DeepSpeedPlugin(zero_stage=2)).stage == 2
    assert sharding_from_config(DeepSpeedPlugin(zero_stage=3)).stage == 3
    assert sharding_from_config(DeepSpeedPlugin(zero_stage=3), mixed_precision="fp16").mixed_precision == "fp16"
    with pytest.raises(NotImplementedError, match="stage 0"):
        sharding_from_config(DeepSpeedPlugin(zero_stage=0))


# ---------------------------------------------------------------- TrainingArguments(deepspeed=...)
def test_training_args_fill_as_transformers_does(tmp_path):
    from accelerate_c.training_args import deepspeed_plugin

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO2))
    args = TrainingArguments(deepspeed=str(path), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             learning_rate=3e-4, adam_beta1=0.8, weight_decay=0.01, max_grad_norm=0.5, bf16=True)
    assert args.deepspeed == HF_ZERO2  # the arguments keep the file's content, "auto" and all
    cfg = deepspeed_plugin(args).deepspeed_config
    assert (cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"], cfg["train_batch_size"],
            cfg["gradient_clipping"]) == (4, 2, 8, 0.5)
    assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert cfg["scheduler"]["params"]["warmup_max_lr"] == 3e-4 and cfg["scheduler"]["params"]["warmup_min_lr"] == 0
    assert cfg["bf16"]["enabled"] is True and cfg["fp16"]["enabled"] is False
    acc = Accelerator.from_training_args(args, cpu=True)
    assert acc.distributed_type == DistributedType.DEEPSPEED and acc.deepspeed_plugin.zero_stage == 2
    # the Trainer's last fills, once the number of steps is known
    fill_from_training_steps(cfg, args, torch.nn.Linear(1, 1), num_training_steps=100)
    assert cfg["scheduler"]["params"]["warmup_num_steps"] == 0


def test_training_args_mismatch_lists_every_value(tmp_path):
    cfg = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 16, "gradient_clipping": 2.0}
    args = TrainingArguments(deepspeed=cfg, per_device_train_batch_size=4)
    with pytest.raises(ValueError, match=r"(?s)train_micro_batch_size_per_gpu=16 vs .*per_device_train_batch_size=4"
                                         r".*gradient_clipping=2.0 vs .*max_grad_norm=1.0"):
        Accelerator.from_training_args(args, cpu=True)


# ---------------------------------------------------------------- config files and the launcher
def _resolve(argv):
    args = build_parser().parse_args(["launch", *argv, "script.py"])
    values = launch_cmd.resolve(args)
    return values, launch_cmd.build_env(args, values)


def _accelerates_env(argv):
    """What accelerate 1.15's launcher exports for the same command (its own functions)."""
    cmds = pytest.importorskip("accelerate.commands.launch")
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = cmds.launch_command_parser().parse_args([*argv, "script.py"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args, defaults, mp_from_config = cmds._validate_launch_command(args)
    assert args.use_deepspeed
    fields = list(defaults.deepspeed_config.keys()) if defaults else []  # as its launch_command computes them
    args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
    return prepare_deepspeed_cmd_env(args)[1]


def _ds_vars(env):
    return {k: v for k, v in env.items() if k.startswith(("ACCELERATE_DEEPSPEED", "ACCELERATE_GRADIENT",
                                                          "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_CONFIG_DS"))}


LAUNCH_CASES = [
    (["--use_deepspeed", "--zero_stage", "1", "--gradient_clipping", "0.5", "--offload_optimizer_device", "cpu"], None),
    (["--use_deepspeed", "--gradient_accumulation_steps", "4", "--zero3_init_flag", "false"], None),
    (["--use_deepspeed", "--deepspeed_config_file", "ds.json"], None),
    ([], "distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config:\n  zero_stage: 1\n"
         "  gradient_accumulation_steps: 2\n  gradient_clipping: 1.0\n  offload_optimizer_device: cpu\n"
         "  offload_param_device: none\n  zero3_init_flag: false\nmixed_precision: bf16\n"),
    (["--zero_stage", "2"], "distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config:\n"
                            "  deepspeed_config_file: ds.json\n  zero3_init_flag: false\n"),
    # parameter offload to the CPU at stage 3: taken from the config file as from a DeepSpeed JSON
    ([], "distributed_type: DEEPSPEED\nnum_processes: 1\ndeepspeed_config:\n  zero_stage: 3\n"
         "  offload_param_device: cpu\n  zero3_init_flag: false\n  zero3_save_16bit_model: true\n"),
    (["--use_deepspeed", "--zero_stage", "3", "--offload_param_device", "cpu"], None),
]


@pytest.mark.parametrize("argv,config_text", LAUNCH_CASES)
def test_launcher_exports_accelerates_variables(tmp_path, argv, config_text):
    if config_text is not None:
        path = tmp_path / "c.yaml"
        path.write_text(config_text)
        argv = ["--config_file", str(path), *argv]
    values, env = _resolve(argv)
    assert values["distributed_type"] == "DEEPSPEED"
    assert _ds_vars(env) == _ds_vars(_accelerates_env(argv))
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"


def _plugins_from_config_file(tmp_path, monkeypatch, text):
    """Ours and accelerate's DeepSpeedPlugin() from the variables `accelerate-c launch` exports for
    a config file holding `text` (set in this process's environment); and the file's path."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    _, env = _resolve(["--config_file", str(path)])
    for k, v in _ds_vars(env).items():
        monkeypatch.setenv(k, v)
    return DeepSpeedPlugin(), theirs.DeepSpeedPlugin(), path


def test_config_file_parameter_offload_at_stage_3_reaches_the_plugin(tmp_path, monkeypatch):
    """offload_param_device: cpu at zero_stage 3 in the config file: accelerate's plugin from the
    exported variables, and an Accelerator on a CPU process that trains with it (the shards are
    in host memory already)."""
    ours, ref, _ = _plugins_from_config_file(tmp_path, monkeypatch, LAUNCH_CASES[5][1])
    assert ours.deepspeed_config == ref.deepspeed_config
    assert ours.deepspeed_config["zero_optimization"]["offload_param"]["device"] == "cpu"
    acc = Accelerator(cpu=True, deepspeed_plugin=ours)
    model = torch.nn.Linear(4, 3)
    ref_model = torch.nn.Linear(4, 3)
    ref_model.load_state_dict(model.state_dict())
    data = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
    model, opt, dl = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 torch.utils.data.DataLoader(data, batch_size=2))
    for x in dl:
        acc.backward(model(x).sum())
        opt.step()
        opt.zero_grad()
    # the same in plain torch: SGD, clipped at gradient_clipping ("auto": accelerate's 1.0)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    for x in data.split(2):
        ref_model(x).sum().backward()
        torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
    full = acc.get_state_dict(model)
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(full[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_config_file_fields_reach_the_plugin(tmp_path, monkeypatch):
    """The variables a DEEPSPEED config file exports build the plugin accelerate builds."""
    ours, ref, path = _plugins_from_config_file(tmp_path, monkeypatch, LAUNCH_CASES[3][1])
    assert ours.deepspeed_config == ref.deepspeed_config
    assert ours.deepspeed_config["zero_optimization"]["stage"] == 1 and ours.gradient_accumulation_steps == 2
    # with a deepspeed_config_file, the other settings of the config file are refused (accelerate's rule)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    path.write_text(LAUNCH_CASES[3][1].replace("deepspeed_config:\n", f"deepspeed_config:\n  deepspeed_config_file: "
                                                                     f"{tmp_path / 'ds.json'}\n"))
    _, env = _resolve(["--config_file", str(path)])
    for k, v in _ds_vars(env).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="next to deepspeed_config_file"):
        DeepSpeedPlugin()


@pytest.mark.parametrize("extra,argv,msg", [
    ("deepspeed_config: {offload_optimizer_device: nvme}", [], "NVMe offload"),
    ("deepspeed_config: {offload_param_device: cpu}", [], "parameter offload needs ZeRO stage 3"),
    ("deepspeed_config: {offload_param_device: cpu, zero_stage: 3}", ["--zero_stage", "1"], "at zero_stage 1"),
    ("deepspeed_config: {offload_param_device: nvme, zero_stage: 3}", [], "NVMe offload"),
    ("deepspeed_config: {deepspeed_moe_layer_cls_names: MixtralSparseMoeBlock}", [], "mixture of experts"),
    ("", ["--offload_optimizer_device", "nvme"], "NVMe offload"),
    ("", ["--zero_stage", "5"], "--zero_stage must be 0, 1, 2 or 3"),
    ("", ["--zero3_init_flag", "maybe"], "--zero3_init_flag takes true or false"),
    ("num_machines: 2\nmain_process_ip: h\nmain_process_port: 1", [], "deepspeed_multinode_launcher"),
])
def test_launcher_refusals(tmp_path, extra, argv, msg):
    path = tmp_path / "c.yaml"
    path.write_text(f"distributed_type: DEEPSPEED\nnum_processes: 2\n{extra}\n")
    with pytest.raises(SystemExit, match=msg):
        _resolve(["--config_file", str(path), *argv])


def test_deepspeed_section_is_ignored_without_deepspeed(tmp_path):
    path = tmp_path / "c.yaml"  # as accelerate's launcher: read only under distributed_type DEEPSPEED
    path.write_text("distributed_type: MULTI_CPU\nnum_processes: 2\n"
                    "deepspeed_config: {offload_optimizer_device: nvme}\n")
    values, env = _resolve(["--config_file", str(path)])
    assert values["distributed_type"] == "MULTI_CPU" and not _ds_vars(env)


def test_launched_script_gets_the_config_files_deepspeed(tmp_path):
    """End to end: a DEEPSPEED config file, `accelerate-c launch`, and Accelerator() in the
    script reading the exported variables."""
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: DEEPSPEED\nnum_processes: 1\nuse_cpu: true\n"
                    "deepspeed_config: {zero_stage: 2, gradient_accumulation_steps: 2}\n")
    script = tmp_path / "s.py"
    script.write_text("from accelerate_c import Accelerator\na = Accelerator()\n"
                      "print(a.distributed_type, a.sharding.stage, a.gradient_accumulation_steps)\n")
    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    res = subprocess.run([exe, "launch", "--config_file", str(path), str(script)], capture_output=True, text=True,
                         timeout=wait_s(120), env=dict(os.environ, HF_HOME=str(tmp_path / "hf")))
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["DistributedType.DEEPSPEED", "2", "2"], res.stdout
