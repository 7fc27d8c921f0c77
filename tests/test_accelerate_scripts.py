"""accelerate's own multi-process test scripts, from the pinned accelerate wheel
(requirements-dev.txt: accelerate==1.15.0), run against accelerate_c on 2 CPU (gloo) ranks
through `accelerate-c launch`, and on 3 ranks (THREE_RANKS).

tests/scripts/accelerate_wheel/ rewrites each script's imports to accelerate_c at test time
(nothing is copied into the repository) and calls its test functions one by one with the
set-up its main() does. Every function of every script is in exactly one of PASS,
NOT_APPLICABLE or KNOWN_FAILURES below, so nothing is skipped silently; docs/accelerate-scripts.md
has the table.
"""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "accelerate_wheel"))

from run import run_script  # noqa: E402
from specs import functions  # noqa: E402
from timeouts import wait_s

_GA = "test_gradient_accumulation[split_batches={},dispatch_batches={},sync_each_batch={}]"
_GAS = "test_gradient_accumulation_with_opt_and_scheduler[split_batches={},dispatch_batches={},sync_each_batch={}]"

PASS = {
    "test_ops.py": [
        "test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
        "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max", "test_op_checker",
        # returns at once on MULTI_CPU (the script runs it on GPUs/XLA); tests/test_wheel_ops.py checks ours
        "test_copy_tensor_to_devices",
    ],
    "test_script.py": [
        "init_state_check", "process_execution_check", "test_split_between_processes_list",
        "test_split_between_processes_nested_dict", "test_split_between_processes_tensor",
        "test_split_between_processes_evenly", "test_split_between_processes_dataset", "rng_sync_check",
        "dl_preparation_check", "central_dl_preparation_check", "custom_sampler_check",
        "check_seedable_sampler", "check_seedable_sampler_with_data_seed",
        "check_seedable_sampler_in_batch_sampler_shard", "training_check[use_seedable_sampler=False]",
        "training_check[use_seedable_sampler=True]", "test_trigger", "test_reinstantiated_state",
    ],
    "test_sync.py": [
        "test_dataloader_break", "test_distributed_sync", "test_distributed_sync_multiple_fwd",
        _GA.format(True, False, False), _GA.format(False, False, False),
        _GAS.format(False, False, False), _GAS.format(True, False, False),
        _GA.format(True, False, True), _GA.format(False, False, True),
        _GAS.format(True, False, True), _GAS.format(False, False, True),
        *[f.format(s, True, e) for f in (_GA, _GAS) for s in (True, False) for e in (True, False)],
    ],
    "test_distributed_data_loop.py": [
        "test_default_ensures_even_batch_sizes", "test_can_disable_even_batches",
        "test_join_can_override_even_batches", "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches",
        "test_join_raises_warning_for_non_ddp_distributed", "test_pickle_accelerator",
        "test_data_loader[shuffle=False]", "test_data_loader[shuffle=True]", "test_data_loader[batch_sampler]",
        "test_data_loader[sampler=BatchSampler]", "test_can_join_uneven_inputs", "test_stateful_dataloader",
        # the runner gives every rank rank 0's temporary directory (specs._SharedTemporaryDirectory):
        # save_state writes one checkpoint with all processes, into one directory
        "test_stateful_dataloader_save_state",
    ],
}

NOT_APPLICABLE = {
    "test_sync.py": {
        "test_noop_sync": "main() runs it on one process only (DistributedType.NO); these runs are multi-process",
    },
}

KNOWN_FAILURES: dict = {}  # every function that tests public behaviour passes

SCRIPTS = list(PASS)

# On 3 ranks: every function PASS lists except those no implementation can pass with 3
# processes, each named with its reason (accelerate fails them the same way:
# test_three_rank_exclusions checks the reasons against accelerate 1.15's own objects; the
# test_script.py ones were also run against accelerate itself, `run.py --nproc 3 --reference`).
_SPLIT = "split_batches with a batch size of {} on 3 processes: ValueError, not a multiple (as accelerate)"
_TWO = "builds its accelerator with create_accelerator(), which asserts exactly two processes"
THREE_RANK_EXCLUDED = {
    "test_ops.py": {},
    "test_script.py": {
        "test_split_between_processes_tensor": "splits a 2-row tensor and expects a row on every process: "
                                               "the third gets none (as with accelerate)",
        "dl_preparation_check": _SPLIT.format(8),
        "central_dl_preparation_check": _SPLIT.format(8),
    },
    "test_sync.py": {name: _SPLIT.format(16) for name in PASS["test_sync.py"] if "split_batches=True" in name},
    "test_distributed_data_loop.py": {name: _TWO for name in (
        "test_default_ensures_even_batch_sizes", "test_can_disable_even_batches", "test_can_join_uneven_inputs",
        "test_join_can_override_even_batches", "test_join_can_override_for_mixed_type_dataloaders",
        "test_join_raises_warning_for_iterable_when_overriding_even_batches", "test_pickle_accelerator")},
}
THREE_RANKS = {script: [n for n in PASS[script] if n not in excluded]
               for script, excluded in THREE_RANK_EXCLUDED.items()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_function_is_accounted_for(script):
    listed = PASS[script] + list(NOT_APPLICABLE.get(script, {})) + list(KNOWN_FAILURES.get(script, {}))
    assert sorted(listed) == sorted(functions(script)), "every function must be in exactly one list"
    assert len(set(listed)) == len(listed)


def _assert_all_pass(results):
    failed = {name: r for name, r in results.items() if r["status"] != "pass"}
    report = "\n".join(f"{name}: {r['status']} {r['errors']}\n{next(iter(r['tracebacks'].values()), '')}"
                       for name, r in failed.items())
    assert not failed, report


@pytest.mark.parametrize("script", SCRIPTS)
def test_wheel_script_passes_on_two_ranks(script):
    _assert_all_pass(run_script(script, nproc=2, only=PASS[script], timeout=wait_s(240),
                                collective_timeout=wait_s(60)))


@pytest.mark.parametrize("script", list(THREE_RANKS))
def test_wheel_script_passes_on_three_ranks(script):
    assert set(THREE_RANK_EXCLUDED[script]) <= set(PASS[script])
    _assert_all_pass(run_script(script, nproc=3, only=THREE_RANKS[script], timeout=wait_s(240),
                                collective_timeout=wait_s(60)))


def test_three_rank_exclusions():
    """The reasons THREE_RANK_EXCLUDED gives, checked against accelerate 1.15's own objects and ours
    in this process: split_batches refuses 8 and 16 on 3 processes; split_between_processes gives
    the third process none of a 2-row tensor."""
    import types

    import torch
    from torch.utils.data import DataLoader

    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import prepare_data_loader as theirs
    from accelerate.state import PartialState as TheirState

    from accelerate_c.data_loader import prepare_data_loader as ours
    from accelerate_c.state import PartialState as OurState

    assert accelerate.__version__ == "1.15.0"
    for prepare in (theirs, ours):
        for bs in (8, 16):
            with pytest.raises(ValueError, match=f"batch size \\({bs}\\).*number of processes \\(3\\)"):
                prepare(DataLoader(range(96), batch_size=bs), num_processes=3, process_index=0, split_batches=True)
    data = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    for cls in (TheirState, OurState):
        rows = []
        for rank in range(3):
            fake = types.SimpleNamespace(num_processes=3, process_index=rank, device=torch.device("cpu"))
            with cls.split_between_processes(fake, data) as part:
                rows.append(len(part))
        assert rows == [1, 1, 0], (cls, rows)
