"""The accelerate names transformers' Trainer uses (on the Accelerator, its state, its
gradient state and in accelerate.utils), on accelerate_c's objects, compared name by name with
accelerate 1.15's own objects built in the same test. The list is what
transformers/trainer*.py, training_args.py and integrations/ read (grep `self.accelerator.`,
`accelerator.state.`, `from accelerate.utils import`)."""
from __future__ import annotations

import weakref

import accelerate
import accelerate.utils as acc_utils
import accelerate.utils.memory as acc_memory
import pytest
import torch
from torch import nn

import accelerate_c
import accelerate_c.utils as our_utils
from helpers import fresh_state  # noqa: F401  (autouse: fresh singletons per test)

# read on the Accelerator by transformers' Trainer (plain values compared; methods checked callable)
ACCELERATOR_VALUES = ["parallelism_config", "torch_device_mesh", "is_fsdp2", "is_composable_parallelism_enabled",
                      "should_save_model", "deepspeed_plugin", "distributed_type", "num_processes",
                      "sync_gradients", "optimizer_step_was_skipped", "scaler", "gradient_accumulation_steps",
                      "use_distributed", "mixed_precision", "device", "is_main_process", "is_local_main_process",
                      "process_index", "local_process_index", "split_batches", "even_batches",
                      "use_seedable_sampler", "non_blocking"]
ACCELERATOR_METHODS = ["prepare", "prepare_model", "unwrap_model", "gather", "gather_for_metrics",
                       "pad_across_processes", "get_state_dict", "free_memory", "clear", "clip_grad_norm_",
                       "no_sync", "backward", "end_training", "maybe_context_parallel",
                       "deepspeed_ulysses_dl_adapter", "save_model", "wait_for_everyone"]
# read on accelerator.state (transformers uses getattr(state, name, None) for the plugins)
STATE_VALUES = ["fsdp_plugin", "deepspeed_plugin", "parallelism_config", "device_mesh", "is_fsdp2",
                "torch_tp_plugin", "megatron_lm_plugin", "distributed_type", "mixed_precision", "num_processes",
                "process_index", "device", "is_main_process", "is_local_main_process"]
GRADIENT_STATE_VALUES = ["plugin_kwargs", "end_of_dataloader", "sync_gradients", "num_steps", "adjust_scheduler",
                         "sync_with_dataloader", "remainder", "in_dataloader"]
# imported by transformers from accelerate.utils / accelerate.utils.memory / accelerate
UTILS_NAMES = ["DataLoaderConfiguration", "DistributedDataParallelKwargs", "DistributedType",
               "GradientAccumulationPlugin", "release_memory", "find_executable_batch_size",
               "extract_model_from_parallel", "DeepSpeedPlugin", "TorchDynamoPlugin", "clear_device_cache",
               "should_reduce_batch_size", "is_compiled_module"]


def _pair(**kwargs):
    theirs = accelerate.Accelerator(cpu=True, **kwargs)
    ours = accelerate_c.Accelerator(cpu=True, **kwargs)
    return theirs, ours


@pytest.mark.parametrize("config", ["plain", "bf16_accumulate"])
def test_accelerator_state_and_gradient_state_names(config):
    kwargs = {} if config == "plain" else dict(mixed_precision="bf16", gradient_accumulation_plugin=None)
    if config != "plain":
        kwargs.pop("gradient_accumulation_plugin")
        kwargs["gradient_accumulation_steps"] = 3
    theirs, ours = _pair(**kwargs)
    for name in ACCELERATOR_VALUES:
        assert getattr(ours, name, "missing") == getattr(theirs, name), f"Accelerator.{name}"
    for name in ACCELERATOR_METHODS:
        assert callable(getattr(theirs, name)) and callable(getattr(ours, name, None)), f"Accelerator.{name}"
    for name in STATE_VALUES:
        assert getattr(ours.state, name, None) == getattr(theirs.state, name, None), f"state.{name}"
    for name in GRADIENT_STATE_VALUES:
        assert getattr(ours.gradient_state, name, "missing") == getattr(theirs.gradient_state, name), \
            f"gradient_state.{name}"
    # the Trainer sets sync_gradients itself through this private method of accelerate's
    for flag in (False, True):
        theirs.gradient_state._set_sync_gradients(flag)
        ours.gradient_state._set_sync_gradients(flag)
        assert ours.sync_gradients == theirs.sync_gradients == flag


def test_maybe_context_parallel_and_adapter_without_parallelism():
    theirs, ours = _pair()
    t = torch.arange(6).reshape(1, 6)
    for acc in (theirs, ours):
        with acc.maybe_context_parallel(buffers=[t], buffer_seq_dims=[1], no_restore_buffers={t}):
            pass
    assert torch.equal(t, torch.arange(6).reshape(1, 6))  # no buffer sharded, as accelerate
    dl = torch.utils.data.DataLoader(list(range(4)))
    assert ours.deepspeed_ulysses_dl_adapter(dl, None) is dl
    assert theirs.deepspeed_ulysses_dl_adapter(dl, None) is dl


