"""Sharded checkpoints under ZeRO (accelerate_c/zero_checkpoint.py): saved on N processes, loaded on
M, training continuing as the uninterrupted run did (tests/scripts/zero_checkpoint.py), the
refusals, and a kill -9 of one process mid-save."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from accelerate_c.checkpoint_layout import is_complete
from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "zero_checkpoint.py")


def _run(world, *args, says=None):
    res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0", SCRIPT, *args],
                 timeout=wait_s(180))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    if says is not None:
        assert says in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize("stage,precision,saved_on,loaded_on,sdt", [
    (2, "no", 4, (2, 1), None),
    (1, "no", 2, (3, 1), None),
    (2, "bf16", 2, (2, 3), None),
    # full sharding (FSDP); its bf16 resume: tests/test_fsdp.py's Trainer test. SHARDED_STATE_DICT:
    # each process writes its shard of the weights; FULL_STATE_DICT: the main process the gathered ones
    (3, "no", 4, (2, 1), "SHARDED_STATE_DICT"),
    (3, "no", 2, (3,), "FULL_STATE_DICT"),
    # a bf16 model without mixed precision: its shards are its weights, no fp32 masters
    (3, "bf16model", 2, (2,), "SHARDED_STATE_DICT"),
])
def test_saved_on_n_resumes_on_m(tmp_path, stage, precision, saved_on, loaded_on, sdt):
    extra = [sdt] if sdt else []
    _run(saved_on, "save", str(tmp_path), str(stage), precision, *extra, says=f"saved on {saved_on}")
    _merge_weights(tmp_path / "ckpt", tmp_path / "merged", precision if stage < 3 else "no",  # stage 3: the shards
                   torch.load(tmp_path / "uninterrupted.pt")["at_save"])
    for m in loaded_on:
        _run(m, "load", str(tmp_path), str(stage), precision, *extra, says=f"zero{stage} {precision} resumed on {m}")
    if sdt == "SHARDED_STATE_DICT" and precision == "no":  # resumed by ZeRO-2: the shards matched by name
        _run(2, "load", str(tmp_path), "2", precision, "FROM3", says=f"zero2 {precision} resumed on 2")


def _merge_weights(ckpt, out, precision, at_save):
    """`accelerate-c merge-weights`, no process group: Hugging Face safetensors (read here by the
    safetensors package), against the weights gathered over the process group when the
    checkpoint was saved (`at_save`, fp32 copies). fp32, and full sharding (its saved weights are
    the fp32 masters): equal to them. ZeRO's bf16: the fp32 masters, assembled
    from every process's shard: each rounds to the bf16 weight the model held, and carries more
    than it (not just the bf16 weights widened)."""
    from safetensors.torch import load_file

    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    res = subprocess.run([exe, "merge-weights", str(ckpt), str(out)], capture_output=True, text=True,
                         timeout=wait_s(120))
    assert res.returncode == 0, res.stderr[-3000:]
    merged = load_file(str(out / "model.safetensors"))
    assert set(merged) == set(at_save)  # the tied weight once, under its first name
    if precision == "no":
        assert all(torch.equal(merged[k].float(), at_save[k]) for k in merged)
        return
    saved = load_file(str(ckpt / "model.safetensors"))  # the bf16 weights the model held
    assert all(merged[k].dtype == torch.float32 and torch.equal(merged[k].to(saved[k].dtype), saved[k])
               for k in merged)
    assert any(not torch.equal(merged[k], saved[k].float()) for k in merged)


def test_merge_weights_refuses_an_incomplete_checkpoint(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    (tmp_path / "ck").mkdir()
    res = subprocess.run([exe, "merge-weights", str(tmp_path / "ck"), str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=wait_s(60))
    assert res.returncode != 0 and "not a complete accelerate_c checkpoint" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_kill_9_of_one_process_mid_save_keeps_the_previous_checkpoint(tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    # the output goes to a file: a pipe nobody reads while waiting would fill and stall the processes
    log_path = tmp_path / "kill.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT,
                             "kill", str(tmp_path), "2", "no"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    paused = tmp_path / "paused"
    try:
        deadline = time.time() + wait_s(180)
        while not paused.exists() or not paused.read_text():
            assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.time() < deadline, "the second save never paused"
            time.sleep(0.1)
        os.kill(int(paused.read_text()), signal.SIGKILL)  # process 1, after its first file
        try:
            proc.wait(timeout=wait_s(120))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise AssertionError("the other process did not end after process 1 was killed:\n"
                                 + log_path.read_text(errors="replace")[-3000:]) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()
    output = log_path.read_text(errors="replace")
    assert proc.returncode != 0, output[-3000:]
    entries = sorted(os.listdir(tmp_path))
    entries = [e for e in entries if e != "kill.log"]
    assert "ckpt_b" not in entries, (entries, output[-3000:])  # never published
    assert [e for e in entries if e.startswith(".ckpt_b.tmp-")], entries  # the half-written one, left aside
    assert is_complete(str(tmp_path / "ckpt"))
    # the previous checkpoint still loads and resumes, on another number of processes
    _run(3, "load", str(tmp_path), "2", "no", says="zero2 no resumed on 3")
