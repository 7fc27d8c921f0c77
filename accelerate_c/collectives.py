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
import os
import warnings
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


# ---- the CPU communicator ----------------------------------------------------------------------
# The default process group's shared-memory communicator (shm.ShmGroup), when select_cpu_comm()
# chose it; the collectives below send the CPU tensors it supports through it and everything
# else through torch.distributed. Each channel keeps its own call order, the same on every rank.
_SHM = None
_SHM_FOR = None  # the default group the communicator was made for
ENV_COMM = "ACCELERATE_C_COMM"
# "0": gradient buffers stay private memory even over shared memory (their buckets then go through
# the segment's slots, a copy in and out): what a /dev/shm too small for them gets anyway
ENV_SHM_WINDOWS = "ACCELERATE_C_SHM_WINDOWS"


def select_cpu_comm(choice: str | None = None, timeout_s: float | None = None) -> str:
    """Decides, once per default process group, how CPU collectives travel: "shm" (shared memory,
    when every rank is on this host) or "gloo". `choice` (else ACCELERATE_C_COMM): "shm", "gloo"
    or "auto" (the default: shared memory within each host, where /dev/shm has the room;
    docs/collectives.md).
    timeout_s: the collectives' timeout (default: the process group's backend default). A
    collective of the default group when it makes the communicator. Returns what is in use."""
    global _SHM, _SHM_FOR
    world = dist.group.WORLD
    explicit = choice is not None
    choice = (choice or os.environ.get(ENV_COMM) or "auto").strip().lower()
    if choice not in ("shm", "gloo", "auto"):
        raise ValueError(f"{'CpuCommKwargs(comm=...)' if explicit else ENV_COMM}={choice!r}: use 'shm', 'gloo' or "
                         "'auto'")
    if _SHM_FOR is world and world is not None and not (explicit and (choice != "gloo") != (_SHM is not None)):
        # decided for this group already; a later Accelerator asking explicitly for the other
        # way switches (every rank makes its Accelerators at the same points), one asking for
        # what is in use keeps it (and the windows of the models prepared over it)
        return "shm" if _SHM is not None else "gloo"
    if _SHM is not None:
        _SHM.close()
    for sub in _SUBGROUPS.values():
        if sub is not None:
            sub.close()
    _SUBGROUPS.clear()
    _SCRATCH.clear()  # a window of the communicator closed above
    _SHM, _SHM_FOR = None, world
    if choice == "gloo" or dist.get_world_size() < 2:
        return "gloo"
    from .shm import ShmGroup, hosts_of  # noqa: PLC0415 (the extension's shm type, only when asked for)
    from .shm_hier import HierGroup  # noqa: PLC0415

    hosts = hosts_of()
    if len(set(hosts)) == 1:
        _SHM = ShmGroup.create(timeout_s=timeout_s, hosts=hosts)  # None where /dev/shm is too small (it warns)
    else:  # shared memory within each host, gloo between the hosts' leaders
        _SHM = HierGroup.create(hosts, timeout_s=timeout_s)
    if _SHM is None and choice == "shm":
        warnings.warn(f"{ENV_COMM}=shm, but shared memory cannot carry this group's collectives (/dev/shm is too "
                      "small: warned above); CPU collectives use gloo", stacklevel=2)
    return "shm" if _SHM is not None else "gloo"


def cpu_comm(group=None) -> str:
    """"shm" or "gloo": how CPU collectives of the default group (or of `group`, once it has had
    a collective here) travel now."""
    if _SHM is None or _SHM_FOR is not dist.group.WORLD:
        return "gloo"
    if group is None or group is dist.group.WORLD:
        return "shm"
    return "shm" if _SUBGROUPS.get(group) is not None else "gloo"


# shared-memory communicators of other process groups (new_group), made at a group's first
# collective here (every member makes that call at the same point); None for a group whose ranks
# span hosts. Dropped with the default group's communicator.
_SUBGROUPS: dict = {}


def hierarchical() -> bool:
    """Whether the default group's CPU collectives go through shared memory within each host and
    gloo between hosts (shm_hier.HierGroup: the ranks span several hosts)."""
    return cpu_comm() == "shm" and _SHM.hierarchical


