"""Gradient synchronisation across processes: the reducer's Python glue.

Each flat gradient buffer (grad_layout.GradLayout) is cut into buckets by the C bucket plan
(_C.Reducer): contiguous ranges in the order gradients are expected to arrive in backward,
the first one small (1 MiB) so communication starts early, the rest `bucket_cap_mb`. The
parameters' post-accumulate-grad hooks are C callables; on a sync step they call
`DDPStrategy.buckets_ready` as soon as a bucket is complete (always in bucket order, so every rank
issues the same collectives in the same sequence), which starts an asynchronous all-reduce
while backward goes on; each gradient is divided by the world size as it becomes ready
(folded into the copy-in, or in place in the C hook), so the sum is the average. At the end of
backward (an autograd engine callback, so a raw `loss.backward()` works too)
`DDPStrategy.end_of_backward` waits for the buckets in order; once clip_grad_norm_ has asked for a 2-norm
it also measures each bucket (sum of squares, non-finite) while it is in cache, and clip reuses
that. After the first reduced backward the buffer
is re-laid once in the order gradients actually arrived, the order taken from rank 0.

Semantics (torch DDP's):
- x 1/world on each rank, then SUM across ranks (gloo has no AVG);
- nothing is communicated under no_sync() / on accumulation steps: gradients accumulate locally
  in the buffer and the next sync backward reduces the sum;
- without find_unused_parameters every parameter must get a gradient in a sync backward (a
  clear error names the ones that did not); with it, the missing ones count as zeros and a
  parameter has a gradient afterwards if any rank gave it one.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.distributed.algorithms.join import Joinable

from .. import _C
from .. import collectives
from .base import GradStrategy
from .replicas import broadcast_buffers, broadcast_model

_WIRE: dict = {}  # (backend, dtype) -> the dtype that backend all-reduces it in

# How backends refuse a dtype they cannot reduce (torch 2.13): gloo's dtype dispatch raises
# "Invalid scalar type" (float8, uint16); NCCL's names the unsupported type. Anything else
# (a timeout, a peer that died) is a real failure, not an answer about the dtype.
_UNSUPPORTED_DTYPE = ("Invalid scalar type", "data type is not supported", "Unconvertible NCCL type")


def _wire_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype to all-reduce `t` in: its own if the backend takes it (gloo in torch 2.13 takes
    fp16/bf16), else fp32. Decided once per backend and dtype with a 1-element probe, which
    behaves the same on every rank; only the backend's refusal of the dtype means fp32, any
    other failure of the probe is raised (and nothing is cached)."""
    backend = dist.get_backend()
    key = (backend, t.dtype)
    if key not in _WIRE:
        try:
            collectives.all_reduce(torch.zeros(1, dtype=t.dtype, device=t.device))
            _WIRE[key] = t.dtype
        except (RuntimeError, TypeError) as e:
            if not any(m in str(e) for m in _UNSUPPORTED_DTYPE):
                raise RuntimeError(f"rank {dist.get_rank()}: the 1-element {t.dtype} all-reduce that checks whether "
                                   f"the {backend} backend reduces {t.dtype} gradients failed: {e}") from e
            _WIRE[key] = torch.float32
    return _WIRE[key]


def _collective_device(groups=()) -> torch.device:
    """Where a small tensor of ours (used-flags, an order, join flags) lives for a collective:
    NCCL moves CUDA tensors only, so on an NCCL group it is a CUDA device whatever gradient
    groups there are (the first CUDA group's, else the current device; CPU groups or none at
    all included); every other backend takes it on the CPU."""
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    for g in groups:
        if g.is_cuda:
            return torch.device(g.device)
    return torch.device("cuda", torch.cuda.current_device())


def _allreduce_(t: torch.Tensor):
    wire = _wire_dtype(t)
    if wire == t.dtype:
        collectives.all_reduce(t)
    else:
        wide = t.to(wire)
        collectives.all_reduce(wide)
        t.copy_(wide)


