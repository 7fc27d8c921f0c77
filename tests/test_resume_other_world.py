"""save_state mid-epoch on 4 processes, resumed on 3, 2 and 1 with the global batch kept and
skip_first_batches over a prepared shuffled DataLoader (tests/scripts/resume_other_world.py):
every step after the resume trains on the global batch the uninterrupted run had, and the losses
and final parameters are plain torch's on accelerate 1.15's batches (the script's reference
phase), within fp32 summation-order roundings."""
import json
import math
import os
import subprocess
import sys

from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "resume_other_world.py")
K = 2  # the script's steps before save_state


def _read(d, name):
    with open(os.path.join(d, f"{name}.json")) as f:
        return json.load(f)


def _same_steps(got, want, what):
    assert len(got) == len(want), f"{what}: {len(got)} steps, the reference {len(want)}"
    for i, (a, b) in enumerate(zip(got, want)):
        assert a["indices"] == b["indices"], f"{what}, step {i}: trained on samples {a['indices']}, not {b['indices']}"
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), f"{what}, step {i}: loss {a['loss']} vs {b['loss']}"


def _same_params(got, want, what):
    for name, value in want.items():
        for a, b in zip(sum(got[name], []) if isinstance(value[0], list) else got[name],
                        sum(value, []) if isinstance(value[0], list) else value):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), f"{what}: {name} {a} vs {b}"


def test_saved_on_4_resumed_mid_epoch_on_3_2_and_1(tmp_path):
    d = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([sys.executable, SCRIPT, "reference", d, "4"], capture_output=True, text=True,
                         timeout=wait_s(120), env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ref = _read(d, "reference_4")
    res = launch(["--num_processes", "4", "--cpu", "--main_process_port", "0", SCRIPT, "full", d],
                 env={"OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    full = _read(d, "full_4")
    _same_steps(full["steps"], ref["steps"], "uninterrupted on 4")
    _same_params(full["params"], ref["params"], "uninterrupted on 4")
    for world in (3, 2, 1):
        if world == 1:
            res = subprocess.run([sys.executable, SCRIPT, "resume", d], capture_output=True, text=True,
                                 timeout=wait_s(120), env=env)
        else:
            res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0", SCRIPT, "resume", d],
                         env={"OMP_NUM_THREADS": "1"})
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        got = _read(d, f"resume_{world}")
        _same_steps(got["steps"], ref["steps"][K:], f"resumed on {world}")
        _same_params(got["params"], ref["params"], f"resumed on {world}")
