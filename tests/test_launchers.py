"""debug_launcher and notebook_launcher: the function runs on forked CPU processes that see the
launcher's environment and form one process group; compared with accelerate 1.15's
debug_launcher running the same function with accelerate's Accelerator, in the same test."""
from __future__ import annotations

import json
import os

import accelerate
import pytest
import torch

import accelerate_c
from helpers import fresh_state  # noqa: F401  (autouse: fresh singletons per test)


def _report(path, make_accelerator, extra=()):
    """The training function: what each process sees, one JSON line per process."""
    acc = make_accelerator()
    gathered = acc.gather(torch.tensor([acc.process_index * 10 + 1])).tolist()
    line = {"rank": acc.process_index, "world": acc.num_processes, "local": acc.local_process_index,
            "gathered": gathered, "mixed_precision": str(acc.mixed_precision), "device": acc.device.type,
            "distributed_type": str(acc.distributed_type), "extra": list(extra)}
    acc.wait_for_everyone()
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def _lines(path):
    with open(path) as f:
        return sorted((json.loads(x) for x in f), key=lambda d: d["rank"])


def test_debug_launcher_runs_the_function_as_accelerates_does(tmp_path):
    accelerate.debug_launcher(_report, args=(str(tmp_path / "theirs"), accelerate.Accelerator), num_processes=2)
    accelerate_c.debug_launcher(_report, args=(str(tmp_path / "ours"), accelerate_c.Accelerator), num_processes=2)
    ours, theirs = _lines(tmp_path / "ours"), _lines(tmp_path / "theirs")
    # accelerate's debug processes get no LOCAL_RANK, so each is its machine's local main process
    # (accelerator.print prints twice); ours get the launcher's LOCAL_RANK
    assert [d.pop("local") for d in ours] == [0, 1] and [d.pop("local") for d in theirs] == [0, 0]
    assert ours == theirs
    assert [d["gathered"] for d in ours] == [[1, 11], [1, 11]] and ours[0]["distributed_type"].endswith("MULTI_CPU")
    assert "ACCELERATE_USE_CPU" not in os.environ or os.environ.get("RANK") is None  # the caller's env untouched


def test_notebook_launcher_forms_one_group_with_the_launchers_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    accelerate.notebook_launcher(_report, args=(str(tmp_path / "theirs"), accelerate.Accelerator, ("extra",)),
                                 num_processes=2, mixed_precision="bf16", use_port=str(_free_port()))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # accelerate's set it here
    before = dict(os.environ), torch.get_num_threads()
    accelerate_c.notebook_launcher(_report, args=(str(tmp_path / "ours"), accelerate_c.Accelerator,
                                                  ("extra",)), num_processes=2, mixed_precision="bf16",
                                   use_port=str(_free_port()))
    ours = _lines(tmp_path / "ours")
    # accelerate's notebook_launcher is for GPUs: on a machine without one its processes do not
    # form a group (each is a world of one, mixed precision not passed on); ours are CPU processes
    assert [(d["world"], d["mixed_precision"]) for d in _lines(tmp_path / "theirs")] == [(1, "no"), (1, "no")]
    assert [(d["rank"], d["local"], d["world"], d["mixed_precision"]) for d in ours] == [(0, 0, 2, "bf16"),
                                                                                           (1, 1, 2, "bf16")]
    assert ours[0]["gathered"] == [1, 11] and ours[0]["extra"] == ["extra"]
    assert (dict(os.environ), torch.get_num_threads()) == before  # only the children changed theirs


def _free_port():
    from ports import free_port

    return free_port()


def test_a_failing_process_raises_in_the_caller_with_its_error():
    from torch.multiprocessing import ProcessRaisedException

    def fails():
        if accelerate_c.Accelerator().process_index == 1:
            raise KeyError("rank 1 broke")

    with pytest.raises(ProcessRaisedException, match="rank 1 broke"):
        accelerate_c.debug_launcher(fails, num_processes=2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_processes=None), "give num_processes"),
    (dict(num_processes=2, mixed_precision="fp32"), "mixed_precision='fp32'"),
    (dict(num_processes=2, rdzv_backend="c10d"), "static rendezvous"),
    (dict(num_processes=2, node_rank=2, num_nodes=2), "node_rank=2"),
])
def test_notebook_launcher_refuses_bad_arguments(kwargs, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        accelerate_c.notebook_launcher(print, **kwargs)


def test_one_process_runs_here():
    seen = []
    accelerate_c.notebook_launcher(lambda x: seen.append((x, os.getpid())), args=(5,), num_processes=1)
    assert seen == [(5, os.getpid())]