def test_distributed_type_members_and_equality():
    theirs = {m.name: m.value for m in acc_utils.DistributedType}
    ours = {m.name: m.value for m in accelerate_c.DistributedType}
    assert ours == theirs
    for name in theirs:  # transformers compares our value with accelerate's member
        assert getattr(accelerate_c.DistributedType, name) == getattr(acc_utils.DistributedType, name)


def test_utils_names_exist():
    missing = [n for n in UTILS_NAMES if not hasattr(our_utils, n)]
    assert not missing, missing
    for n in UTILS_NAMES:
        assert hasattr(acc_utils, n) or hasattr(acc_memory, n), n


# ---------------------------------------------------------------------- find_executable_batch_size

OOM_MESSAGES = ["CUDA out of memory. Tried to allocate 2.00 GiB", "[enforce fail at alloc_cpu.cpp:117] data. "
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes",
                "HIP out of memory. Tried to allocate"]


def _search(find, fits_at, message, **kw):
    tried = []

    @find(starting_batch_size=kw.pop("start", 128), **kw)
    def train(batch_size, scale):
        tried.append(batch_size)
        if batch_size > fits_at:
            raise RuntimeError(message)
        return batch_size * scale

    return train(2), tried


@pytest.mark.parametrize("message", OOM_MESSAGES)
def test_find_executable_batch_size_matches_accelerate(message):
    # each retry collects garbage (slow with torch loaded): few retries per case, the longer
    # search for one message only
    cases = ((128, 128), (128, 100), (12, 5)) if message == OOM_MESSAGES[0] else ((16, 12),)
    for start, fits_at in cases:
        assert _search(our_utils.find_executable_batch_size, fits_at, message, start=start) == \
            _search(acc_utils.find_executable_batch_size, fits_at, message, start=start)
    # a user's shrinking rule (e.g. halving)
    for find in (our_utils.find_executable_batch_size, acc_utils.find_executable_batch_size):
        size = [64]

        def halve():
            size[0] //= 2
            return size[0]
        assert _search(find, 10, message, start=64, reduce_batch_size_fn=halve) == (16, [64, 32, 16, 8])


def test_find_executable_batch_size_errors_like_accelerate():
    def run(find, exc):
        @find(starting_batch_size=4)
        def f(batch_size):
            raise exc
        with pytest.raises(Exception) as info:
            f()
        return type(info.value)

    for exc in (ValueError("not memory"), RuntimeError("CUDA out of memory.", "two args"),
                RuntimeError("CUDA out of memory.")):  # the last one never fits: size reaches 0
        assert run(our_utils.find_executable_batch_size, exc) is run(acc_utils.find_executable_batch_size, exc)
    for find in (our_utils.find_executable_batch_size, acc_utils.find_executable_batch_size):
        @find(starting_batch_size=4)
        def g(batch_size, x):
            return x
        with pytest.raises(TypeError):
            g(4, 1)  # the batch size passed by hand
    for exc in [RuntimeError(m) for m in OOM_MESSAGES] + [ValueError(OOM_MESSAGES[0]), RuntimeError("x")]:
        assert our_utils.should_reduce_batch_size(exc) == acc_memory.should_reduce_batch_size(exc)


def test_release_memory_drops_references():
    class Box:
        pass

    for release in (our_utils.release_memory, acc_utils.release_memory):
        a, b = Box(), Box()
        ref = weakref.ref(a)
        out = release(a, b)
        assert out == [None, None] and isinstance(out, list)
        a, b = out
        assert ref() is None


# ---------------------------------------------------------------------- extract_model_from_parallel


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.inner(x))


def test_extract_model_from_parallel_matches_accelerate():
    for extract in (our_utils.extract_model_from_parallel, acc_utils.extract_model_from_parallel):
        m = Net()
        assert extract(nn.DataParallel(nn.DataParallel(m))) is m
        compiled = torch.compile(m)
        assert extract(compiled) is compiled and compiled._orig_mod is m
        assert extract(compiled, keep_torch_compile=False) is m
        wrapped = nn.DataParallel(m)
        assert extract(torch.compile(wrapped), keep_torch_compile=False) is m
        m2 = Net()
        inner = m2.inner
        m2.inner = nn.DataParallel(inner)
        assert extract(m2) is m2 and isinstance(m2.inner, nn.DataParallel)  # not recursive: kept
        assert extract(m2, recursive=True) is m2 and m2.inner is inner


def test_extract_model_from_parallel_drops_the_mixed_precision_forward():
    x = torch.randn(3, 4)
    for acc_cls, extract in ((accelerate.Accelerator, acc_utils.extract_model_from_parallel),
                             (accelerate_c.Accelerator, our_utils.extract_model_from_parallel)):
        torch.manual_seed(0)
        acc = acc_cls(cpu=True, mixed_precision="bf16")
        model = acc.prepare(Net())
        with torch.no_grad():
            ref = model.head(model.inner(x))  # fp32 modules called directly
            assert not torch.equal(model(x), ref)  # bf16 autocast in the prepared forward
            plain = extract(model, keep_fp32_wrapper=False)
            assert plain is model and torch.equal(plain(x), ref)
