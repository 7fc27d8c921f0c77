"""Sharded model weights (accelerate_c/model_shards.py) read on one process, from files laid out
here by hand with the shard plan (one process's shard = the whole group): the values against the
model's own state_dict, and a name that is a parameter on one side and a buffer on the other
refused by name before anything changes (torch's load_state_dict would load it; no read of the
sharded layout could, so silently skipping it would leave the job half loaded)."""
from __future__ import annotations

import torch

from accelerate_c import model_shards
from accelerate_c.safetensors_io import save_file
from accelerate_c.shard_plan import ShardLayout, plan_spec
from accelerate_c.state_io import CheckpointError, write_json_durable
from accelerate_c.strategies.base import GradStrategy
from accelerate_c.zero_checkpoint import PlainFiles


class Net(torch.nn.Module):
    def __init__(self, scale_is_param: bool):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        if scale_is_param:
            self.scale = torch.nn.Parameter(torch.full((2,), 5.0))
        else:
            self.register_buffer("scale", torch.full((2,), 5.0))


def _write(d, model: torch.nn.Module) -> None:
    """model's parameters as one process's shards (world 1), its buffers in the buffers file."""
    named = list(model.named_parameters())
    layout = ShardLayout.from_params([p for _, p in named], world=1, rank=0, order=range(len(named)))
    (group,) = list(layout)
    shard = group.load_shard([named[j][1] for j in group.indices])
    doc = {"format": model_shards.FORMAT, "version": model_shards.VERSION, "world": 1,
           "groups": [{"unit": "root", "plan": plan_spec(group.plan), "dtype": "float32", "trainable": True,
                       "params": [{"names": [named[j][0]], "shape": list(named[j][1].shape)}
                                  for j in group.indices]}]}
    write_json_durable(str(d / model_shards.plan_name(0)), doc)
    save_file({"g0": shard}, str(d / model_shards.shard_name(0, 0)), metadata={"rank": "0", "world": "1"})
    save_file({n: b.clone() for n, b in model.named_buffers()}, str(d / model_shards.buffers_name(0)))


def _load(d, model):
    read, apply = model_shards.plan_load(PlainFiles(str(d)), 0, model, GradStrategy())
    read()
    apply()


def test_a_whole_model_reads_every_parameter_and_buffer(tmp_path):
    torch.manual_seed(0)
    saved = Net(scale_is_param=False)
    saved.scale.fill_(2.0)
    _write(tmp_path, saved)
    torch.manual_seed(1)
    model = Net(scale_is_param=False)
    _load(tmp_path, model)
    want = saved.state_dict()
    assert model.state_dict().keys() == want.keys()
    assert all(torch.equal(model.state_dict()[k], want[k]) for k in want)


def test_a_parameter_saved_as_a_buffer_is_refused_by_name(tmp_path):
    torch.manual_seed(0)
    saved = Net(scale_is_param=False)  # scale: a buffer in the checkpoint
    _write(tmp_path, saved)
    model = Net(scale_is_param=True)  # a parameter here
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        _load(tmp_path, model)
    except CheckpointError as e:
        assert "scale" in str(e) and model_shards.plan_name(0) in str(e), str(e)
    else:
        raise AssertionError("a parameter saved as a buffer was taken as loaded")
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    # and the other way round
    _write(tmp_path, Net(scale_is_param=True))
    try:
        _load(tmp_path, Net(scale_is_param=False))
    except CheckpointError as e:
        assert "scale" in str(e), str(e)
    else:
        raise AssertionError("a buffer saved as a parameter was taken as loaded")