def _comm_hook_dtype(handler):
    """The 16-bit wire format asked for by DistributedDataParallelKwargs.comm_hook, or None."""
    if handler is None:
        return None
    hook = str(getattr(handler.comm_hook, "value", handler.comm_hook)).lower()
    wrapper = str(getattr(handler.comm_wrapper, "value", handler.comm_wrapper)).lower()
    if hook in ("power_sgd", "batched_power_sgd"):
        raise NotImplementedError(f"DistributedDataParallelKwargs(comm_hook={hook!r}): PowerSGD is not supported "
                                  "by accelerate_c (use comm_hook='fp16' or 'bf16' for a smaller wire format)")
    if hook not in ("no", "fp16", "bf16"):
        raise ValueError(f"DistributedDataParallelKwargs(comm_hook={hook!r}): expected one of 'no', 'fp16', "
                         "'bf16', 'power_sgd', 'batched_power_sgd'")
    if wrapper not in ("no", "fp16", "bf16"):
        raise ValueError(f"DistributedDataParallelKwargs(comm_wrapper={wrapper!r}): expected 'no', 'fp16' or 'bf16'")
    # as in accelerate, the wrapper only wraps a hook; around fp16/bf16 the hook's cast is the last
    return {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16}[hook]


class BucketState:
    """What DDPStrategy keeps per gradient buffer (GradGroup.strategy_state)."""

    def __init__(self):
        self.nccl = False  # its buckets are launched by the C reducer over NCCL (DDPStrategy.attach)
        self.works = []  # buckets in flight: (bucket, work, range, wire tensor or None)
        # (buffer version, sumsq, nonfinite) measured bucket by bucket as the all-reduces
        # finished (only once clip_grad_norm_ has asked for a 2-norm: want_stats); clip reuses it
        # instead of reading the buffer again
        self.stats = None
        self.want_stats = False
        self.relaid = False  # the layout follows the order gradients arrived in (after step 1)
        self.wire_bufs = None  # per bucket: its wire-dtype buffer or None (DDPStrategy.wire_bufs)
        self.used_sum = None  # find_unused: the flags its last backward agreed on (_agree_used)


