"""How to call each test function of accelerate's multi-process test scripts, one at a time,
with the same set-up the script's own main() does. `mod` is the imported (rewritten) script,
`ctx` what the set-up returned. Entries are in main()'s order.

An entry's `when` (optional) says when main() would run it; when it returns a string instead
of None, the function is recorded as "skip" with that reason (not counted as a pass)."""
from __future__ import annotations

import itertools


def _multi(ctx):
    return None if ctx["n"] > 1 else "main() runs it on several processes only"


# ---- test_ops.py -----------------------------------------------------------------------------
def _ops_setup(mod):
    state = mod.PartialState()
    return {"state": state, "n": state.num_processes}


def _ops(name):
    def call(mod, ctx):
        try:
            getattr(mod, name)(ctx["state"])
        finally:
            ctx["state"].debug = False  # test_op_checker sets it; a failure must not leak it
    return call


OPS = [(name, _ops(name), None) for name in (
    "test_gather", "test_gather_object", "test_gather_non_contiguous", "test_broadcast",
    "test_pad_across_processes", "test_reduce_sum", "test_reduce_mean", "test_reduce_max", "test_op_checker",
    "test_copy_tensor_to_devices")]


# ---- test_script.py --------------------------------------------------------------------------
def _script_setup(mod):
    accelerator = mod.Accelerator()
    return {"accelerator": accelerator, "n": accelerator.num_processes}


def _plain(name, *args, **kwargs):
    return lambda mod, ctx: getattr(mod, name)(*args, **kwargs)


def _dataset_split(mod, ctx):
    from datasets import Dataset

    mod.test_split_between_processes_dataset(Dataset)


def _needs_datasets(ctx):
    try:
        import datasets  # noqa: F401
    except ImportError:
        return "Hugging Face datasets is not installed (main() skips it too)"
    return None


SCRIPT = [
    ("init_state_check", _plain("init_state_check"), None),
    ("process_execution_check", _plain("process_execution_check"), None),
    ("test_split_between_processes_list", _plain("test_split_between_processes_list"), None),
    ("test_split_between_processes_nested_dict", _plain("test_split_between_processes_nested_dict"), None),
    ("test_split_between_processes_tensor", _plain("test_split_between_processes_tensor"), None),
    ("test_split_between_processes_evenly", _plain("test_split_between_processes_evenly"), None),
    ("test_split_between_processes_dataset", _dataset_split, _needs_datasets),
    ("rng_sync_check", _plain("rng_sync_check"), None),
    ("dl_preparation_check", _plain("dl_preparation_check"), None),
    ("central_dl_preparation_check", _plain("central_dl_preparation_check"), None),
    ("custom_sampler_check", _plain("custom_sampler_check"), None),
    ("check_seedable_sampler", _plain("check_seedable_sampler"), None),
    ("check_seedable_sampler_with_data_seed", _plain("check_seedable_sampler_with_data_seed"), None),
    ("check_seedable_sampler_in_batch_sampler_shard", _plain("check_seedable_sampler_in_batch_sampler_shard"),
     _multi),
    ("training_check[use_seedable_sampler=False]", _plain("training_check", use_seedable_sampler=False), None),
    ("training_check[use_seedable_sampler=True]", _plain("training_check", use_seedable_sampler=True), None),
    ("test_trigger", _plain("test_trigger"), None),
    ("test_reinstantiated_state", _plain("test_reinstantiated_state"), None),
]


# ---- test_sync.py ----------------------------------------------------------------------------
def _sync_setup(mod):
    accelerator = mod.Accelerator()
    return {"accelerator": accelerator, "n": accelerator.num_processes}


def _with_acc(name):
    return lambda mod, ctx: getattr(mod, name)(ctx["accelerator"])


def _single(ctx):
    return None if ctx["n"] == 1 else "main() runs it on one process only (DistributedType.NO)"


def _flags(split, dispatch, each):
    return f"split_batches={split},dispatch_batches={dispatch},sync_each_batch={each}"


SYNC = [
    ("test_dataloader_break", _plain("test_dataloader_break"), None),
    ("test_noop_sync", _with_acc("test_noop_sync"), _single),
    ("test_distributed_sync", _with_acc("test_distributed_sync"), _multi),
    ("test_distributed_sync_multiple_fwd", _with_acc("test_distributed_sync_multiple_fwd"), _multi),
]
# main() runs these two families on MULTI_GPU/NPU/... but not on MULTI_CPU (except the default
# variant of the second); we run them on CPU ranks anyway
for _s, _d, _e in itertools.product([True, False], repeat=3):
    SYNC.append((f"test_gradient_accumulation[{_flags(_s, _d, _e)}]",
                 _plain("test_gradient_accumulation", _s, _d, _e), None))
SYNC.append((f"test_gradient_accumulation_with_opt_and_scheduler[{_flags(False, False, False)}]",
             _plain("test_gradient_accumulation_with_opt_and_scheduler"), None))
for _s, _d, _e in itertools.product([True, False], repeat=3):
    if not (_s or _d or _e):
        continue
    SYNC.append((f"test_gradient_accumulation_with_opt_and_scheduler[{_flags(_s, _d, _e)}]",
                 _plain("test_gradient_accumulation_with_opt_and_scheduler", _s, _d, _e), None))


