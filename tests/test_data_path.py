"""The data path on 2 processes (tests/scripts/data_path.py, through `accelerate-c launch`):
dispatched vs sharded loading (global batches, training against one process with plain
torch, string columns), stateful loaders resumed mid-epoch through save_state/load_state
(shuffled map-style, iterable, a streaming datasets.IterableDataset dispatched and sharded),
set_epoch reaching a streaming dataset's shuffle; each against plain torch or `datasets` itself."""
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
