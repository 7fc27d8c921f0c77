"""Regression tests for what accelerate's own multi-process test scripts found missing in
accelerate_c (tests/test_accelerate_scripts.py runs those scripts): each compared with
accelerate itself or with plain torch."""
import os
import sys

import pytest

from test_launch import SCRIPTS, launch
from timeouts import wait_s


def test_distributed_type_has_every_member_of_accelerate():
    from accelerate.utils import DistributedType as Ref

    from accelerate_c.utils import DistributedType

    assert [m.name for m in Ref] == [m.name for m in DistributedType]
    for m in Ref:
        assert DistributedType[m.name] == m.value and getattr(DistributedType, m.name) == getattr(Ref, m.name)


def test_utils_export_the_names_accelerates_scripts_import():
    import accelerate.utils as ref

    import accelerate_c.utils as ours

    for name in ("synchronize_rng_states", "synchronize_rng_state", "copy_tensor_to_devices",
                 "DistributedOperationException"):
        assert hasattr(ref, name) or hasattr(ref.operations, name), name
        assert hasattr(ours, name), name


def test_state_after_reset_says_why_like_accelerate():
    import torch

    from accelerate_c import Accelerator, AcceleratorState, PartialState

    acc = Accelerator(cpu=True)
    assert acc.state.debug is False  # accelerate's attribute (ACCELERATE_DEBUG_MODE)
    AcceleratorState._reset_state()
    with pytest.raises(AttributeError) as e:
        acc.prepare(torch.nn.Linear(1, 1))
    # accelerate's wording, which its own test_script.py checks
    assert "`AcceleratorState` object has no attribute `device`" in str(e.value)
    assert "This happens if `AcceleratorState._reset_state()`" in str(e.value)
    with pytest.raises(AttributeError, match="'PartialState' object has no attribute 'nope'"):
        PartialState().nope  # noqa: B018 -- unknown names: the usual message


def test_join_uneven_inputs_is_a_plain_block_on_one_process():
    import warnings

    from accelerate_c import Accelerator

    acc = Accelerator(cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # accelerate warns only on distributed types other than NO
        with acc.join_uneven_inputs([], even_batches=False) as got:
            assert got is None


@pytest.mark.parametrize("n", [2, 3])
def test_collective_gaps_on_n_processes(n):
    res = launch(["--num_processes", str(n), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "wheel_ops.py")], timeout=wait_s(180))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"wheel ops OK on {n} processes" in res.stdout


@pytest.mark.parametrize("n,length", [(2, 4), (2, 3), (3, 5), (3, 7)])
@pytest.mark.parametrize("pad", [False, True])
def test_split_between_processes_selects_rows_of_a_datasets_dataset(monkeypatch, n, length, pad):
    """A datasets.Dataset is split by row (Dataset.select), as accelerate does: slicing one
    would give a dict of columns. A stand-in module (the real package: accelerate's own
    test_split_between_processes_dataset, through the wheel-script runner) with
    the same select/len/row-slicing behaviour is used; rows must match the list split, which
    accelerate's own test_script.py checks (test_split_between_processes_list)."""
    import types

    from accelerate_c.state import _split

    class Dataset:
        def __init__(self, rows):
            self.rows = list(rows)

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, key):  # like datasets: a slice gives columns, not a Dataset
            if isinstance(key, slice):
                return {"k": [r["k"] for r in self.rows[key]]}
            return self.rows[key]

        def select(self, indices):
            return Dataset([self.rows[i] for i in indices])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(Dataset=Dataset))
    values = list(range(length))
    data = Dataset({"k": v} for v in values)
    for rank in range(n):
        got = _split(data, n, rank, pad)
        assert isinstance(got, Dataset)
        assert [row["k"] for row in got.rows] == _split(values, n, rank, pad)
