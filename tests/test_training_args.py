"""TrainingArguments: transformers' defaults, validation naming the field, dict / JSON / YAML
loading, and field by field what each one changes in the Accelerator (or the Trainer's data
loaders and optimizer) that Accelerator.from_training_args / create_accelerator builds."""
from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch

from accelerate_c import Accelerator, Trainer, TrainingArguments, create_accelerator
from accelerate_c.training_args import load_training_args
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)

# transformers' TrainingArguments defaults for the fields accelerate_c supports
TRANSFORMERS_DEFAULTS = dict(
    overwrite_output_dir=False, do_train=False, do_eval=False, eval_strategy="no", per_device_train_batch_size=8,
    per_device_eval_batch_size=8, gradient_accumulation_steps=1, learning_rate=5e-5, weight_decay=0.0,
    adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, num_train_epochs=3.0, max_steps=-1,
    lr_scheduler_type="linear", warmup_ratio=0.0, warmup_steps=0, logging_strategy="steps", logging_steps=500,
    save_strategy="steps", save_steps=500, save_total_limit=None, eval_steps=None, seed=42, data_seed=None,
    fp16=False, bf16=False, fsdp="", fsdp_config=None, deepspeed=None, ddp_backend=None,
    ddp_find_unused_parameters=None, ddp_bucket_cap_mb=None, ddp_broadcast_buffers=None, ddp_timeout=1800,
    dataloader_pin_memory=True, dataloader_num_workers=0, dataloader_drop_last=False, resume_from_checkpoint=None,
    disable_tqdm=False, remove_unused_columns=True, logging_first_step=False, optim="adamw_torch",
    load_best_model_at_end=False, metric_for_best_model=None, save_safetensors=True, use_cpu=False,
    train_sampling_strategy="random", length_column_name="length",
)


def test_defaults_are_transformers():
    args = TrainingArguments()
    for name, value in TRANSFORMERS_DEFAULTS.items():
        assert getattr(args, name) == value, name
    assert args.output_dir == "trainer_output" and args.report_to == []
    assert args.accelerator_config == {"split_batches": False, "dispatch_batches": None, "even_batches": True,
                                       "use_seedable_sampler": True, "non_blocking": False,
                                       "gradient_accumulation_kwargs": None, "use_configured_state": False}


def test_default_accelerator():
    acc = Accelerator.from_training_args(TrainingArguments(output_dir="x"))
    assert acc.gradient_accumulation_steps == 1 and acc.mixed_precision == "no"
    assert acc.use_seedable_sampler and not acc.split_batches and acc.even_batches and not acc.non_blocking
    assert acc.dataloader_config.data_seed is None
    assert acc.ddp_handler is None and acc.init_handler.timeout == timedelta(seconds=1800)
    assert acc.project_dir == "x"


def _acc(**kw):
    return Accelerator.from_training_args(TrainingArguments(output_dir="out", **kw))


@pytest.mark.parametrize("kw,check", [
    (dict(gradient_accumulation_steps=4), lambda a: a.gradient_accumulation_steps == 4),
    (dict(accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 3}}),
     lambda a: a.gradient_accumulation_steps == 3),
    (dict(accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True, "adjust_scheduler": False,
                                                               "sync_with_dataloader": False}}),
     lambda a: a.gradient_state.sync_each_batch and not a.gradient_state.adjust_scheduler
     and not a.gradient_state.sync_with_dataloader),
    (dict(accelerator_config={"split_batches": True}), lambda a: a.split_batches),
    (dict(accelerator_config={"even_batches": False}), lambda a: not a.even_batches),
    (dict(accelerator_config={"use_seedable_sampler": False}), lambda a: not a.use_seedable_sampler),
    (dict(accelerator_config={"non_blocking": True}), lambda a: a.non_blocking),
    (dict(data_seed=7), lambda a: a.dataloader_config.data_seed == 7),
    (dict(bf16=True), lambda a: a.mixed_precision == "bf16" and a.scaler is None),
    (dict(fp16=True), lambda a: a.mixed_precision == "fp16" and a.scaler is not None),
    (dict(use_cpu=True), lambda a: a.device.type == "cpu"),
    (dict(ddp_find_unused_parameters=True), lambda a: a.ddp_handler.find_unused_parameters),
    (dict(ddp_bucket_cap_mb=50), lambda a: a.ddp_handler.bucket_cap_mb == 50),
    (dict(ddp_broadcast_buffers=False), lambda a: a.ddp_handler.broadcast_buffers is False),
    (dict(ddp_timeout=60), lambda a: a.init_handler.timeout == timedelta(seconds=60)),
    (dict(ddp_backend="gloo"), lambda a: a.init_handler.backend == "gloo"),
    (dict(save_on_each_node=True), lambda a: a.project_configuration.save_on_each_node),
    (dict(logging_dir="logs"), lambda a: a.logging_dir == "logs"),
], ids=lambda v: json.dumps(v, default=str) if isinstance(v, dict) else "")
def test_field_changes_the_accelerator(kw, check):
    assert check(_acc(**kw))


