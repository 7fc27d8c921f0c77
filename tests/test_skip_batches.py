"""skip_first_batches on several processes, against accelerate 1.15 run in the same test:
tests/scripts/skip_batches.py goes once through accelerate itself (torchrun, ACCELERATE_USE_CPU=1)
and once through accelerate_c's launcher; every rank's batches, GradientState.remainder,
end_of_dataloader and gather_for_metrics results must be the same, step by step, for the
prepared loaders and for the loaders skip_first_batches makes of them."""
import json
import os
import subprocess
import sys

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "skip_batches.py")


def _run_accelerate(n, out_dir):
    env = dict(os.environ, ACCELERATE_USE_CPU="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(n),
                           SCRIPT, "accelerate", str(out_dir)], capture_output=True, text=True, timeout=wait_s(600), env=env)


def _records(out_dir, n):
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(n)]


@pytest.mark.parametrize("n", [2, 3])
def test_skip_first_batches_matches_accelerate_step_by_step(n, tmp_path):
    pytest.importorskip("accelerate")
    ref_dir, our_dir = tmp_path / "accelerate", tmp_path / "accelerate_c"
    ref_dir.mkdir()
    our_dir.mkdir()
    res = _run_accelerate(n, ref_dir)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0", SCRIPT, "accelerate_c",
                  str(our_dir)], timeout=wait_s(600))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    theirs, ours = _records(ref_dir, n), _records(our_dir, n)
    for rank in range(n):
        assert ours[rank].keys() == theirs[rank].keys()
        assert any(v["skipped"] for v in theirs[rank].values())  # the configurations do yield batches
        for key, ref in theirs[rank].items():
            for part in ("prepared", "skipped"):
                got, want = ours[rank][key][part], ref[part]
                assert len(got) == len(want), f"rank {rank}, {key}, {part}: {len(got)} steps, accelerate {len(want)}"
                for step, (g, w) in enumerate(zip(got, want)):
                    assert g == w, f"rank {rank}, {key}, {part} step {step}: ours {g}, accelerate {w}"