def _shm_for(t, group=None, op=None):
    """The shared-memory communicator for a collective of `group` on `t` with `op` (None: sum), or
    None for gloo. dist.ReduceOp is touched only once shared memory is on (a test's stand-in for
    torch.distributed has none)."""
    if _SHM is None or _SHM_FOR is not dist.group.WORLD or not _SHM.supports(t, op):
        return None
    if group is None or group is dist.group.WORLD:
        return _SHM
    if group not in _SUBGROUPS:
        from .shm import ShmGroup  # noqa: PLC0415 (as in select_cpu_comm)

        _SUBGROUPS[group] = ShmGroup.create(group, timeout_s=_SHM.timeout_s)
    return _SUBGROUPS[group]


def all_reduce(t, **kwargs):
    """dist.all_reduce(t, **kwargs) (async_op too), safe at exit (see above); through shared
    memory when that was selected and supports the tensor."""
    shm = _shm_for(t, kwargs.get("group"), kwargs.get("op"))
    if shm is not None:
        op, async_op = kwargs.get("op", dist.ReduceOp.SUM), kwargs.get("async_op", False)
        if not async_op and _staged(shm, t, t, op):
            return None
        return shm.all_reduce(t, op, async_op)
    _keep((t,))
    with _outside_backward_tls():
        return dist.all_reduce(t, **kwargs)


# Where a host runs more ranks than it has cores, a synchronous all-reduce of a private tensor
# (all_reduce, all_reduce_into) of these sizes is staged through one shared window (a scratch
# kept per process, grown to a power of two): copied in, reduced in place, copied out. The
# window all-reduce has two barriers whatever the size, where the copy path has three per 2 MiB
# piece, which ranks taking turns on the cores pay in context switches (docs/collectives.md:
# 4 processes on 2 cores, 32 MiB, 17.6-19.3 ms staged against 26.9-27.2 ms in three runs of
# four). With a core per rank the copy path's pieces stay in cache and it is the faster (2
# processes: 4.8 ms against 8.9 in a quiet run). Below SCRATCH_MIN the copy path's single piece
# is as fast; above SCRATCH_MAX the window would keep that much of /dev/shm mapped for the rest
# of the job. Not on a group spanning hosts (each host would decide from its own core count).
SCRATCH_MIN = 1 << 20
SCRATCH_MAX = 64 << 20
_SCRATCH: dict = {}  # "bytes": the scratch window (uint8 view) or None where /dev/shm had no room