@pytest.mark.parametrize("report_to", ["none", [], ["none"]])
def test_no_tracker_spellings_build_an_accelerator(report_to):
    args = TrainingArguments(output_dir="out", report_to=report_to)
    assert args.report_to == []  # the three spellings of "no tracker"
    assert isinstance(Accelerator.from_training_args(args), Accelerator)


def test_mixed_precision_unset_leaves_the_launcher_setting(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate-c launch --mixed_precision` sets
    assert _acc().mixed_precision == "bf16"
    assert _acc(fp16=True).mixed_precision == "fp16"


def test_fsdp_training_args_turn_full_sharding_on():
    """TrainingArguments(fsdp=..., fsdp_config=...) by transformers' rules (the settings themselves
    are held to transformers + accelerate in tests/test_fsdp.py)."""
    acc = Accelerator.from_training_args(TrainingArguments(output_dir="out", fsdp=["full_shard", "auto_wrap"],
                                                           fsdp_config={"transformer_layer_cls_to_wrap": "Block"}))
    assert acc.distributed_type == "FSDP" and acc.is_fsdp2
    assert acc.state.fsdp_plugin.transformer_cls_names_to_wrap == ["Block"]


@pytest.mark.parametrize("kw,error,match", [
    (dict(fsdp="full_shard hybrid_shard"), NotImplementedError, "hybrid_shard"),
    (dict(report_to="neptune"), NotImplementedError, "'neptune' is not among accelerate_c's trackers"),
    (dict(report_to=["tensorboard", "azure_ml"]), NotImplementedError, "'azure_ml' is not among"),
    (dict(accelerator_config={"use_configured_state": True}), NotImplementedError, "use_configured_state"),
    (dict(gradient_accumulation_steps=2, accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 3}}),
     ValueError, "set only one"),
])
def test_unsupported_features_raise_when_the_accelerator_is_built(kw, error, match):
    args = TrainingArguments(output_dir="out", **kw)  # valid arguments ...
    with pytest.raises(error, match=match):  # ... that the Accelerator cannot run yet
        Accelerator.from_training_args(args)


def test_fp16_with_a_deepspeed_stage_3_config_runs_deepspeeds_loss_scaler():
    args = TrainingArguments(output_dir="out", fp16=True,
                             deepspeed={"zero_optimization": {"stage": 3}, "fp16": {"enabled": "auto"}})
    acc = Accelerator.from_training_args(args)
    assert (acc.sharding.stage, acc.mixed_precision) == (3, "fp16")
    assert type(acc.scaler).__name__ == "DeepSpeedScaler"


def test_dispatch_batches_reaches_the_accelerator():
    acc = Accelerator.from_training_args(TrainingArguments(output_dir="out", accelerator_config={"dispatch_batches": True}))
    assert acc.dataloader_config.dispatch_batches is True


@pytest.mark.parametrize("name,value,match", [
    ("per_device_train_batch_size", 0, "must be >= 1"),
    ("per_device_eval_batch_size", 2.5, "expected an integer"),
    ("gradient_accumulation_steps", True, "expected an integer"),
    ("learning_rate", -1.0, "must be"),
    ("learning_rate", "fast", "finite number"),
    ("weight_decay", float("nan"), "finite number"),
    ("adam_beta1", 1.0, "must be"),
    ("adam_beta2", -0.1, "must be"),
    ("adam_epsilon", -1e-8, "must be"),
    ("max_grad_norm", -1, "must be"),
    ("num_train_epochs", -1, "must be"),
    ("max_steps", 0, "positive integer, or -1"),
    ("warmup_ratio", 1.5, "must be"),
    ("warmup_steps", -1, "whole number of steps >= 0"),
    ("lr_scheduler_type", "reduce_lr_on_plateau", "needs an eval_strategy other than 'no'"),
    ("lr_scheduler_type", "greedy", "needs an eval_strategy other than 'no'"),
    ("lr_scheduler_kwargs", {"factor": 2.0}, "takes no argument 'factor'"),
    ("train_sampling_strategy", "batch_rebalance", "not supported yet"),
    ("train_sampling_strategy", "by_length", "choose from"),
    ("length_column_name", None, "column name"),
    ("lr_scheduler_type", "linearr", "choose from"),
    ("eval_strategy", "sometimes", "choose from"),
    ("logging_strategy", "hourly", "choose from"),
    ("save_strategy", "always", "choose from"),
    ("logging_steps", 0, "integer > 0"),
    ("save_steps", 2.5, "whole number"),
    ("eval_steps", -5, "integer > 0"),
    ("save_total_limit", 0, "integer >= 1"),
    ("seed", "42x", "expected an integer"),
    ("data_seed", 1.5, "None or an integer"),
    ("fp16", "yes", "true/false"),
    ("ddp_backend", "mpi", "not supported yet"),
    ("ddp_backend", "tcp", "choose from"),
    ("ddp_timeout", 0, "must be >= 1"),
    ("ddp_bucket_cap_mb", 0, "integer >= 1"),
    ("ddp_find_unused_parameters", "no", "true/false"),
    ("dataloader_num_workers", -1, "must be >= 0"),
    ("dataloader_prefetch_factor", 2, "dataloader_num_workers > 0"),
    ("dataloader_pin_memory", 1, "true/false"),
    ("fsdp", 3, "FSDP options"),
    ("fsdp_config", "/nonexistent/fsdp.json", "does not exist"),
    ("deepspeed", "/nonexistent/ds.json", "does not exist"),
    ("deepspeed", 5, "path to a JSON file or a mapping"),
    ("accelerator_config", {"split_batch": True}, "unknown key 'split_batch'"),
    ("accelerator_config", {"even_batches": "no"}, "even_batches must be true/false"),
    ("accelerator_config", {"gradient_accumulation_kwargs": {"steps": 2}}, "unknown key 'steps'"),
    ("accelerator_config", {"gradient_accumulation_kwargs": {"num_steps": 0}}, "num_steps must be"),
    ("report_to", 5, "integration name"),
    ("optim", "adafactor", "choose from"),
    ("lr_scheduler_kwargs", {"power": 2}, "takes no argument 'power'"),
    ("label_names", "labels", "list of names"),
])
def test_bad_values_name_the_field(name, value, match):
    with pytest.raises(ValueError, match=match) as e:
        TrainingArguments(output_dir="out", **{name: value})
    assert f"TrainingArguments.{name}" in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ValueError, match="TrainingArguments.fp16: fp16 and bf16"):
        TrainingArguments(fp16=True, bf16=True)
    with pytest.raises(ValueError, match="load_best_model_at_end.*match"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="steps")
    with pytest.raises(ValueError, match="multiple of"):
        TrainingArguments(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, save_steps=10)
    a = TrainingArguments(eval_strategy="steps", logging_steps=7)
    assert a.eval_steps == 7 and a.do_eval  # transformers: eval_steps defaults to logging_steps
    assert TrainingArguments(metric_for_best_model="accuracy").greater_is_better is True
    assert TrainingArguments(metric_for_best_model="loss").greater_is_better is False
    assert TrainingArguments(metric_for_best_model="eval_my_loss").greater_is_better is False  # "...loss"
    # the metric-driven schedules: metric_for_best_model defaults to "loss"; their kwargs checked up front
    a = TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch")
    assert a.metric_for_best_model == "loss" and a.greater_is_better is False
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs: 'greedy': .*factor must be < 1.0"):
        TrainingArguments(lr_scheduler_type="greedy", eval_strategy="epoch", lr_scheduler_kwargs={"factor": 1.5})
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs: 'reduce_lr_on_plateau': .*mode"):
        TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch",
                          lr_scheduler_kwargs={"mode": "lowest"})
    with pytest.raises(ValueError, match="decay_type must be one of linear, cosine, 1-sqrt, got 'exp'"):
        TrainingArguments(lr_scheduler_type="warmup_stable_decay",
                          lr_scheduler_kwargs={"num_decay_steps": 3, "decay_type": "exp"})
    with pytest.raises(ValueError, match="lr_scheduler_kwargs: 'warmup_stable_decay' needs num_decay_steps"):
        TrainingArguments(lr_scheduler_type="warmup_stable_decay")
    with pytest.raises(ValueError, match="num_stable_steps must be a whole number"):
        TrainingArguments(lr_scheduler_type="warmup_stable_decay",
                          lr_scheduler_kwargs={"num_decay_steps": 3, "num_stable_steps": -1})
    with pytest.raises(ValueError, match="exactly one of min_lr / min_lr_rate"):
        TrainingArguments(lr_scheduler_type="cosine_warmup_with_min_lr")
    assert TrainingArguments(warmup_ratio=0.1).get_warmup_steps(95) == 10
    assert TrainingArguments(warmup_ratio=0.1, warmup_steps=3).get_warmup_steps(95) == 3


def test_from_dict_json_yaml(tmp_path):
    d = {"output_dir": str(tmp_path), "learning_rate": 1e-3, "gradient_accumulation_steps": 2, "bf16": True,
         "accelerator_config": {"split_batches": True}, "ddp_timeout": 99}
    a = TrainingArguments.from_dict(d)
    (tmp_path / "a.json").write_text(json.dumps(d))
    b = TrainingArguments.from_json_file(tmp_path / "a.json")
    # YAML 1.1 reads 1e-3 as a string: numeric fields take numbers written that way
    (tmp_path / "a.yaml").write_text(f"output_dir: {tmp_path}\nlearning_rate: 1e-3\ngradient_accumulation_steps: 2\n"
                                     "bf16: true\naccelerator_config:\n  split_batches: true\nddp_timeout: 99\n")
    c = TrainingArguments.from_yaml_file(str(tmp_path / "a.yaml"))
    assert a == b == c == load_training_args(str(tmp_path / "a.yaml")) == load_training_args(d)
    assert a.learning_rate == 1e-3 and a.accelerator_config["split_batches"]
    acc = create_accelerator(str(tmp_path / "a.json"))
    assert acc.gradient_accumulation_steps == 2 and acc.mixed_precision == "bf16" and acc.split_batches
    assert TrainingArguments.from_dict(a.to_dict()) == a  # round trip
    assert json.loads(a.to_json_string())["learning_rate"] == 1e-3


def test_from_dict_errors_and_transformers_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown field 'learning_rat'; did you mean 'learning_rate'"):
        TrainingArguments.from_dict({"learning_rat": 1.0})
    # a transformers training-mechanics field accelerate_c has no feature for: fine at its
    # default, refused by name otherwise; any other transformers field is carried, with a warning
    TrainingArguments.from_dict({"push_to_hub": False, "hub_strategy": "every_save", "jit_mode_eval": False})
    with pytest.raises(ValueError, match="jit_mode_eval=True.*not supported yet"):
        TrainingArguments.from_dict({"jit_mode_eval": True})
    with pytest.warns(UserWarning, match="carried but ignored: push_to_hub=True$"):
        assert TrainingArguments.from_dict({"push_to_hub": True}).carried == {"push_to_hub": True}
    assert TrainingArguments.from_dict({"evaluation_strategy": "epoch"}).eval_strategy == "epoch"
    # transformers 4's group_by_length: 5.23 has no such field; False (an old to_dict) is carried
    TrainingArguments.from_dict({"group_by_length": False})
    with pytest.raises(ValueError, match="group_by_length=True.*train_sampling_strategy='group_by_length'"):
        TrainingArguments.from_dict({"group_by_length": True})
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot be parsed"):
        TrainingArguments.from_json_file(tmp_path / "bad.json")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        TrainingArguments.from_yaml_file(tmp_path / "list.yaml")
    with pytest.raises(ValueError, match="does not exist"):
        TrainingArguments.from_yaml_file(tmp_path / "missing.yaml")


def test_config_files_for_deepspeed_and_accelerator_config(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (tmp_path / "acc.json").write_text(json.dumps({"even_batches": False}))
    a = TrainingArguments(deepspeed=str(tmp_path / "ds.json"), accelerator_config=str(tmp_path / "acc.json"))
    assert a.deepspeed == {"zero_optimization": {"stage": 3}} and a.accelerator_config["even_batches"] is False
    assert create_accelerator(a).sharding.stage == 3


# ---------------------------------------------------------------- fields the Trainer uses


def _ds(n=20):
    return torch.utils.data.TensorDataset(torch.randn(n, 3), torch.randn(n, 1))


def test_dataloader_fields_reach_the_trainers_loaders(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=3, per_device_eval_batch_size=7,
                             dataloader_drop_last=True, dataloader_num_workers=1, dataloader_prefetch_factor=3,
                             dataloader_pin_memory=False, dataloader_persistent_workers=True)
    t = Trainer(torch.nn.Linear(3, 1), args, train_dataset=_ds(), eval_dataset=_ds(15))
    train, ev = t.get_train_dataloader(), t.get_eval_dataloader()
    assert train.batch_sampler.batch_size == 3 and len(train) == 6 and train.batch_sampler.drop_last  # 20 // 3
    assert ev.batch_sampler.batch_size == 7 and len(ev) == 2
    assert train.num_workers == 1 and train.prefetch_factor == 3 and train.pin_memory is False
    assert train.persistent_workers is True
    t2 = Trainer(torch.nn.Linear(3, 1), TrainingArguments(output_dir=str(tmp_path)), train_dataset=_ds())
    dl = t2.get_train_dataloader()
    assert len(dl) == 3 and dl.num_workers == 0  # 20 / 8 rounded up
    assert dl.pin_memory is (t2.accelerator.device.type != "cpu")  # pinned only for an accelerator


def test_optimizer_fields(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95,
                             adam_epsilon=1e-6, weight_decay=0.1)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 1))
    opt = Trainer(model, args).create_optimizer()
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model[0].weight), id(model[2].weight)}
    for g in opt.param_groups:
        assert g["lr"] == 3e-4 and g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6
    sgd = Trainer(model, TrainingArguments(output_dir=str(tmp_path), optim="sgd")).create_optimizer()
    assert isinstance(sgd, torch.optim.SGD)


def test_seed_field_seeds_torch(tmp_path):
    Trainer(torch.nn.Linear(3, 1), TrainingArguments(output_dir=str(tmp_path), seed=1234))
    assert torch.initial_seed() == 1234


# ---- found by the TrainingArguments fuzz target (tests/pyfuzz.py): a ValueError naming the field,
# where a TypeError or UnicodeDecodeError from deep inside escaped before
def test_a_non_path_output_dir_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"TrainingArguments\.output_dir: expected a path, got \[\]"):
        TrainingArguments.from_dict({"output_dir": []})


def test_fsdp_options_that_are_not_strings_are_a_value_error_naming_it():
    with pytest.raises(ValueError, match=r"TrainingArguments\.fsdp: expected a string of FSDP options or a list"):
        TrainingArguments.from_dict({"fsdp": [None]})


def test_an_undecodable_deepspeed_file_is_a_value_error_naming_field_and_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_bytes(b'{"zero_optimization": "\xff"}')
    with pytest.raises(ValueError, match=r"TrainingArguments\.deepspeed: file .*ds\.json' cannot be read"):
        TrainingArguments(output_dir=str(tmp_path), deepspeed=str(path))


@pytest.mark.parametrize("text", ["INFINITY", "-inf", "nan"])
def test_an_infinite_or_nan_number_as_text_is_a_value_error_naming_the_field(text):
    """'INFINITY' for an integer field (YAML 1.1 numbers arrive as strings and are converted):
    int(inf) raised OverflowError (int(nan) ValueError without the field)."""
    with pytest.raises(ValueError, match=r"TrainingArguments\.data_seed: expected None or an integer"):
        TrainingArguments.from_dict({"data_seed": text})
    with pytest.raises(ValueError, match=r"TrainingArguments\.seed: expected an integer"):
        TrainingArguments.from_dict({"seed": text})
