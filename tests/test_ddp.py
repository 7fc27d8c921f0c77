"""Gradient synchronisation on several processes: real processes through the real launcher."""
import os

import pytest

from test_launch import SCRIPTS, launch


@pytest.mark.parametrize("n", [2, 3])
def test_n_ranks_match_one_process_with_n_times_the_batch(n):
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "ddp_equivalence.py")], timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert f"ddp equivalence OK on {n} processes" in res.stdout
