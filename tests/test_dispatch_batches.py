"""dispatch_batches=True on several processes, against accelerate 1.15 run in the same test:
tests/scripts/dispatch_batches.py goes once through accelerate itself (torchrun,
ACCELERATE_USE_CPU=1) and once through accelerate_c's launcher; every rank's batches (nested
ones too), GradientState.remainder and end_of_dataloader, gather_for_metrics results and len()
must be the same, step by step, for the prepared loaders and for the loaders
skip_first_batches makes of them (map-style and iterable; split_batches, even_batches and
drop_last both ways; sizes that do and do not divide)."""
import json
import os
import subprocess
import sys

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "dispatch_batches.py")


def _records(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


# 3 ranks pass too (187 loaders, even_batches both ways; ~53 s on the shared machine, 2026-12-04); left out
# of the suite for its time
@pytest.mark.parametrize("n", [2])
def test_dispatch_matches_accelerate_step_by_step(n, tmp_path):
    pytest.importorskip("accelerate")
    ref_dir, our_dir = tmp_path / "accelerate", tmp_path / "accelerate_c"
    ref_dir.mkdir()
    our_dir.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="1")
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                          SCRIPT, "accelerate", str(ref_dir)], capture_output=True, text=True, timeout=wait_s(300),
                         env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0", SCRIPT, "accelerate_c",
                  str(our_dir)], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    theirs, ours = _records(ref_dir, n), _records(our_dir, n)
    for rank in range(n):
        assert ours[rank].keys() == theirs[rank].keys()
        assert len(theirs[rank]) > 150  # the configurations were all run (257 on 2 ranks, 187 on 3)
        for key, ref in theirs[rank].items():
            for part, want in ref.items():
                got = ours[rank][key][part]
                if isinstance(want, list) and want and isinstance(want[0], dict):
                    assert len(got) == len(want), f"rank {rank}, {key}, {part}: {len(got)} steps, accelerate {len(want)}"
                    for step, (g, w) in enumerate(zip(got, want)):
                        assert g == w, f"rank {rank}, {key}, {part} step {step}: ours {g}, accelerate {w}"
                else:
                    assert got == want, f"rank {rank}, {key}, {part}: ours {got}, accelerate {want}"
