"""Accelerator.save_model of a transformers PreTrainedModel writes its config.json (and
generation_config.json), so `from_pretrained(dir)` loads the saved model; checked against the
model's own save_pretrained in the same test. accelerate's save_model writes only the weights
(the difference is listed in docs/checkpoints.md)."""
from __future__ import annotations

import json
import os

import accelerate
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import accelerate_c
from helpers import fresh_state  # noqa: F401  (autouse: fresh Accelerator states per test)


def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _json(path):
    with open(path) as f:
        data = json.load(f)
    data.pop("transformers_version", None)
    return data


def test_save_model_writes_the_config_and_from_pretrained_loads_it(tmp_path):
    model = _llama()
    acc = accelerate_c.Accelerator(cpu=True, mixed_precision="bf16")
    prepared = acc.prepare(model)
    acc.save_model(prepared, tmp_path / "ours")
    model.save_pretrained(tmp_path / "ref")  # transformers' own
    for name in ("config.json", "generation_config.json"):
        assert _json(tmp_path / "ours" / name) == _json(tmp_path / "ref" / name), name
    for cls in (LlamaForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path / "ours")
        assert type(loaded) is LlamaForCausalLM and loaded.config.hidden_size == 32
        ref = model.state_dict()
        got = loaded.state_dict()
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), k


def test_accelerate_writes_no_config_and_plain_modules_get_none(tmp_path):
    theirs = accelerate.Accelerator(cpu=True)
    theirs.save_model(theirs.prepare(_llama()), tmp_path / "acc")
    assert not os.path.exists(tmp_path / "acc" / "config.json")  # the difference we document
    acc = accelerate_c.Accelerator(cpu=True)
    acc.save_model(acc.prepare(nn.Linear(3, 2)), tmp_path / "plain")
    assert sorted(os.listdir(tmp_path / "plain")) == ["model.safetensors"]
