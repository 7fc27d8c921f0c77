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
  which live as long as the model, or views of such buffers made for one collective, which are
  kept too: _keep_views).
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


def _keep_views(tensors):
    """Keeps views of long-lived buffers whatever their size: each is a Python object made for
    one collective (a chunk of a bucket), which would otherwise die with the work on gloo's
    thread; holding it costs no memory beyond the buffer's, which outlives it anyway."""
    _RECENT.extend(tensors)


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


class Works:
    """Several async works waited on as one (in launch order); wait() waits for every one even
    when an earlier one fails, then raises the first failure."""

    __slots__ = ("works",)

    def __init__(self, works):
        self.works = list(works)

    def wait(self) -> bool:
        error = None
        for w in self.works:
            try:
                w.wait()
            except RuntimeError as e:
                error = error or e
        if error is not None:
            raise error
        return True


# gloo's all-gather and reduce-scatter are slow next to its broadcast, reduce and all-reduce on
# the same bytes. Measured here (2 cores, torch 2.13, eight 25 MiB buckets, two in flight;
# benchmarks/bench_chunk_collectives.py): all-gather 0.175 / 0.284 / 0.298 s against one
# broadcast per rank 0.067 / 0.142 / 0.188 s on 2 / 3 / 4 processes; reduce-scatter 0.254 /
# 0.573 / 0.811 s against all-reduce 0.149 / 0.362 / 0.423 s and one reduce per rank 0.194 /
# 0.271 / 0.326 s. So on CPU tensors (gloo) the chunked collectives below are built from
# broadcasts and reduces; on GPUs (NCCL) they are NCCL's own, in place.


def gather_chunks(full, rank: int, world: int, async_op: bool = False):
    """`full` (1-D, `world` equal chunks) gets every rank's chunk: this rank's is already in place
    at chunk `rank`, the others arrive from their ranks (an in-place all-gather)."""
    chunk = full.numel() // world
    if full.is_cuda:
        return all_gather_into_tensor(full, full[rank * chunk:(rank + 1) * chunk], async_op=async_op)
    parts = [full[q * chunk:(q + 1) * chunk] for q in range(world)]
    _keep_views((full, *parts))
    with _outside_backward_tls():
        works = [dist.broadcast(part, src=q, async_op=async_op) for q, part in enumerate(parts)]
    return Works(works) if async_op else None


def reduce_chunks(full, rank: int, world: int, async_op: bool = False):
    """Chunk `rank` of `full` (1-D, `world` equal chunks) becomes the sum over ranks of that chunk
    (an in-place reduce-scatter); the other chunks are left undefined (scratch)."""
    chunk = full.numel() // world
    if full.is_cuda:
        return reduce_scatter_tensor(full[rank * chunk:(rank + 1) * chunk], full, async_op=async_op)
    if world == 2:  # gloo's all-reduce beats two reduces on two processes (above)
        _keep_views((full,))
        with _outside_backward_tls():
            return dist.all_reduce(full, async_op=async_op)
    parts = [full[q * chunk:(q + 1) * chunk] for q in range(world)]
    _keep_views((full, *parts))
    with _outside_backward_tls():
        works = [dist.reduce(part, dst=q, async_op=async_op) for q, part in enumerate(parts)]
    return Works(works) if async_op else None
