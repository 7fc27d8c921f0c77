"""save_state / load_state across processes: resuming in a new process (1 and 2 ranks) gives
bitwise the uninterrupted run's losses and weights, a save failing on one rank raises on every
rank, and save_on_each_node with two "nodes" on one shared directory writes one complete
checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from accelerate_c.checkpointing import MARKER

from checkpoint_helpers import ENV, HERE, SCRIPT, run_py
from helpers import fresh_state  # noqa: F401
from ports import run_machines
from test_launch import launch
from timeouts import wait_s

PRECISIONS = "no,bf16,fp16"


# ---- resume exactness ---------------------------------------------------------------------------
def _compare_runs(workdir, ranks):
    for rank in range(ranks):
        with open(os.path.join(workdir, f"full_{rank}.json")) as f:
            full = json.load(f)
        with open(os.path.join(workdir, f"resume_{rank}.json")) as f:
            resumed = json.load(f)
        for precision in PRECISIONS.split(","):
            a, b = full[precision], resumed[precision]
            assert len(a["losses"]) == a["m"] > 0
            assert b["losses"] == a["losses"], f"rank {rank} {precision}: losses after resume differ"
            assert b["params"] == a["params"], f"rank {rank} {precision}: final parameters differ"
            assert b["after_save_or_load"] == a["after_save_or_load"], (rank, precision)
        if ranks == 1:
            assert full["fp16"]["after_save_or_load"]["scale"] != 2.0 ** 20  # the scaler moved before the save


def test_resume_is_bitwise_exact_in_a_new_process(tmp_path):
    for phase in ("full", "resume"):
        res = run_py([SCRIPT, phase, str(tmp_path), PRECISIONS])
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _compare_runs(tmp_path, 1)
    ckpt = tmp_path / "fp16" / "checkpoints" / "checkpoint_0"
    assert sorted(os.listdir(ckpt)) == sorted([
        MARKER, "model.safetensors", "optimizer.json", "optimizer.safetensors", "scheduler.json", "scaler.json",
        "random_states_0.json", "random_states_0.safetensors", "dataloader_0.json", "dataloader_0.safetensors",
        "custom_checkpoint_0.json", "custom_checkpoint_0.safetensors"])


def test_resume_is_bitwise_exact_on_two_processes(tmp_path):
    for phase in ("full", "resume"):
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, phase, str(tmp_path),
                      PRECISIONS], env={"PYTHONPATH": ENV["PYTHONPATH"]}, timeout=wait_s(300))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        assert f"checkpoint_resume {phase} OK on 2 processes" in res.stdout
    _compare_runs(tmp_path, 2)
    ckpt = tmp_path / "no" / "checkpoints" / "checkpoint_0"
    names = set(os.listdir(ckpt))
    assert {"random_states_0.json", "random_states_1.json", MARKER} <= names
    assert not any(n.startswith(".") for n in os.listdir(ckpt.parent)), os.listdir(ckpt.parent)


def test_a_save_failing_on_one_rank_raises_on_every_rank(tmp_path):
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, "fail", str(tmp_path)],
                 env={"PYTHONPATH": ENV["PYTHONPATH"]}, timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"fail_{r}.json").read_text()) for r in (0, 1))
    assert r0["raised"][0] == "TypeError" and "cannot be saved without pickle" in r0["raised"][1]
    assert r1["raised"][0] == "RuntimeError" and "another process failed" in r1["raised"][1]
    assert r0["left"] == r1["left"] == []  # no checkpoint, no temporary directory
    assert r0["iteration"] == r1["iteration"] == 0
    assert r0["weights"] == r1["weights"] == ["model.safetensors"]  # save_model: written once, seen by all


# ---- save_on_each_node on a shared file system: two "nodes" on one host ---------------------------------------
def _two_nodes(tmp_path, out):
    """Two launchers of 2 processes each as two nodes (ports.run_machines); their processes and
    outputs."""
    import shutil as _shutil

    exe = _shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    script = os.path.join(HERE, "scripts", "checkpoint_nodes.py")
    env = dict(ENV, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"))
    env.pop("WORLD_SIZE", None)

    def commands(port):
        common = ["--cpu", "--num_processes", "4", "--num_machines", "2", "--main_process_ip", "127.0.0.1",
                  "--main_process_port", port, "--same_network"]
        return [[exe, "launch", *common, "--machine_rank", str(m), script, str(out)] for m in (0, 1)]

    return run_machines(commands, env, wait_s(240))


def test_save_on_each_node_two_nodes_one_shared_directory(tmp_path):
    """2 launchers x 2 processes (ranks 0,1 on node 0, ranks 2,3 on node 1) save into one
    directory: one complete checkpoint (every rank's random states, one marker that lists them),
    no temporary directories left, weights as torch saved them, each rank's RNG its own."""
    out = tmp_path / "shared"
    out.mkdir()
    procs, outs = _two_nodes(tmp_path, out)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    results = [json.loads((out / f"nodes_{r}.json").read_text()) for r in range(4)]
    assert [(r["node"], r["local"]) for r in results] == [("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert not [n for n in os.listdir(out) if n.startswith(".")], os.listdir(out)
    ck = out / "ck"
    marker = json.loads((ck / MARKER).read_text())
    rng = {f"random_states_{r}.{ext}" for r in range(4) for ext in ("json", "safetensors")}
    assert rng <= set(marker["files"]) and rng <= set(os.listdir(ck)), sorted(os.listdir(ck))
    assert marker["ranks"] == [0, 1, 2, 3] and marker["nodes"] == [0, 1]
    assert set(marker["files"]) == set(os.listdir(ck)) - {MARKER}
    for name, size in marker["files"].items():
        assert (ck / name).stat().st_size == size, name
    # the weights file against torch's own copy of the saved weights, read by the safetensors package
    from safetensors.torch import load_file as st_load

    ref = torch.load(out / "params.pt", weights_only=True)
    got = st_load(str(ck / "model.safetensors"))
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    for r in results:
        assert r["restored"], r
        assert r["drawn_after_load"] == r["drawn"], r  # each rank got its own generator back
    assert len({tuple(r["drawn"]) for r in results}) == 4
