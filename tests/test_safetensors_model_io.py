"""accelerate_c.model_io: save_model / load_model_weights as Hugging Face checkpoints (sharded
with an index, single file, torch format), tied weights and views, stale shards, a failed save
keeping the previous checkpoint, strict loading, and parse_size."""
import json
import os

import pytest
import torch

import safetensors
import safetensors.torch as st_pkg

from accelerate_c import model_io
from accelerate_c.model_io import load_model_weights, parse_size, save_model

from safetensors_helpers import sorted_listdir


# ---- save_model / load_model_weights ---------------------------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
        if tie:
            self.head.weight = self.embed.weight


def _state_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("size,want", [
    (1234, 1234), ("10GB", 10 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("100KB", 100_000),
    ("3MiB", 3 * 2**20), ("5Gb", 5 * 10**9 // 8), ("1.5GB", 1_500_000_000), ("2kb", 250), (" 7 MB ", 7_000_000),
])
def test_parse_size(size, want):
    assert parse_size(size) == want


@pytest.mark.parametrize("size", ["ten", "5XB", "-1MB", 0, -5, "0GB", "GB", 1.5, True])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError):
        parse_size(size)


def test_save_model_sharded_loads_with_package(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(tie=True)
    sd = model.state_dict()
    files = save_model(model, tmp_path, max_shard_size="10KB")
    n = len(files) - 1
    assert n > 1 and files[-1] == "model.safetensors.index.json"
    assert files[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted_listdir(tmp_path) == sorted(files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    saved_names = set(sd) - {"head.weight"}  # the tied alias is saved once, under its first name
    assert set(index["weight_map"]) == saved_names
    assert index["metadata"]["total_size"] == sum(sd[k].numel() * sd[k].element_size() for k in saved_names)
    merged = {}
    for f in files[:-1]:
        part = st_pkg.load_file(str(tmp_path / f))
        assert all(index["weight_map"][k] == f for k in part)
        with safetensors.safe_open(str(tmp_path / f), framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 10_000 or len(part) == 1
        merged.update(part)
    _state_equal(merged, {k: sd[k] for k in saved_names})

    fresh = TinyLM(tie=True)
    res = load_model_weights(fresh, tmp_path)
    assert res.missing_keys == [] and res.unexpected_keys == []
    _state_equal(fresh.state_dict(), sd)
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()


def test_save_model_single_file_and_transformers_names(tmp_path):
    model = TinyLM(tie=False)
    assert save_model(model, tmp_path) == ["model.safetensors"]
    assert sorted_listdir(tmp_path) == ["model.safetensors"]
    _state_equal(st_pkg.load_file(str(tmp_path / "model.safetensors")), model.state_dict())
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())


def test_tied_and_distinct_views(tmp_path):
    flat = torch.arange(10, dtype=torch.float32)
    sd = {"first": flat[:5], "second": flat[5:], "again": flat[:5], "whole": flat}
    save_model(sd, tmp_path)
    back = st_pkg.load_file(str(tmp_path / "model.safetensors"))
    # identical views are saved once (first name kept); distinct views of one storage are all saved
    assert set(back) == {"first", "second", "whole"}
    for k in back:
        assert torch.equal(back[k], sd[k])


def test_stale_shards_removed_after_new_save(tmp_path):
    model = TinyLM(tie=False)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-notes.txt").write_text("keep me")
    many = save_model(model, tmp_path, max_shard_size="5KB")
    assert len(many) > 3
    one = save_model(model, tmp_path, max_shard_size="1GB")
    assert sorted_listdir(tmp_path) == sorted(["config.json", "model-notes.txt", "model.safetensors"])
    two = save_model(model, tmp_path, max_shard_size=parse_size("20KB"))
    assert len(two) >= 3
    assert sorted_listdir(tmp_path) == sorted(["config.json", "model-notes.txt"] + two)
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())
    assert one == ["model.safetensors"]


def test_failed_save_model_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = TinyLM(tie=False)
    save_model(model, tmp_path, max_shard_size="8KB")
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    calls = {"n": 0}
    real = model_io.save_file

    def flaky(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(model_io, "save_file", flaky)
    other = TinyLM(tie=False)
    with pytest.raises(OSError, match="simulated"):
        save_model(other, tmp_path, max_shard_size="8KB")
    after = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    assert after == before  # no temp file left, every old file byte-identical


def test_load_model_weights_strict_errors(tmp_path):
    model = TinyLM(tie=False)
    sd = model.state_dict()
    partial = {k: v for k, v in sd.items() if k != "norm.bias"}
    partial["extra.weight"] = torch.zeros(2)
    save_model(partial, tmp_path)
    fresh = TinyLM(tie=False)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"missing keys: norm\.bias; unexpected keys: extra\.weight"):
        load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), before)  # nothing was loaded
    res = load_model_weights(fresh, tmp_path, strict=False)
    assert res.missing_keys == ["norm.bias"] and res.unexpected_keys == ["extra.weight"]
    assert torch.equal(fresh.blocks[0].weight, sd["blocks.0.weight"])
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model_weights(fresh, tmp_path / "empty")


def test_index_with_missing_shard(tmp_path):
    model = TinyLM(tie=False)
    files = save_model(model, tmp_path, max_shard_size="10KB")
    os.unlink(tmp_path / files[0])
    with pytest.raises(FileNotFoundError, match=files[0]):
        load_model_weights(TinyLM(tie=False), tmp_path)


def test_save_model_torch_format(tmp_path):
    model = TinyLM(tie=False)
    files = save_model(model, tmp_path, max_shard_size="10KB", safe_serialization=False)
    assert files[-1] == "pytorch_model.bin.index.json" and files[0].startswith("pytorch_model-00001-of-")
    merged = {}
    for f in files[:-1]:
        merged.update(torch.load(tmp_path / f, weights_only=True))
    _state_equal(merged, model.state_dict())
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="should be a directory"):
        save_model(model, tmp_path / files[0])


# ---- found by the model index fuzz target (tests/pyfuzz.py): an index that is not UTF-8 (or is
# nested past the recursion limit) raised UnicodeDecodeError / RecursionError without its path
@pytest.mark.parametrize("content", [b"\x80", b"[" * 100000 + b"]" * 100000])
def test_an_undecodable_index_is_a_value_error_naming_it(tmp_path, content):
    from accelerate_c.model_io import load_model_weights, save_model

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    save_model(model, tmp_path, max_shard_size=200)
    (tmp_path / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: (not valid JSON|JSON nested too deeply)"):
        load_model_weights(model, tmp_path)
