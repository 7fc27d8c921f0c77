"""Accelerator.from_training_args and accelerate_c's Trainer given a transformers.TrainingArguments
(or its to_dict()): every field that concerns the Accelerator, field by field, against what
transformers' own Trainer (create_accelerator_and_postprocess) builds on accelerate 1.15, read
from the resulting accelerate objects in the same test."""
from __future__ import annotations

import copy
import datetime
import json
import warnings

import pytest
import torch
import transformers
from torch import nn

import accelerate_c
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, labels=None):
        out = self.lin(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def _data(n=20):
    g = torch.Generator().manual_seed(3)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn(2, generator=g)} for _ in range(n)]


CONFIGS = {
    "defaults": {},
    "bf16_ddp_dataloader": dict(
        bf16=True, gradient_accumulation_steps=3, seed=5, data_seed=11, ddp_find_unused_parameters=False,
        ddp_bucket_cap_mb=10, ddp_broadcast_buffers=False, ddp_timeout=600, dataloader_drop_last=True,
        per_device_train_batch_size=3,
        accelerator_config={"split_batches": True, "even_batches": False, "use_seedable_sampler": False,
                            "non_blocking": True}),
    "accumulation_kwargs": dict(
        fp16=False, accelerator_config={"gradient_accumulation_kwargs": {"num_steps": 2, "sync_each_batch": True,
                                                                          "adjust_scheduler": False}}),
    "compile": dict(torch_compile_backend="eager", torch_compile_mode="default"),
}


def _hf_args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          disable_tqdm=True, **kw)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("form", ["object", "to_dict"])
def test_from_training_args_matches_what_transformers_builds_on_accelerate(tmp_path, name, form):
    hf_args = _hf_args(tmp_path, **copy.deepcopy(CONFIGS[name]))
    # transformers' Trainer edits its arguments in place (gradient_accumulation_kwargs' num_steps
    # becomes 1, gradient_accumulation_steps takes its value): ours get an untouched twin
    mine = _hf_args(tmp_path, **copy.deepcopy(CONFIGS[name]))
    given = mine if form == "object" else mine.to_dict()
    ref_trainer = transformers.Trainer(model=Net(), args=hf_args, train_dataset=_data())
    ref = ref_trainer.accelerator  # accelerate's, as transformers configured it
    rng_after_ref = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing carried away from its default here: no warning
        ours = accelerate_c.Accelerator.from_training_args(given)
    assert ours.mixed_precision == ref.mixed_precision
    for field in ("split_batches", "dispatch_batches", "even_batches", "use_seedable_sampler", "data_seed",
                  "non_blocking"):
        assert getattr(ours.dataloader_config, field) == getattr(ref.dataloader_config, field), field
    # transformers accumulates itself (accelerate counts 1); accelerate_c's Trainer uses the
    # Accelerator's accumulate: its count is the one transformers' loop accumulates by
    assert ref.gradient_accumulation_steps == 1
    assert ours.gradient_accumulation_steps == ref_trainer.args.gradient_accumulation_steps
    for key, value in ref.gradient_state.plugin_kwargs.items():  # the fields set away from their defaults
        if key != "num_steps":
            assert ours.gradient_state.plugin_kwargs[key] == value, key
    for key in ("adjust_scheduler", "sync_with_dataloader"):
        assert getattr(ours.gradient_state, key) == getattr(ref.gradient_state, key), key
    assert ours.gradient_state.sync_each_batch == ref.gradient_state.plugin_kwargs.get("sync_each_batch", False)
    for field in ("find_unused_parameters", "bucket_cap_mb", "broadcast_buffers"):
        if getattr(hf_args, f"ddp_{field}") is not None:  # unset: each side keeps its own default
            assert getattr(ours.ddp_handler, field) == getattr(ref.ddp_handler, field), field
    assert ours.init_handler.timeout == datetime.timedelta(seconds=hf_args.ddp_timeout)
    for field in ("backend", "mode", "fullgraph", "dynamic", "options", "disable", "use_regional_compilation"):
        theirs = getattr(ref.state.dynamo_plugin, field)
        assert str(getattr(getattr(ours.state.dynamo_plugin, field), "value", getattr(ours.state.dynamo_plugin, field))) \
            == str(getattr(theirs, "value", theirs)), field
    assert ours.device == ref.device and ours.distributed_type == ref.distributed_type

    # accelerate_c's Trainer from the same object: the seed and the data loader transformers makes
    ours_trainer = accelerate_c.Trainer(model=Net(), args=given, train_dataset=_data())
    assert torch.equal(torch.random.get_rng_state(), rng_after_ref)  # set_seed(args.seed), as transformers
    a, b = ref_trainer.get_train_dataloader(), ours_trainer.get_train_dataloader()
    assert (len(b), b.batch_size, b.drop_last) == (len(a), a.batch_size, a.drop_last)
    assert ours_trainer.train().global_step == ref_trainer.train().global_step  # the same count of steps


