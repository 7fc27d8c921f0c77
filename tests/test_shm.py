"""Shared-memory collectives (accelerate_c/shm.py over csrc/core/comm_shm.c) between real processes
started by the launcher, against torch's collectives over gloo in the same processes
(tests/scripts/shm_collectives.py); the C core's own tests (threads as ranks, ASan/UBSan and
ThreadSanitizer) are tests/c/test_comm_shm.c. Every run must leave nothing in /dev/shm."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "shm_collectives.py")


def _segments():
    return {f for f in os.listdir("/dev/shm") if f.startswith("acshm-")} if os.path.isdir("/dev/shm") else set()


def _assert_none_left(before):
    """No segment created since `before` is left. Another job on this host (a test running
    beside this one under pytest -n) has its segments in /dev/shm only until its ranks have
    mapped them: a name that stays for seconds is a leak, one that goes was someone else's."""
    deadline = time.monotonic() + wait_s(5)
    while _segments() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _segments() <= before, f"segments left in /dev/shm: {_segments() - before}"


def _run(world, *args):
    before = _segments()
    res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0", SCRIPT, *args],
                 timeout=wait_s(180))
    _assert_none_left(before)
    return res


@pytest.mark.parametrize("world,mode", [(2, "all"), (3, "all"), (4, "big")])
def test_every_collective_matches_torch(world, mode):
    """Each collective x dtype x size (0, 1, odd, more than a piece, more than the segment; with
    4 processes one of 256 MiB) against gloo and the rank-order reference."""
    res = _run(world, mode)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"shm collectives OK on {world} processes" in res.stdout


def test_a_silent_or_killed_rank_is_an_error_naming_it(tmp_path):
    """Rank 1 stays away from a collective past the timeout, then is killed with SIGKILL inside
    one: rank 0 raises each time, naming rank 1. The two processes are started here, not by the
    launcher: its agent would SIGTERM rank 0 once rank 1 died, and on a loaded machine that can
    come before rank 0 has noticed the dead peer and printed its verdict."""
    before = _segments()
    env = dict(os.environ, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", SHM_TEST_INIT=f"file://{tmp_path / 'store'}")
    procs = [subprocess.Popen([sys.executable, SCRIPT, "faults"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(2)]
    try:
        (out0, err0), (out1, err1) = (p.communicate(timeout=wait_s(180)) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -signal.SIGKILL, (procs[1].returncode, out1[-3000:] + err1[-3000:])
    assert procs[0].returncode == 0 and "shm faults OK" in out0, out0[-3000:] + err0[-3000:]
    _assert_none_left(before)


@pytest.mark.parametrize("env", [{"ACCELERATE_C_COMM": "shm"}, {"ACCELERATE_C_COMM": ""},
                                 {"ACCELERATE_C_COMM": "gloo", "SHM_SELECT_BY": "handler"}])
def test_the_accelerator_selects_shared_memory_and_agrees_with_gloo(env):
    """ACCELERATE_C_COMM=shm, the default (unset: auto), or CpuCommKwargs("shm") over ACCELERATE_C_COMM=gloo: reduce / gather / broadcast / wait_for_everyone through shared
    memory, equal to torch's collectives over gloo; ranks on several hosts or a /dev/shm too small
    for the segment get gloo (tests/scripts/shm_select.py)."""
    before = _segments()
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", os.path.join(SCRIPTS, "shm_select.py")],
                 env=env, timeout=wait_s(120))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "shm select OK" in res.stdout
    _assert_none_left(before)


def test_ranks_on_two_hosts_go_through_shared_memory_within_and_gloo_between():
    """4 processes saying they are on 2 hosts of 2: the Accelerator's collectives go
    hierarchically (shm within each host, gloo between the leaders), each equal to torch's own
    over gloo, a prepared model's gradients averaged as torch's (tests/scripts/shm_hier.py)."""
    before = _segments()
    res = launch(["--num_processes", "4", "--cpu", "--main_process_port", "0", os.path.join(SCRIPTS, "shm_hier.py")],
                 env={"ACCELERATE_C_COMM": "shm"}, timeout=wait_s(180))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "shm hier OK" in res.stdout
    _assert_none_left(before)
