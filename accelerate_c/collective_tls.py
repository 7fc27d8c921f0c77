"""Collectives started during backward must not capture Python objects.

torch's `_engine_run_backward` stashes a `contextvars.Context` in the thread's C++ state for the
whole backward (`torch._C._stash_obj_in_tls("context", ...)`). A gloo collective copies that
state into its work object when it is created, so a work launched from a gradient hook or the
end-of-backward callback holds a Python object. The gloo worker thread that ran it drops its
reference just after waking the waiter; when that is the last reference (the main thread has
already dropped its own), the worker must take the GIL to release the Context. If the
interpreter is finalizing by then, CPython ends the worker thread inside that destructor, which
is noexcept: std::terminate, "terminate called without an active exception" (SIGABRT) after a
finished run. Starting our collectives without the stashed object removes the Python object
from the work, so its destruction never needs the GIL. The Context only carries compiler
configuration to autograd device threads; our collectives never read it.
"""
from __future__ import annotations

import collections
import ctypes
from contextlib import contextmanager

import torch

_KEY = "context"
_API = all(hasattr(torch._C, n) for n in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls",
                                         "_stash_obj_in_tls"))


@contextmanager
def outside_backward_tls():
    """Runs the body without the object torch stashed for the current backward (put back after)."""
    if not _API or not torch._C._is_key_in_tls(_KEY):
        yield
        return
    ctx = torch._C._get_obj_in_tls(_KEY)
    torch._C._remove_obj_from_tls(_KEY)
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls(_KEY, ctx)


# The tensors handed to recent collectives, kept referenced from Python. A gloo worker thread
# destroys a finished work some time after waking its waiter (and a barrier's work holds the
# works issued before it). If the work's tensors have no Python reference left by then, torch
# has handed their Python objects to C++, and the worker must take the GIL to release them:
# when that happens while the interpreter finalizes, the worker is ended inside a noexcept
# destructor (std::terminate; seen in a core dump: ~AsyncBarrierWork -> ~AsyncAllgatherWork ->
# TensorImpl::decref_pyobject -> take_gil). While Python still references a tensor, the
# worker's release is a plain count decrement. The deque is bounded (old works are long gone
# when their tensors drop out) and never freed, so that module teardown at exit does not drop
# the last ones while a worker may still hold them.
_RECENT: collections.deque = collections.deque(maxlen=512)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_RECENT))


_KEEP_MAX_BYTES = 1 << 20


def keep(*tensors):
    """Keeps Python references to small tensors given to a collective (see _RECENT; flags,
    shapes, gathered metrics); returns the first. Larger ones are not kept, so the deque cannot
    hold much memory: the reducer's buckets live as long as the model anyway."""
    _RECENT.extend(t for t in tensors if t.numel() * t.element_size() <= _KEEP_MAX_BYTES)
    return tensors[0] if tensors else None
