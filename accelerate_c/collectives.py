"""The collectives accelerate_c issues itself (the reducer's buckets and flags, gather/reduce/
broadcast), in one place, so that none can abort a finished run at interpreter exit.

A gloo worker thread destroys a finished work a moment after waking its waiter (and a barrier's
work holds the works issued before it). If that destruction releases a Python object, the
worker must take the GIL; when the interpreter is finalizing by then, CPython ends the thread
inside a noexcept destructor: std::terminate, "terminate called without an active exception"
(SIGABRT) after all work was done. A work can hold Python objects in two ways, both seen in core
dumps here, and each is kept out:
- the `contextvars.Context` torch's `_engine_run_backward` stashes in the thread's C++ state for
  the whole backward (`torch._C._stash_obj_in_tls("context", ...)`), which a collective started
  from a gradient hook or the end-of-backward callback copies into its work: the collectives
  below start without it (it only carries compiler configuration to autograd device threads;
  collectives never read it);
- a tensor whose last Python reference is gone, so that torch handed its Python object to C++
  (~AsyncBarrierWork -> ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil): the
  small tensors below stay referenced from a bounded deque that is never freed, so the worker's
  release is a plain count decrement (large ones are the reducer's buckets and wire buffers,
  which live as long as the model).
torch's own temporaries (inside all_gather_object, say) are out of reach: state.py gives the
workers a moment at exit for those.
"""
from __future__ import annotations

import collections
import ctypes
from contextlib import contextmanager

import torch
import torch.distributed as dist

_KEY = "context"
_API = all(hasattr(torch._C, n) for n in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls",
                                         "_stash_obj_in_tls"))


@contextmanager
def _outside_backward_tls():
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


# the small tensors of the latest collectives (module docstring); the extra reference keeps the
# deque alive through module teardown at exit
_RECENT: collections.deque = collections.deque(maxlen=512)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_RECENT))
_KEEP_MAX_BYTES = 1 << 20


def _keep(tensors):
    _RECENT.extend(t for t in tensors if t.numel() * t.element_size() <= _KEEP_MAX_BYTES)


def all_reduce(t, **kwargs):
    """dist.all_reduce(t, **kwargs) (async_op too), safe at exit (see above)."""
    _keep((t,))
    with _outside_backward_tls():
        return dist.all_reduce(t, **kwargs)


def broadcast(t, src: int):
    _keep((t,))
    with _outside_backward_tls():
        return dist.broadcast(t, src=src)


def all_gather(outs, t):
    _keep((t, *outs))
    with _outside_backward_tls():
        return dist.all_gather(outs, t)



# torch 2.13 names these *_single and deprecates the *_tensor names (a FutureWarning per call);
# older torch (2.11 on the GPU machines) has only the *_tensor names
_ALL_GATHER_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(out, t, **kwargs):
    """Every rank's `t`, concatenated in rank order into `out` (async_op too), safe at exit."""
    _keep((t, out))
    with _outside_backward_tls():
        return _ALL_GATHER_1(out, t, **kwargs)


def reduce_scatter_tensor(out, t, **kwargs):
    """This rank's part of the sum of every rank's `t` into `out` (async_op too), safe at exit."""
    _keep((t, out))
    with _outside_backward_tls():
        return _REDUCE_SCATTER_1(out, t, **kwargs)
