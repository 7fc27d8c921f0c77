"""Around the loop on 2 processes through the real launcher (tests/scripts/around_loop.py):
get_logger's main_process_only / in_order, accelerator.print, main_process_first,
local_main_process_first, the on_* decorators, profile()'s per-process traces and the trackers'
main-process-only rule, each run with accelerate_c's objects and accelerate 1.15's in the same
processes and compared here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(*args, timeout=wait_s(120)):
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def _lines(path):
    with open(path) as f:
        return f.read().splitlines()


def test_around_the_loop_on_two_processes_as_accelerate(tmp_path):
    res = _launch(os.path.join(HERE, "scripts", "around_loop.py"), str(tmp_path))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = [json.load(open(tmp_path / f"results_{r}.json")) for r in range(2)]

    # logging: the same lines in the same files, phase by phase
    for phase in ("main_only", "everyone", "in_order", "once"):
        ours, theirs = _lines(tmp_path / f"log_ours_{phase}.txt"), _lines(tmp_path / f"log_theirs_{phase}.txt")
        if phase == "everyone":  # the two processes race: the same lines, in either order
            ours, theirs = sorted(ours), sorted(theirs)
        assert ours == theirs, (phase, ours, theirs)
    assert _lines(tmp_path / "log_ours_main_only.txt") == ["INFO [RANK 0] main only 0", "WARNING [RANK 0] warned"]
    assert _lines(tmp_path / "log_ours_in_order.txt") == [
        "INFO [RANK 0] turn of 0 (0)", "INFO [RANK 1] turn of 1 (0)",
        "INFO [RANK 0] turn of 0 (1)", "INFO [RANK 1] turn of 1 (1)"]
    assert _lines(tmp_path / "log_ours_once.txt") == ["WARNING [RANK 0] said once"]

    for rank, r in enumerate(results):
        assert r["print_ours"] == r["print_theirs"] == ("printed by 0\n" if rank == 0 else "")
        assert r["decorators_ours"] == r["decorators_theirs"], rank
        assert r["state_decorators_ours"] == r["state_decorators_theirs"], rank
        assert r["trackers_ours"] == (["recorder", "jsonl"] if rank == 0 else [])
        assert r["trackers_theirs"] == (["recorder"] if rank == 0 else [])
        assert r["calls_ours"] == r["calls_theirs"], rank
        assert r["trace_files_ours"] == r["trace_files_theirs"] == ["profile_0.json", "profile_1.json"], rank
        if rank == 1:
            assert r["calls_ours"] == [] and r["blank_ours"] == r["blank_theirs"] == "GeneralTracker"
    assert results[0]["decorators_ours"]["ran"] == ["main", "local_main", "p0"]
    assert results[1]["decorators_ours"]["ran"] == ["last", "p1", "l1"]
    assert results[0]["calls_ours"][:2] == [["start"], ["config", {"lr": 0.5}]]
    for kind in ("main_process_first", "local_main_process_first"):
        assert _lines(tmp_path / f"{kind}_ours.txt") == _lines(tmp_path / f"{kind}_theirs.txt") == ["0", "1"]
    # the JSON-lines tracker wrote on the main process only: rank 0's values, once each
    rows = [json.loads(x) for x in _lines(tmp_path / "ours" / "proj" / "metrics.jsonl")]
    assert [(row["_step"], row["loss"]) for row in rows] == [(1, 1.0), (2, 0.5)]
