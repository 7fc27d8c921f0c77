"""The data path on 2 processes (tests/scripts/data_path.py, through `accelerate-c launch`):
dispatched vs sharded loading (global batches, training against one process with plain
torch, string columns), stateful loaders resumed mid-epoch through save_state/load_state
(shuffled map-style, iterable, a streaming datasets.IterableDataset dispatched and sharded),
set_epoch reaching a streaming dataset's shuffle; each against plain torch or `datasets` itself.
Then a second launch, tests/scripts/stateful_resume.py, resumes in fresh processes from the
checkpoints the first saved mid-epoch (a streaming dataset with a shuffle buffer, dispatched and
sharded, with and without a data loader worker; a shuffled map-style dataset with a worker) and
must see exactly the batches the uninterrupted run saw after the save, on every rank, through the
next epoch."""
import json
import os

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s


def test_data_path_on_two_processes(tmp_path):
    pytest.importorskip("torchdata")
    pytest.importorskip("datasets")
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "data_path.py"), str(tmp_path)], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "data path OK" in res.stdout

    fresh = tmp_path / "fresh_process"
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "stateful_resume.py"), "resume", str(fresh)], timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    for rank in range(2):
        saved = json.loads((fresh / f"save_rank{rank}.json").read_text())
        resumed = json.loads((fresh / f"resume_rank{rank}.json").read_text())
        assert saved.keys() == resumed.keys() and len(saved) == 5
        for case, want in saved.items():
            assert want["rest_of_epoch"] and want["next_epoch"], f"{case}: the run had batches after the save"
            for part in ("rest_of_epoch", "next_epoch"):
                assert resumed[case][part] == want[part], \
                    f"rank {rank}, {case}, {part}: resumed {resumed[case][part]}, uninterrupted {want[part]}"