class DDPStrategy(GradStrategy):
    """torch DDP's semantics on the flat buffers: launches and completes the all-reduce of the
    buckets of every gradient group while backward runs."""

    def __init__(self, manager, handler=None):
        self.manager = manager
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        self.find_unused = bool(handler.find_unused_parameters) if handler is not None else False
        # the flag as passed (ZeRO counts DeepSpeed's ignore_unused_parameters into find_unused
        # too; in-order backwards follow the flag alone: _in_order)
        self.asked_find_unused = self.find_unused
        self.broadcast_buffers = handler is None or bool(handler.broadcast_buffers)
        self.hook_dtype = _comm_hook_dtype(handler)
        # gradients are divided by the world size before the sum; the 16-bit hooks divide their
        # wire copy instead (as torch's compress hooks do)
        self.prescale = 1.0 / self.world if self.hook_dtype is None else 1.0
        self.nccl = None  # _C.NcclComm: CUDA buckets are launched from the C hooks, no Python
        self.comm_stream = None
        self.joining: dict = {}  # id(model) -> ModelJoinable inside join_uneven_inputs()
        # id(model) -> its float64 params' used-flags, as reduce_unbuffered last agreed them
        self.unbuffered_used_sum: dict = {}
        self._zeros: dict = {}  # shadow_zeros' buffers
        # id(model) of the models whose reduced backward now running ends in _finish_ordered,
        # group after group in a fixed order (_in_order), and the autograd graph task that
        # callback is queued on (a backward that raised never ran it: the next one queues anew)
        self.ordered: set = set()
        # graph tasks a _finish_ordered is queued on for the backward in progress: while one is
        # pending, another task is a nested one of that backward (a reentrant checkpoint's)
        self._queued_tasks: set = set()

    def prepare_model(self, model, manager):
        broadcast_model(model)  # every replica starts from rank 0's weights
        # per forward: buffers from rank 0 (broadcast_buffers) and join_uneven_inputs' notices
        register_forward_sync(model, manager, self)

    def alloc_buffer(self, numel, dtype, device):
        """CPU buffers live in a shared window when the CPU collectives go through shared memory:
        each bucket's all-reduce then reads every rank's gradients where backward wrote them and
        writes the average back there, with no copy in or out (docs/collectives.md, "Windows").
        Not for a buffer whose buckets travel cast (a 16-bit comm hook of fp32 gradients): its
        wire buffers are what is reduced."""
        if torch.device(device).type == "cpu" and self.hook_dtype in (None, dtype):
            shared = collectives.shared_buffer(numel, dtype)
            if shared is not None:
                return shared
        return super().alloc_buffer(numel, dtype, device)

    def attach(self, g, previous=None):
        g.strategy_state = BucketState()
        self._bind(g)

    def _bind(self, g):
        """For every group, and again after a re-layout: on the NCCL backend, CUDA groups hand
        their buffer and a comm stream to the C reducer, which then launches complete buckets
        itself. 16-bit comm hooks keep the Python path (their cast lives there). On that path
        the wire dtype is settled here, at prepare, where every rank attaches the same groups in
        the same order: its one-time probe is a collective, and made in the first backward it
        would be that backward's first collective (a timeout there would then name the probe
        rather than the bucket that waited)."""
        st = g.strategy_state
        st.wire_bufs = None
        st.stats = None
        if not (g.is_cuda and dist.get_backend() == "nccl" and self.hook_dtype is None):
            if self.hook_dtype is None or self.hook_dtype == g.dtype:
                _wire_dtype(torch.empty(0, dtype=g.dtype, device=g.device))
            if not g.is_cuda:
                st.wire_bufs = self._make_wire_bufs(g, shared=True)
            return
        if self.nccl is None:
            from .. import nccl
            from torch.distributed.distributed_c10d import _get_default_store

            self.nccl = nccl.make_comm(_get_default_store(), self.rank, self.world)
            self.comm_stream = torch.cuda.Stream(device=g.device)
        g.reducer.attach_nccl(self.nccl, g.buf, self.comm_stream.cuda_stream)
        st.nccl = True

    def begin_backward(self, g, sync):
        """Start of a backward for group g (its first gradient); on a sync step, the C launches
        wait for the stream backward runs on, and inside join_uneven_inputs the launches of a
        model with several groups are deferred (see end_of_backward)."""
        st = g.strategy_state
        st.stats = None
        if not sync:
            return False
        if st.nccl:
            g.reducer.set_compute_stream(torch.cuda.current_stream(g.device).cuda_stream)
        if self._in_order(g.model_key):
            g.reducer.defer = True
            self.order(g.model_key)
        return True

    def _in_order(self, model_key) -> bool:
        """find_unused_parameters=True where a backward reduces several groups (a model with
        several dtypes, or several prepared models): which groups get gradients may differ
        from rank to rank (control flow that depends on the data), and so would the
        interleaving of the groups' bucket launches, and a group with no gradient here would
        launch nothing. (torch DDP keeps one sequence of buckets per model and, with
        find_unused_parameters, marks the unused ones ready at the first gradient; two models'
        sequences still interleave as each rank's autograd order has it.) Here every group
        launches its buckets when the backward is over (_finish_ordered, the autograd engine's
        callback), group after group in the manager's order (the same on every rank), a group of
        a model whose backward this is but without gradients here as zeros. What that costs:
        these all-reduces do not overlap the backward. One group alone keeps its overlap: its
        buckets launch in bucket order, the unused ones at the end. Every rank must run some
        backward through each model in it (torch DDP needs that too). Keyed on the flag as
        passed, not on DeepSpeed's ignore_unused_parameters, so that a ZeRO run without the
        flag keeps its overlap (there the same groups must get gradients on every rank).
        Inside join_uneven_inputs, a model with several groups always: a process that ran out
        of data shadows the others' collectives (_ShadowHook) and cannot know how their groups'
        buckets interleave, but knows the manager's order. In both cases also a model with
        float64 parameters (no buffer): they are averaged after its groups, one all-reduce each,
        where every rank (and a joined one's shadow, per backward) knows the place, also when
        control flow gave them no gradient on some rank. Elsewhere float64 parameters are
        averaged at the end of Accelerator.backward, or at the step after a raw backward
        (GradManager.average_pending_unbuffered, prepare_step: sync_missed), which holds under
        reentrant checkpointing, whose inner backwards end before the outer one has delivered
        every gradient."""
        f64 = model_key in self.manager.unbuffered_of
        if self.joining.get(model_key) is not None:
            return f64 or len(self.manager.groups_of(model_key)) > 1
        if not self.asked_find_unused:
            return False
        return f64 or len(self.ordered_members()) > 1

    def order(self, model_key) -> None:
        """`model_key`'s backward now running ends in _finish_ordered, queued on the graph task
        of its first gradient. A first gradient in another task while a finish is pending comes
        from a nested backward of the same one (reentrant checkpointing: two checkpoints, or one
        below a model whose gradients came first): the models already ordered stay, and the
        callback queued there defers to the outer backward (_defer_ordered). What a raw
        backward that raised left is forgotten at the next forward (forget_stale_order)."""
        task = torch._C._current_graph_task_id()
        if task not in self._queued_tasks:
            self._queued_tasks.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_ordered)
        self.ordered.add(model_key)

    def forget_stale_order(self) -> None:
        """At a forward outside any backward: no ordered finish can be pending then, unless a
        raw backward raised after queuing it (its callbacks never ran)."""
        if self._queued_tasks and torch._C._current_graph_task_id() < 0:
            self.abort_held()

    def _finish_ordered(self) -> None:
        node = torch._C._current_autograd_node()
        if node is not None:
            # the end of a nested backward (a reentrant checkpoint's, queued by a first gradient
            # delivered inside it): the outer backward goes on and may deliver more. Once the
            # node running the nested one returns, this is queued again on the outer backward
            self._defer_ordered(node)
            return
        try:
            self.finish_ordered_groups()
        finally:
            self.abort_held()

    def _defer_ordered(self, node) -> None:
        handle = None

        def requeue(grad_inputs, grad_outputs):
            handle.remove()
            task = torch._C._current_graph_task_id()  # the outer backward's
            if self._queued_tasks and task not in self._queued_tasks:  # else finished or queued there
                self._queued_tasks.add(task)
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_ordered)

        handle = node.register_hook(requeue)

    def finish_ordered_groups(self) -> None:
        """The models in `ordered`, model after model in a fixed order: every group of it, in
        the manager's order (the ones that began finish: their deferred buckets launch; the
        ones that got no gradient here begin and finish: zeros, or what earlier no_sync
        micro-batches accumulated), then its float64 parameters (reduce_unbuffered)."""
        members = self.ordered_members()
        for key in dict.fromkeys([g.model_key for g in members] + list(self.manager.unbuffered_of)):
            if key not in self.ordered:
                continue
            for g in members:
                if g.model_key != key or getattr(g, "broken", False):
                    continue
                if not g.reducer.launching:
                    g.begin_backward()
                g.finish_backward()
            if key in self.manager.unbuffered_of:
                self.reduce_unbuffered(key)

    def unbuffered_backward(self, model_key) -> bool:
        if not self._in_order(model_key):
            return False
        self.order(model_key)
        return True

    @torch.no_grad()
    def reduce_unbuffered(self, model_key) -> None:
        """Averages the float64 parameters of a model at the end of its sync backward, as
        torch DDP's bucket holding them would: their used-flags agreed first (one all-reduce:
        a parameter has a gradient if any rank gave it one, zeros in the sum where it has
        none), then one all-reduce each (average_unbuffered)."""
        params = self.manager.unbuffered_of[model_key]
        agreed = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_collective_device())
        collectives.all_reduce(agreed)
        self.unbuffered_used_sum[model_key] = agreed.clone()
        for p, used in zip(params, agreed.tolist()):
            if used:
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                self.average_unbuffered(grad)
                p.grad = grad

    def ordered_members(self) -> list:
        """What finish_ordered_groups goes through, in the same order on every rank: the
        manager's gradient groups (ZeRO-2 adds its gradient shards)."""
        return list(self.manager.groups)

    def finishes_in_order(self, g) -> bool:
        return g.model_key in self.ordered

    def missing_means_unused(self, g) -> bool:
        # the flag as passed: DeepSpeed's ignore_unused_parameters alone (ZeRO) keeps the wait,
        # whose finish_awaiting completes groups in the manager's order on every rank
        return self.asked_find_unused

    def abort_held(self):
        self.ordered.clear()
        self._queued_tasks = set()

    def abort_backward(self, g):
        """A backward raised: the all-reduces it launched still finish (every process launched
        the same ones, and a dropped one would still be writing the buffer, or pair with the next
        backward's collectives on a process that launched more)."""
        for _, work, _, _ in g.strategy_state.works:
            try:
                work.wait()
            except RuntimeError:
                pass
        g.strategy_state.works = []

    def start_join(self, model, manager):
        j = ModelJoinable(manager, self, model)
        self.joining[id(model)] = j
        return j

    def end_join(self):
        self.joining.clear()

    def measure_in_hooks(self, g, sync):
        return False  # measured after each bucket's all-reduce instead (_wait)

    def want_sumsq(self, g):
        g.strategy_state.want_stats = True

    def cached_sumsq(self, g):
        """(sumsq, rounded sumsq, nonfinite) of the buffer if nothing wrote to it since the
        averaging pass measured it (any in-place change through a view bumps the version)."""
        stats = g.strategy_state.stats
        if stats is not None and stats[0] == g.flat._version:
            return stats[1:]
        return None

    def sync_missed(self, groups, unbuffered_models):
        if groups:
            sync_gradients(groups, self.average_whole)
        for key in self.manager.unbuffered_of:  # the manager's order: the same on every rank
            if key in unbuffered_models:
                self.reduce_unbuffered(key)

    def average_unbuffered(self, grad) -> None:
        """The average of a float64 gradient (no buffer), in place, as torch DDP averages the
        bucket it sits in: a 16-bit comm hook casts it to its wire dtype (lossy, as torch's
        hooks are for any bucket), else it is multiplied by 1/world before the sum."""
        if self.hook_dtype is not None:
            wire = grad.to(self.hook_dtype).div_(self.world)
            collectives.all_reduce(wire)
            grad.copy_(wire)
        else:
            grad.mul_(1.0 / self.world)
            collectives.all_reduce(grad)

    def shadow_unbuffered(self, model_key) -> None:
        """reduce_unbuffered on a process that ran out of data: it adds no gradient; the
        used-flags tell it which parameters the others reduce. It sends zeros, or with
        find_unused_parameters what its last reduction agreed on, summed again in place at each
        shadowed backward (as _ShadowHook does for the buffers' flags: torch DDP's join hook,
        whose used-map holds float64 parameters beside the others)."""
        params = self.manager.unbuffered_of[model_key]
        used = self.unbuffered_used_sum.get(model_key)
        if not self.find_unused or used is None:
            used = torch.zeros(len(params), dtype=torch.int32, device=_collective_device())
        collectives.all_reduce(used)
        self.unbuffered_used_sum[model_key] = used
        for p, u in zip(params, used.tolist()):
            if u:
                collectives.all_reduce(torch.zeros_like(p, dtype=self.hook_dtype or p.dtype))

    def average_whole(self, g):
        """All-reduces g's whole buffer into the average, the way its buckets are: a 16-bit
        comm hook's wire cast and then divided in the hook's dtype (torch's compress hooks), else
        each gradient multiplied by 1/world before the sum (torch DDP's reducer, and our
        copy-in's prescale), or divided in its own dtype under a hook of that dtype."""
        t = g.flat
        if self.hook_dtype is not None and self.hook_dtype != g.dtype:
            wire = torch.empty(t.numel(), dtype=self.hook_dtype, device=t.device)
            self._cast(wire, t, g.is_cuda)
            wire.div_(self.world)
            collectives.all_reduce(wire)
            t.copy_(wire)
            return
        if self.hook_dtype == g.dtype:
            t.div_(self.world)
        else:
            g.scale_(1.0 / self.world)
        _allreduce_(t)

    def shadow_zeros(self, count, dtype, device):
        """Zeros for a joined process's share of a bucket's all-reduce: one buffer per size and
        dtype, zeroed again for each use (the sum of the others lands in it), so that no
        bucket-sized temporary is left for a gloo worker to release (collectives.py)."""
        key = (count, dtype, device)
        buf = self._zeros.get(key)
        if buf is None:
            buf = self._zeros[key] = torch.zeros(count, dtype=dtype, device=device)
        return buf.zero_()

    def wire_bufs(self, g):
        """Per bucket of g: None when it is all-reduced in place, else the buffer it travels in
        (a 16-bit comm_hook's dtype, or fp32 where the backend does not take the gradients'
        dtype). Made once per layout (_bind resets it), not at every launch."""
        st = g.strategy_state
        if st.wire_bufs is None:
            st.wire_bufs = self._make_wire_bufs(g, shared=False)
        return st.wire_bufs

    def _make_wire_bufs(self, g, shared: bool):
        """wire_bufs' buffers. `shared` (a CPU group, made in _bind, where every rank binds the
        same groups in the same order: a collective): the buckets' wire buffers are consecutive
        ranges of one shared window when the CPU collectives go through shared memory, so a
        16-bit hook's all-reduces read and write them in place, as the gradient buffer's own
        buckets are without a hook (alloc_buffer)."""
        dts = []
        for t in g.buckets:
            hook = self.hook_dtype is not None and self.hook_dtype != t.dtype
            dt = self.hook_dtype if hook else _wire_dtype(t)
            dts.append(None if dt == t.dtype else dt)
        wired = [(t, dt) for t, dt in zip(g.buckets, dts) if dt is not None]
        window = None
        if shared and wired and len({dt for _, dt in wired}) == 1:
            window = collectives.shared_buffer(sum(t.numel() for t, _ in wired), wired[0][1])
        bufs, at = [], 0
        for t, dt in zip(g.buckets, dts):
            if dt is None:
                bufs.append(None)
            elif window is not None:
                bufs.append(window[at:at + t.numel()])
                at += t.numel()
            else:
                bufs.append(torch.empty(t.numel(), dtype=dt, device=t.device))
        return bufs

    def buckets_ready(self, g, first: int, last: int):
        """Starts the all-reduce of buckets [first, last) of group g (called from a hook)."""
        wires = self.wire_bufs(g)
        works = g.strategy_state.works
        for b in range(first, last):
            t, wire = g.buckets[b], wires[b]
            count = t.numel()
            if wire is not None and wire.dtype == self.hook_dtype:
                # comm_hook fp16/bf16: the 16-bit copy is cast in C and pre-divided, as torch's
                # fp16_compress_hook does, so the sum cannot overflow where torch's would not
                self._cast(wire, t, g.is_cuda)
                wire.div_(self.world)
            else:
                if self.hook_dtype == t.dtype:
                    # the gradients already have the hook's dtype: torch's compress hook then
                    # divides the bucket itself, in that dtype (its cast is a no-op), and so
                    # must we (prescale is 1 under a hook)
                    t.div_(self.world)
                if wire is not None:  # the backend does not take this dtype: fp32 on the wire
                    wire.copy_(t)
            try:
                work = collectives.all_reduce(t if wire is None else wire, async_op=True)
            except RuntimeError as e:
                raise RuntimeError(self._where(g, b, count) + f" could not start: {e}") from e
            works.append((b, work, t, wire))

    @staticmethod
    def _cast(dst, src, is_cuda):
        if is_cuda:
            _C.cuda_cast_(dst, src, torch.cuda.current_stream(dst.device).cuda_stream)
        else:
            _C.cast_(dst, src)
        increment_version(dst)  # written through DLPack: tell torch, as its own copy_ would

    def _where(self, g, b, count) -> str:
        start, n = g.reducer.range(b)
        names = [self.manager.name_of(p) for p, o in zip(g.params, g.offsets) if start <= o < start + n]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"rank {self.rank}/{self.world}: the all-reduce of gradient bucket {b} ({count} {g.dtype} "
                f"elements: {shown})")

    @torch.no_grad()
    def end_of_backward(self, g):
        """End of a sync backward for group g: launch what is left, wait for every bucket in
        order, average and measure the buffer, re-lay it once in arrival order."""
        st = g.strategy_state
        pending = g.reducer.pending()
        if pending:
            if not self.find_unused:
                names = [self.manager.name_of(g.params[i]) for i in pending]
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                raise RuntimeError(
                    f"rank {self.rank}: {len(names)} parameter(s) received no gradient in this backward: {shown}. "
                    "Every trainable parameter of a prepared model must take part in the loss on a sync step; "
                    "pass kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)] to "
                    "Accelerator if some parameters are legitimately unused, or freeze them "
                    "(requires_grad=False).")
            used = [True] * len(g.params)
            f = g.reducer.prescale
            for i in pending:
                p, v = g.params[i], g.views[i]
                if p.grad is None:  # unused here: zeros in the sum, and no .grad unless used elsewhere
                    v.zero_()
                    used[i] = False
                elif p.grad is not v:  # assigned during backward
                    torch.mul(p.grad, f, out=v)
                    p.grad = v
                elif f != 1.0:  # accumulated earlier in this step, no gradient in this backward
                    v.mul_(f)
                first, last = g.reducer.mark_ready(i)
                if g.reducer.defer:
                    continue  # launched below
                if st.nccl:
                    g.reducer.nccl_launch(first, last)
                else:
                    self.buckets_ready(g, first, last)
        if g.reducer.defer:  # join_uneven_inputs on a model with several groups: all buckets now, in order
            g.reducer.defer = False
            if st.nccl:
                g.reducer.nccl_launch(0, len(g.buckets))
            else:
                self.buckets_ready(g, 0, len(g.buckets))
        if st.nccl:
            g.reducer.nccl_wait()  # the compute stream waits for the comm stream; the host does not
        sums = self._wait(g)
        st.stats = None if sums is None else (g.flat._version, *sums)
        if self.find_unused:
            self._agree_used(g, used if pending else [True] * len(g.params))
        if not st.relaid:
            self._relayout(g)

    def _wait(self, g):
        """Waits for g's buckets in order. Once clip_grad_norm_ has asked for a 2-norm
        (want_stats), each CPU bucket is also measured (sum of squares, non-finite flag) as
        soon as its all-reduce is done, while it is in cache and the later buckets are still on
        the wire; returns the totals (sum of squares, the same with each gradient's norm rounded
        to the buffer's dtype as torch's clip takes it, non-finite), or None when nothing was
        measured."""
        st = g.strategy_state
        measure = st.want_stats and not g.is_cuda
        sumsq, rounded, nonfinite = 0.0, 0.0, False
        for b, work, t, wire in st.works:
            try:
                work.wait()
            except RuntimeError as e:
                raise RuntimeError(self._where(g, b, t.numel()) + f" failed or timed out: {e}") from e
            if wire is not None and wire.dtype == self.hook_dtype:
                self._cast(t, wire, g.is_cuda)
            elif wire is not None:
                t.copy_(wire)
            if measure:
                s, r, nf = g.sums(b)
                sumsq, rounded, nonfinite = sumsq + s, rounded + r, nonfinite or nf
        st.works = []
        return (sumsq, rounded, nonfinite) if measure else None

    def _agree_used(self, g, used):
        """find_unused_parameters: a parameter has a gradient if any rank gave it one."""
        flags = torch.tensor(used, dtype=torch.int32, device=_collective_device([g]))
        collectives.all_reduce(flags)
        # what this rank sends again once it has run out of data (_ShadowHook)
        g.strategy_state.used_sum = flags.clone()
        for p, v, n in zip(g.params, g.views, flags.tolist()):
            if n and p.grad is None:
                p.grad = v

    def _relayout(self, g, order=None):
        """Once, after the first reduced backward: the order gradients arrived in on rank 0
        becomes the layout on every rank, so buckets fill (and launch) in backward order."""
        order = torch.tensor(g.reducer.arrival_order(len(g.params)) if order is None else order, dtype=torch.int64,
                             device=_collective_device([g]))
        collectives.broadcast(order, src=0)
        order = order.tolist()
        if order != g.order:
            g.relayout(order)
            self._bind(g)
        g.strategy_state.relaid = True

    def relayout_shadow(self, g):
        """A process that ran out of data takes part in the re-layout broadcast (with its
        current order, used only if it is rank 0)."""
        self._relayout(g, order=g.order)


