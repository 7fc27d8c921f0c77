"""accelerate.utils.memory's helpers for out-of-memory handling: retry a function with a
smaller batch size (`find_executable_batch_size`), drop references and empty the caches
(`release_memory`, `clear_device_cache`). transformers' Trainer imports all of them; their
behaviour is accelerate 1.15's (checked side by side in tests/test_accelerate_names.py)."""
from __future__ import annotations

import functools
import gc
import inspect

import torch

# the messages torch raises for an allocation that failed (one RuntimeError argument), and
# cuDNN's "no algorithm for this shape", which a smaller batch also cures: accelerate's list
_OOM_MARKERS = (
    " out of memory.",                                   # CUDA / HIP / XPU allocators
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",        # the CPU allocator
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",  # HPU
)

# accelerate 1.15 shrinks the batch to int(0.9 * size) per failure (older releases halved it)
_SHRINK = 0.9


def clear_device_cache(garbage_collection: bool = False) -> None:
    """Returns cached device memory to the driver (CUDA here: the only accelerator accelerate_c
    runs on), after a garbage collection when asked (slow: use sparingly)."""
    if garbage_collection:
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def release_memory(*objects) -> list:
    """A list of as many Nones as `objects`, after a garbage collection and an emptied device
    cache: `a, b = release_memory(a, b)` drops the caller's references."""
    released = [None] * len(objects)
    clear_device_cache(garbage_collection=True)
    return released


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether `exception` is an out-of-memory error (or cuDNN's unsupported-shape error) that
    a smaller batch may avoid: a RuntimeError whose single argument carries one of torch's
    messages for it."""
    if not isinstance(exception, RuntimeError) or len(exception.args) != 1:
        return False
    text = exception.args[0]
    return isinstance(text, str) and any(marker in text for marker in _OOM_MARKERS)


def find_executable_batch_size(function=None, starting_batch_size: int = 128, reduce_batch_size_fn=None):
    """Decorator: calls `function(batch_size, *args, **kwargs)` starting at
    `starting_batch_size`; after an out-of-memory error (`should_reduce_batch_size`) the device
    cache is emptied and the call repeated with a smaller size (`reduce_batch_size_fn()`, or
    int(0.9 * size)); other errors propagate. A size of 0 ends the search with a RuntimeError.
    The size reached is kept between calls of the decorated function. Calling it with the batch
    size as an argument is a TypeError (the decorator supplies it)."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    size = starting_batch_size

    def shrink():
        return int(size * _SHRINK)

    next_size = reduce_batch_size_fn if reduce_batch_size_fn is not None else shrink

    @functools.wraps(function)
    def run(*args, **kwargs):
        nonlocal size
        clear_device_cache(garbage_collection=True)
        names = list(inspect.signature(function).parameters)
        if len(args) + 1 > len(names):
            passed = ", ".join(f"{n}={v}" for n, v in zip(names[1:], args[1:]))
            raise TypeError(f"find_executable_batch_size: {function.__name__} got the batch size as its first "
                            f"argument, but the decorator passes it; call {function.__name__}({passed})")
        while True:
            if size == 0:
                raise RuntimeError("find_executable_batch_size: no executable batch size found, reached zero")
            try:
                return function(size, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - only out-of-memory errors are retried
                if not should_reduce_batch_size(e):
                    raise
                clear_device_cache(garbage_collection=True)
                size = next_size()

    return run