def _scratch(nbytes: int):
    """The scratch window, at least `nbytes` long, or None. A collective of the default group
    when it grows (every rank grows it alike: the sizes asked for are the same everywhere)."""
    if "bytes" in _SCRATCH and _SCRATCH["bytes"] is None:
        return None  # no room the last time: not asked again (rank 0 decided for every rank)
    have = _SCRATCH.get("bytes")
    if have is None or have.numel() < nbytes:
        size = 1 << max(nbytes - 1, 1).bit_length()
        _SCRATCH.pop("bytes", None)  # the old window goes before the new one is mapped
        words = shared_buffer((size + 3) // 4, torch.int32)  # (a dtype the shared memory reduces)
        _SCRATCH["bytes"] = None if words is None else words.view(torch.uint8)
    return _SCRATCH["bytes"]


def all_reduce_into(t, out, op=None):
    """out = op over ranks of t (sum by default), t untouched: through shared memory in one pass
    (t copied into the segment, the result out of it; from 1 MiB to 64 MiB through a shared
    window: SCRATCH_MIN), else a copy of t all-reduced in place."""
    shm = _shm_for(t, None, op)
    if shm is not None and t.is_contiguous() and out.is_contiguous() and out.dtype == t.dtype \
            and out.shape == t.shape:
        op = op if op is not None else dist.ReduceOp.SUM
        if _staged(shm, t, out, op):
            return None
        return shm.all_reduce_into(t, out, op)
    out.copy_(t)
    return all_reduce(out) if op is None else all_reduce(out, op=op)


def _oversubscribed(shm) -> bool:
    """More ranks in this single-host group than the machine has cores (SCRATCH_MIN)."""
    return not hierarchical() and shm.size > (os.cpu_count() or 1)


def _staged(shm, t, out, op) -> bool:
    """out = op over ranks of t through the scratch window (SCRATCH_MIN), when t is a private
    tensor of the default group's size range; False (nothing done) otherwise. Synchronous only:
    one scratch serves one collective at a time."""
    nbytes = t.numel() * t.element_size()
    if shm is not _SHM or not SCRATCH_MIN <= nbytes <= SCRATCH_MAX or not t.is_contiguous() \
            or not out.is_contiguous() or t.device.type != "cpu" or not _oversubscribed(shm) or shm.in_window(t):
        return False
    scratch = _scratch(nbytes)
    if scratch is None:
        return False
    staged = scratch[:nbytes].view(t.dtype)
    staged.copy_(t.view(-1))
    shm.all_reduce(staged, op, False)
    out.view(-1).copy_(staged)
    return True


def broadcast(t, src: int):
    shm = _shm_for(t)
    if shm is not None:
        return shm.broadcast(t, src)
    _keep((t,))
    with _outside_backward_tls():
        return dist.broadcast(t, src=src)


def all_gather(outs, t):
    shm = _shm_for(t)
    if shm is not None and all(o.dtype == t.dtype and o.shape == t.shape for o in outs):
        flat = torch.empty(len(outs) * t.numel(), dtype=t.dtype)
        shm.all_gather(flat, t.contiguous().view(-1))
        for k, o in enumerate(outs):
            o.copy_(flat[k * t.numel():(k + 1) * t.numel()].view(t.shape))
        return None
    _keep((t, *outs))
    with _outside_backward_tls():
        return dist.all_gather(outs, t)


def shared_buffer(numel: int, dtype, zero_copy_only: bool = False):
    """A zeroed CPU tensor in memory every rank of the default group maps (a shared window: the
    all-reduces below then reduce it in place with no copy), or None when the CPU collectives do
    not go through shared memory or /dev/shm lacks the room. A collective of the default group.
    `zero_copy_only`: the buffer is wanted only for the window paths of the all-gather and
    reduce-scatter, which a group spanning hosts does not take (its all-reduce does): None there,
    so that /dev/shm keeps its room for the buffers that gain from it."""
    if cpu_comm() != "shm" or not _SHM.supports(torch.empty(0, dtype=dtype)) or \
            os.environ.get(ENV_SHM_WINDOWS, "1").strip() == "0":
        return None
    if zero_copy_only and hierarchical():
        return None
    t = _SHM.window_tensor(numel, dtype)
    _WINDOWS_MADE[0] += t is not None
    return t


_WINDOWS_MADE = [0]  # shared_buffer() windows made (windows_used)


def windows_used() -> bool:
    """Whether shared_buffer() has placed any buffer in a shared window in this process."""
    return _WINDOWS_MADE[0] > 0


def in_shared_buffer(t) -> bool:
    """Whether t lies in a shared_buffer() (its all_reduce is reduced in place there)."""
    return cpu_comm() == "shm" and t.device.type == "cpu" and _SHM.in_window(t)


def window_ops() -> int:
    """How many collectives of the default group took a shared window's zero-copy path so far in
    this process (0 when its CPU collectives do not go through shared memory); tests and
    benchmarks read it to see that the path they mean is the one taken."""
    if cpu_comm() != "shm":
        return 0
    return _SHM.window_ops()


def barrier():
    """Every rank of the default group has reached this point."""
    if cpu_comm() == "shm":
        return _SHM.barrier()
    return dist.barrier()



# torch 2.13 names these *_single and deprecates the *_tensor names (a FutureWarning per call);
# older torch (2.11 on the GPU machines) has only the *_tensor names
_ALL_GATHER_1 = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_1 = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(out, t, **kwargs):
    """Every rank's `t`, concatenated in rank order into `out` (async_op too), safe at exit."""
    shm = _shm_for(t, kwargs.get("group"))
    if shm is not None and out.is_contiguous():
        return shm.all_gather(out.view(-1), t.contiguous().view(-1), None, kwargs.get("async_op", False))
    _keep((t, out))
    with _outside_backward_tls():
        return _ALL_GATHER_1(out, t, **kwargs)


def reduce_scatter_tensor(out, t, **kwargs):
    """This rank's part of the sum of every rank's `t` into `out` (async_op too), safe at exit."""
    shm = _shm_for(t, kwargs.get("group"), kwargs.get("op"))
    if shm is not None and out.is_contiguous() and t.is_contiguous():
        return shm.reduce_scatter(out.view(-1), t.view(-1), kwargs.get("op", dist.ReduceOp.SUM),
                                  kwargs.get("async_op", False))
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
    shm = _shm_for(full)
    if shm is not None:  # in place: this rank's chunk is read before any chunk is written
        return shm.all_gather(full, full[rank * chunk:(rank + 1) * chunk], None, async_op)
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
    shm = _shm_for(full)
    if shm is not None:
        return shm.reduce_scatter(full[rank * chunk:(rank + 1) * chunk], full, dist.ReduceOp.SUM, async_op)
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