def sync_gradients(groups, average_whole) -> None:
    """All-reduces whole buffers that missed the bucketed reduction (`average_whole(g)`:
    DDPStrategy's, as its buckets are), with one collective each; all ranks call this at the
    same point with the same groups (prepare_step has resynced the groups' assignments)."""
    flags = [p.grad is v for g in groups for p, v in zip(g.params, g.views)]
    agreed = torch.tensor(flags, dtype=torch.int32, device=_collective_device(groups))
    collectives.all_reduce(agreed)
    used = agreed.tolist()
    k = 0
    for g in groups:
        average_whole(g)
        g.wrote()
        g.strategy_state.stats = None
        for p, v in zip(g.params, g.views):
            if used[k] and p.grad is None:  # used on another rank: its (reduced) gradient
                p.grad = v
            k += 1


def register_forward_sync(model: torch.nn.Module, manager, strategy):
    """The collectives that precede a forward of a prepared model on several processes:
    - DistributedDataParallelKwargs(broadcast_buffers=True), torch DDP's default: every rank
      takes rank 0's buffers (e.g. BatchNorm running statistics) before a forward that follows
      a forward run with grad enabled outside no_sync() (and before the first one);
    - inside join_uneven_inputs(): telling the processes that ran out of data that this one has
      not, and what they must shadow (the reducer's ModelJoinable)."""
    has_buffers = strategy.broadcast_buffers and any(True for _ in model.buffers())
    key = id(model)
    state = {"sync": True}

    def pre_hook(module, args):
        strategy.forget_stale_order()
        bcast = has_buffers and state["sync"]
        will_reduce = torch.is_grad_enabled() and manager.sync_now(key)
        state["sync"] = will_reduce
        src = 0
        joinable = strategy.joining.get(key)
        if joinable is not None:
            from torch.distributed.algorithms.join import Join

            Join.notify_join_context(joinable)
            # what the joined processes must shadow for this iteration, and the buffers' source:
            # the highest rank that still has data (rank 0 may have joined)
            flags = torch.tensor([int(will_reduce), int(bcast), dist.get_rank()], dtype=torch.int64,
                                 device=joinable.join_device)
            collectives.all_reduce(flags, op=dist.ReduceOp.MAX)
            src = int(flags[2])
        if bcast:
            with torch.no_grad():
                broadcast_buffers(module, src)

    # registered even without buffers: join_uneven_inputs() needs it. One per model, whoever
    # prepares it again (transformers' Trainer frees and re-prepares its model at every train()):
    # a second hook would broadcast the buffers twice, and under join its flags would not match
    # the single all-reduce a joined process shadows them with
    old = _FORWARD_SYNC.pop(model, None)
    if old is not None:
        old.remove()
    _FORWARD_SYNC[model] = handle = model.register_forward_pre_hook(pre_hook)
    return handle


