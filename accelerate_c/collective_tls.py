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