# ---- test_distributed_data_loop.py -----------------------------------------------------------
def _loop_setup(mod):
    import torch

    accelerator = mod.Accelerator(dataloader_config=mod.DataLoaderConfiguration(even_batches=True))
    n = accelerator.num_processes
    if n == 2:
        accelerator = mod.create_accelerator()
    torch.manual_seed(accelerator.process_index)
    return {"accelerator": accelerator, "n": n}


def _two(ctx):
    return None if ctx["n"] == 2 else "the script asserts exactly two processes"


# The functions below that take main()'s accelerator work on any number of processes (their data
# is sized by it); main() itself asserts two, so these are run on other counts as the runner's own
# choice. The others build their accelerator with create_accelerator(), which asserts two.


def _non_ddp_warning(mod, ctx):
    acc = ctx["accelerator"]
    original = acc.state.distributed_type
    acc.state.distributed_type = mod.DistributedType.FSDP
    try:
        mod.test_join_raises_warning_for_non_ddp_distributed(acc)
    finally:
        acc.state.distributed_type = original


def _loader(kind):
    def call(mod, ctx):
        from torch.utils.data import BatchSampler, DataLoader, RandomSampler, default_collate

        dataset = mod.DummyDataset()
        bs, nw = mod.BATCH_SIZE, mod.NUM_WORKERS
        if kind == "shuffle=False":
            loader = DataLoader(dataset, shuffle=False, batch_size=bs, num_workers=nw)
        elif kind == "shuffle=True":
            loader = DataLoader(dataset, shuffle=True, batch_size=bs, num_workers=nw)
        elif kind == "batch_sampler":
            sampler = BatchSampler(RandomSampler(dataset), batch_size=bs, drop_last=False)
            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=nw)
        else:
            sampler = BatchSampler(RandomSampler(dataset), batch_size=bs, drop_last=False)
            loader = DataLoader(dataset, sampler=sampler, batch_size=None, collate_fn=default_collate,
                                num_workers=nw)
        mod.test_data_loader(loader, ctx["accelerator"])
    return call


class _SharedTemporaryDirectory:
    """tempfile.TemporaryDirectory for a script whose every rank makes its own and passes it to
    save_state: here every rank gets rank 0's (accelerate_c's save_state writes one checkpoint
    with all processes together, into one directory, and refuses different ones by name;
    accelerate lets each process write into its own)."""

    def __init__(self, *args, **kwargs):
        import tempfile

        import torch.distributed as dist

        self._own = tempfile.TemporaryDirectory(*args, **kwargs) if dist.get_rank() == 0 else None
        name = [self._own.name if self._own is not None else None]
        dist.broadcast_object_list(name, src=0)
        self.name = name[0]

    def __enter__(self):
        return self.name

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.barrier()  # every rank is done with it before rank 0 removes it
        if self._own is not None:
            self._own.cleanup()


def _stateful_save_state(mod, ctx):
    import types

    original = mod.tempfile
    mod.tempfile = types.SimpleNamespace(TemporaryDirectory=_SharedTemporaryDirectory)
    try:
        mod.test_stateful_dataloader_save_state(ctx["accelerator"])
    finally:
        mod.tempfile = original


LOOP = [
    ("test_default_ensures_even_batch_sizes", _plain("test_default_ensures_even_batch_sizes"), _two),
    ("test_can_disable_even_batches", _plain("test_can_disable_even_batches"), _two),
    ("test_can_join_uneven_inputs", _plain("test_can_join_uneven_inputs"), _two),
    ("test_join_can_override_even_batches", _plain("test_join_can_override_even_batches"), _two),
    ("test_join_can_override_for_mixed_type_dataloaders", _plain("test_join_can_override_for_mixed_type_dataloaders"),
     _two),
    ("test_join_raises_warning_for_iterable_when_overriding_even_batches",
     _plain("test_join_raises_warning_for_iterable_when_overriding_even_batches"), _two),
    ("test_join_raises_warning_for_non_ddp_distributed", _non_ddp_warning, None),
    ("test_pickle_accelerator", _plain("test_pickle_accelerator"), _two),
    ("test_data_loader[shuffle=False]", _loader("shuffle=False"), None),
    ("test_data_loader[shuffle=True]", _loader("shuffle=True"), None),
    ("test_data_loader[batch_sampler]", _loader("batch_sampler"), None),
    ("test_data_loader[sampler=BatchSampler]", _loader("sampler=BatchSampler"), None),
    ("test_stateful_dataloader", _with_acc("test_stateful_dataloader"), None),
    ("test_stateful_dataloader_save_state", _stateful_save_state, None),
]


SPECS = {
    "test_ops.py": (_ops_setup, OPS),
    "test_script.py": (_script_setup, SCRIPT),
    "test_sync.py": (_sync_setup, SYNC),
    "test_distributed_data_loop.py": (_loop_setup, LOOP),
}


def functions(script: str) -> list:
    return [name for name, _, _ in SPECS[script][1]]