_FORWARD_SYNC: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its forward-sync hook


class _ShadowHook:
    """What a process that ran out of data does for each iteration the others still run."""

    def __init__(self, joinable):
        self.j = joinable

    def main_hook(self):
        j = self.j
        m, groups = j.model, j.groups()
        flags = torch.tensor([0, 0, -1], dtype=torch.int64, device=j.join_device)
        collectives.all_reduce(flags, op=dist.ReduceOp.MAX)
        will_reduce, bcast, src = (int(v) for v in flags.tolist())
        if bcast:
            with torch.no_grad():
                broadcast_buffers(m, src)
        if not will_reduce:
            return
        comm = j.strategy
        # the order the others reduce the groups in: the manager's (DDPStrategy._in_order)
        for g in groups:
            # the buckets the others reduce, in their order, with zeros (this rank adds nothing;
            # the others divide by the full world size, torch DDP's default under Join)
            nccl = g.strategy_state.nccl
            wires = None if nccl else comm.wire_bufs(g)
            for b, t in enumerate(g.buckets):
                count = t.numel()
                if nccl:
                    zeros = torch.zeros(count, dtype=g.dtype, device=g.device)
                    comm.nccl.all_reduce(zeros, stream=torch.cuda.current_stream(g.device).cuda_stream)
                    continue
                sent = t if wires[b] is None else wires[b]
                if collectives.in_shared_buffer(sent):
                    # the others reduce their shared buffers (the gradients', or a 16-bit hook's
                    # wire: _make_wire_bufs) in place, so must this rank (the window collective
                    # is another kind): its zeros there, its gradients kept
                    kept = sent.clone() if sent is t else None
                    collectives.all_reduce(sent.zero_())
                    if kept is not None:
                        t.copy_(kept)
                    continue
                # the dtype the others send this bucket in (the same rule as launch)
                wire = t.dtype if wires[b] is None else wires[b].dtype
                collectives.all_reduce(comm.shadow_zeros(count, wire, g.device))
            if comm.find_unused:
                # _agree_used's flags: as torch DDP's join hook does, the summed flags this
                # process's last backward agreed on, summed in place again at each shadowed
                # backward: a parameter that every process still running leaves out gets a
                # (zero) gradient if any process used it in that backward
                used = g.strategy_state.used_sum
                if used is None:
                    used = torch.zeros(len(g.params), dtype=torch.int32, device=_collective_device([g]))
                collectives.all_reduce(used)
                g.strategy_state.used_sum = used
            if not g.strategy_state.relaid:
                comm.relayout_shadow(g)
        if id(m) in j.manager.unbuffered_of:
            # the others average the model's float64 params after its groups
            # (finish_ordered_groups), with zeros from here
            comm.shadow_unbuffered(id(m))

    def post_hook(self, is_last_joiner: bool):
        """The processes that joined early skipped optimizer steps: everyone takes the model of
        a process that ran to the end (torch DDP's final model sync)."""
        j = self.j
        rank = torch.tensor([dist.get_rank() if is_last_joiner else -1], device=j.join_device)
        collectives.all_reduce(rank, op=dist.ReduceOp.MAX)
        src = int(rank.item())
        with torch.no_grad():
            for p in j.model.parameters():
                collectives.broadcast(p.data, src=src)
            broadcast_buffers(j.model, src)


class ModelJoinable(Joinable):
    """torch's Joinable for one prepared model: join_uneven_inputs() hands it to torch's Join,
    whose loop runs _ShadowHook on the processes that ran out of data."""

    def __init__(self, manager, strategy, model):
        super().__init__()
        self.manager = manager
        self.strategy = strategy
        self.model = model

    def groups(self):
        return self.manager.groups_of(id(self.model))

    def join_hook(self, **kwargs):
        return _ShadowHook(self)

    @property
    def join_device(self):
        return _collective_device(self.groups())

    @property
    def join_process_group(self):
        return dist.group.WORLD
