"""Stateful data loaders resumed in a fresh process (tests/scripts/stateful_resume.py on 2
processes through `accelerate-c launch`): a first launch runs uninterrupted and save_state's
mid-epoch, a second one load_state's and must see exactly the batches the first saw after the
save, on every rank, through the next epoch. A streaming datasets.IterableDataset with a
shuffle buffer (dispatched and sharded, with and without a data loader worker) and a shuffled
map-style dataset with a worker; the first run's streaming epochs are checked against datasets'
own order."""
import json
import os

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s

SCRIPT = os.path.join(SCRIPTS, "stateful_resume.py")


def test_resume_in_a_fresh_process_sees_what_the_uninterrupted_run_saw(tmp_path):
    pytest.importorskip("torchdata")
    pytest.importorskip("datasets")
    for mode in ("save", "resume"):
        res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0", SCRIPT, mode, str(tmp_path)],
                     timeout=wait_s(300))
        assert res.returncode == 0, f"{mode}: " + res.stdout[-3000:] + res.stderr[-5000:]
    for rank in range(2):
        saved = json.loads((tmp_path / f"save_rank{rank}.json").read_text())
        resumed = json.loads((tmp_path / f"resume_rank{rank}.json").read_text())
        assert saved.keys() == resumed.keys()
        for case, want in saved.items():
            assert want["rest_of_epoch"] and want["next_epoch"], f"{case}: the run had batches after the save"
            for part in ("rest_of_epoch", "next_epoch"):
                assert resumed[case][part] == want[part], \
                    f"rank {rank}, {case}, {part}: resumed {resumed[case][part]}, uninterrupted {want[part]}"