def test_mechanics_refused_by_name_the_rest_carried_with_one_warning(tmp_path):
    for kw, field in ((dict(ddp_static_graph=True), "ddp_static_graph"),
                      (dict(ignore_data_skip=True), "ignore_data_skip"),
                      (dict(auto_find_batch_size=True), "auto_find_batch_size")):
        with pytest.raises(ValueError, match=rf"TrainingArguments\.{field}=.*not supported yet"):
            accelerate_c.Accelerator.from_training_args(_hf_args(tmp_path, **kw))
    # False and 0 are values of their own, not the default None (tf32=False would disable TF32)
    for field, value in (("tf32", False), ("torch_empty_cache_steps", 0), ("dataloader_in_order", False)):
        d = _hf_args(tmp_path).to_dict()
        d[field] = value
        with pytest.raises(ValueError, match=rf"TrainingArguments\.{field}=.*not supported yet"):
            accelerate_c.Accelerator.from_training_args(d)
    with pytest.warns(UserWarning) as record:
        args = accelerate_c.training_args.load_training_args(
            _hf_args(tmp_path, hub_model_id="me/model", log_level="info", push_to_hub=False))
    messages = [str(w.message) for w in record if "carried but ignored" in str(w.message)]
    assert len(messages) == 1 and "hub_model_id='me/model'" in messages[0] and "log_level='info'" in messages[0]
    assert "push_to_hub" not in messages[0]  # at its default: carried silently
    assert args.carried["hub_model_id"] == "me/model" and args.carried["push_to_hub"] is False
    with pytest.raises(ValueError, match="unknown field 'hub_modle_id'; did you mean 'hub_model_id'"):
        accelerate_c.TrainingArguments.from_dict({"hub_modle_id": "x"})


@pytest.mark.parametrize("field,kind,value", [
    ("lr_scheduler_kwargs", "cosine_with_restarts", '{"num_cycles": "3"}'),
    ("lr_scheduler_kwargs", "cosine_with_min_lr", '{"min_lr": "0.001"}'),
    ("lr_scheduler_kwargs", "polynomial", '{"power": 2.0, "lr_end": "0.0000001"}'),
    ("accelerator_config", "linear", '{"split_batches": "true", "even_batches": false}'),
])
def test_dict_fields_read_json_strings_as_transformers(tmp_path, field, kind, value):
    """A '{...}' string (a command line's) in a dict field becomes the dict transformers makes of it,
    its "true"/digit strings typed as transformers types them."""
    ours = accelerate_c.TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type=kind, **{field: value})
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type=kind, **{field: value})
    want = getattr(theirs, field)
    want = want.to_dict() if hasattr(want, "to_dict") else want
    got = getattr(ours, field)
    assert {k: got[k] for k in want if k in got} == {k: want[k] for k in want if k in got}
    assert json.loads(value).keys() <= got.keys()
    with pytest.raises(ValueError, match=field):
        accelerate_c.TrainingArguments(output_dir=str(tmp_path), lr_scheduler_type=kind, **{field: "{not json"})
