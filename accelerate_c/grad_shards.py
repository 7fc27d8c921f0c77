"""ZeRO-2's gradients: each process keeps only its shard of them (docs/sharding.md).

One GradShard per shard group (shard_plan.ShardGroup: the trainable parameters of one prepared
model that share a dtype and device). Its parameters' post-accumulate-grad hooks are the C
reducer's (_C.Reducer built with the plan's own arguments, so its buckets are the plan's:
csrc/include/ac/shard.h): each gradient autograd produces is copied (divided by the world
size, torch DDP's average) into its place in a bucket-sized staging buffer laid out as the
plan's full buffer, and `.grad` is set back to None at once, so no full gradient outlives its
hook. When a bucket's last gradient has landed the C hook launches its reduce-scatter, bucket
after bucket in plan order on every process; this process's chunk of the sum lands in (or, on
later micro-batches, is added to) its gradient shard. Every backward is reduce-scattered,
accumulation micro-batches included, as DeepSpeed's stage 2 does: memory stays 1/N, so
no_sync() does not skip communication here.

Staging: at most MAX_INFLIGHT buckets' reduce-scatters are in flight; a hook that needs a
buffer beyond that waits for the oldest (inside backward, as DeepSpeed waits for its bucket).
Up to MAX_INFLIGHT + 1 buffers are kept between backwards (like DeepSpeed's reduce bucket):
about three buckets beside the 1/N shard. Buckets launch in plan order (reverse registration
order, about backward's); a model whose gradients arrive in another order keeps more buckets
open at once during its backward, up to the whole gradient (not kept after it).

Which parameters hold a gradient (`has`) follows torch's None rule: set by a backward that gave
the parameter one (with find_unused_parameters, by any process's), cleared by clear().
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import _C
from . import collectives
from .shard_plan import ShardGroup

MAX_INFLIGHT = 2
WINDOW_SLOTS = MAX_INFLIGHT + 1  # staging buffers in a shared window (over shared memory)
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _stats_device(device) -> torch.device:
    """Where this shard's small collective tensors live: NCCL moves CUDA tensors only."""
    if torch.device(device).type == "cuda" and dist.get_backend() == "nccl":
        return torch.device(device)
    return torch.device("cpu")


class GradShard:
    """The gradient shard of one ShardGroup, the hooks that fill it and its bookkeeping."""

    def __init__(self, group: ShardGroup, params, names, find_unused: bool, model_key=None, dtype=None,
                 shard_dtype=None, windows: bool = False):
        """`dtype`: the gradients' dtype as backward delivers them, the staging buffers' and the
        reduce-scatter's (default: the group's); `shard_dtype`: the gradient shard's, where the
        sums accumulate (default: `dtype`; full sharding keeps fp32 shards of 16-bit gradients).
        `windows`: stage buckets in a shared window when the CPU collectives go through shared
        memory (a collective: every process builds its shards in the same order)."""
        plan = group.plan
        self.group = group
        self.params = list(params)  # in plan parameter order (group.indices)
        self.names = names  # callable: param -> its name, for error messages
        self.label = None  # what errors name the shard by besides its parameters (full sharding: its unit)
        self.find_unused = find_unused
        self.model_key = model_key
        self.world = plan.world
        self.rank = group.rank
        self.dtype, self.device = dtype or group.dtype, group.device
        self.shapes = list(group.shapes)  # the parameters' shapes (full sharding changes p.shape between steps)
        self.is_cuda = torch.device(self.device).type == "cuda"
        if self.dtype not in _KERNEL_DTYPES:
            raise NotImplementedError(f"ZeRO stage 2: parameters of dtype {self.dtype} ({names(self.params[0])}) are "
                                      "not supported; use float32, bfloat16 or float16 parameters")
        self.shard = torch.zeros(plan.shard_numel, dtype=shard_dtype or self.dtype, device=self.device)
        self.empty = True  # the shard holds nothing since the last clear: the next sum is written, not added
        self.has = [False] * len(self.params)
        self.seen = [False] * len(self.params)  # gradients delivered by the backward now running
        # fp16 (GradScaler's rule, per parameter as GradManager's OutsideGrad): whether its run
        # still carries the loss scale (a backward re-arms it), whether unscaling found NaN/Inf,
        # and whether it was unscaled since the scaler's last update (refused a second time once
        # a backward has added to it: GradManager.refuse_unscale_again)
        self.carries = [True] * len(self.params)
        self.found_at = [False] * len(self.params)
        self.unscaled_in_step = [False] * len(self.params)
        self.prescale = 1.0 / self.world
        # per bucket: (start in the full layout, chunk, local offset in the shard, first, count)
        self.buckets = list(plan.buckets())
        where = {}
        for b, (start, chunk, local, first, count) in enumerate(self.buckets):
            for k in range(first, first + count):
                where[plan.order[k]] = b
        self.where = [where[i] for i in range(plan.nparams)]  # param index -> bucket
        self.spans = [plan.param(i)[1:] for i in range(plan.nparams)]  # (offset in the full layout, numel)
        self.runs = group.runs()  # (offset in the shard, offset in the parameter, length)
        first_cap, cap = plan.first_cap_bytes, plan.cap_bytes
        self.reducer = _C.Reducer([p.numel() for p in self.params], list(plan.order), plan.esize, first_cap, cap,
                                  plan.align, self._on_first, self._launch, self._copy_in)
        _, members = self.reducer.layout()
        if list(members) != self.where:  # the two C plans promise the same buckets (shard.h)
            raise RuntimeError(f"internal error: the reducer's buckets {members} are not the shard plan's {self.where}")
        self.staging: dict = {}  # bucket -> its staging buffer while it is being filled or reduced
        self.free: list = []  # staging buffers not in use (kept between backwards)
        self.works: list = []  # (bucket, work, staging) in launch order
        self.shard_buf = _C.Buffer(self.shard) if not self.is_cuda else None
        self.stats_device = _stats_device(self.device)
        # the C hook's fast path is for a gradient that already is the parameter's view of a flat
        # buffer; here no gradient ever is, so each hook gets an object no .grad can be (None
        # would match the .grad a second hook on the same parameter sees after the first cleared it)
        self._never = object()
        self.hooks = [p.register_post_accumulate_grad_hook(self.reducer.hook(i, self._never))
                      for i, p in enumerate(self.params)]
        self.on_launched = None  # callable(last bucket launched): the reduce-scatters of buckets were launched
        # callable(shard) at the start of each backward: True when its buckets wait for
        # finish_backward, called by the strategy in its shards' order (zero2.py, _shard_begins)
        self.begin_hook = None
        self.keep_free = MAX_INFLIGHT + 1  # staging buffers kept between backwards
        # Over shared memory, WINDOW_SLOTS staging buffers live in a shared window: bucket b takes
        # slot b % WINDOW_SLOTS when it is free, so that its reduce-scatter reads every process's
        # bucket where its hooks wrote it (no copy in or out). A bucket whose slot is taken (its
        # gradients arrived while an earlier bucket of that slot was still open) stages privately;
        # processes that staged one bucket differently agree inside the collective to take the
        # slots (csrc/core/comm_shm.c, reduce_scatter_at), so that costs speed, never correctness.
        self.slot_numel = max((c for _, c, *_ in self.buckets), default=0) * self.world
        self.window = None
        if windows and not self.is_cuda and self.slot_numel:
            self.window = collectives.shared_buffer(WINDOW_SLOTS * self.slot_numel, self.dtype, zero_copy_only=True)
        self.slot_bucket = [None] * WINDOW_SLOTS  # bucket staged in each window slot, or None
        if self.window is not None:
            self.keep_free = 0  # a private buffer is the exception then: not kept beside the slots

    # ---- what the hooks call -------------------------------------------------------------
    def _on_first(self):
        """The first gradient of a backward: the end of backward is queued on the graph task
        delivering it (a raw loss.backward() too). Under reentrant activation checkpointing
        that task may be a checkpointed segment's inner backward, which ends while the outer one
        still has gradients of this shard to deliver: then the end waits (requeue) and the next
        hook queues it again on the task then running, as grads.GradGroup does; finish_awaiting
        completes a backward that delivers no more."""
        if self.reducer.requeue:
            self.reducer.requeue = False
        else:
            self.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def begin_backward(self):
        """_on_first's start of a backward; the strategy calls it for a shard that got no
        gradient in a backward of its model that every shard takes part in."""
        self.reducer.launching = True
        self.seen = [False] * len(self.params)
        self.reducer.defer = bool(self.begin_hook is not None and self.begin_hook(self))

    def _stage(self, b):
        """Bucket b's staging buffer (zeroed: its padding must read as zeros in the sum)."""
        buf = self.staging.get(b)
        if buf is None:
            while len(self.works) >= MAX_INFLIGHT:
                self._finish(self.works.pop(0))
            start, chunk = self.buckets[b][0], self.buckets[b][1]
            n = chunk * self.world
            k = b % WINDOW_SLOTS
            if self.window is not None and self.slot_bucket[k] is not None and n and \
                    any(item[0] == self.slot_bucket[k] for item in self.works):
                # the slot's bucket is reducing: wait for it (and the ones launched before it)
                # rather than stage privately, which would send this bucket through the slots
                while self.slot_bucket[k] is not None and self.works:
                    self._finish(self.works.pop(0))
            if self.window is not None and self.slot_bucket[k] is None and n:  # an empty bucket is never launched
                self.slot_bucket[k] = b
                buf = self.window[k * self.slot_numel:k * self.slot_numel + n]
                buf.zero_()
                self.staging[b] = buf
                return buf
            buf = next((t for t in self.free if t.numel() >= n), None)
            if buf is None:
                buf = torch.empty(max(n, self.slot_numel),
                                  dtype=self.dtype, device=self.device)
            else:
                self.free.remove(buf)
            buf = buf[:n]
            buf.zero_()
            self.staging[b] = buf
        return buf

    def _copy_in(self, i, p) -> bool:
        g = p.grad
        if g is None or self.seen[i]:
            # a second hook on this parameter, or its gradient delivered twice in one backward (a
            # weight in two reentrant-checkpointed segments): refused before anything is written
            raise RuntimeError(f"ZeRO stage 2: the gradient of {self.names(p)} arrived twice in one backward (a "
                               "parameter used by two reentrant-checkpointed segments, or prepared twice, or under "
                               "full sharding a unit run outside a forward that torch.compile, called after "
                               "prepare(), traces: compile through the Accelerator's dynamo plugin instead); "
                               "each gradient is reduce-scattered once per backward")
        if g.requires_grad:
            raise RuntimeError("backward(create_graph=True) is not supported under ZeRO stage 2: the gradient of "
                               f"{self.names(p)} carries a graph and cannot be reduce-scattered")
        if p.dtype != self.dtype or p.device != self.device:
            raise RuntimeError(f"ZeRO stage 2: parameter {self.names(p)} was cast or moved after prepare() "
                               f"({p.dtype} on {p.device}, prepared as {self.dtype} on {self.device})")
        b = self.where[i]
        off, n = self.spans[i]
        view = self._stage(b)[off - self.buckets[b][0]:off - self.buckets[b][0] + n].view(p.shape)
        with torch.no_grad():
            torch.mul(g, self.prescale, out=view)
        p.grad = None  # the full gradient does not outlive its hook
        self.seen[i] = True
        return True

    def _launch(self, first, last):
        for b in range(first, last):
            chunk = self.buckets[b][1]
            staging = self.staging.get(b)
            if chunk == 0 or staging is None:
                continue  # zero-element parameters only: nothing to reduce
            try:  # in place: this rank's chunk of the staging buffer becomes the sum
                work = collectives.reduce_chunks(staging, self.rank, self.world, async_op=True)
            except RuntimeError as e:
                raise RuntimeError(self._where(b) + f" could not start: {e}") from e
            self.works.append((b, work, staging))
        if self.on_launched is not None:
            self.on_launched(last == len(self.buckets))

    def _finish(self, item):
        b, work, staging = item
        try:
            work.wait()
        except RuntimeError as e:
            raise RuntimeError(self._where(b) + f" failed or timed out: {e}") from e
        local, chunk = self.buckets[b][2], self.buckets[b][1]
        summed = staging[self.rank * chunk:(self.rank + 1) * chunk]
        if self.empty:  # the first sum since a clear replaces the shard; later ones are added
            self.shard[local:local + chunk].copy_(summed)
        else:
            self.shard[local:local + chunk].add_(summed)
        self._release(b)

    def _release(self, b):
        """Bucket b's staging buffer is free again: its window slot, or back to the pool."""
        buf = self.staging.pop(b)
        k = b % WINDOW_SLOTS
        if self.window is not None and self.slot_bucket[k] == b:
            self.slot_bucket[k] = None
            return
        self.free.append(buf._base if buf._base is not None else buf)

    def _where(self, b) -> str:
        names = [self.names(self.params[i]) for i, wb in enumerate(self.where) if wb == b]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        return (f"rank {dist.get_rank()}/{self.world}: {self.label + ': ' if self.label else ''}the reduce-scatter "
                f"of gradient bucket {b} ({self.buckets[b][1] * self.world} {self.dtype} elements: {shown})")

    def _end_of_backward(self):
        """The autograd engine's callback: finishes the backward unless gradients are still
        missing (then it may be a checkpointed segment's end: the shard waits, see _on_first)."""
        if self.reducer.launching and (self.reducer.pending() or self.reducer.defer):
            self.reducer.requeue = True
            return
        self.finish_backward()

    def finish_backward(self):
        """Every gradient of the backward has landed (or never will): the buckets of unused
        parameters (zeros, with find_unused_parameters) are launched, every reduce-scatter is
        waited for in order, and the parameters that now hold a gradient are agreed on."""
        self.reducer.requeue = False
        if not self.reducer.launching:
            return
        try:
            pending = self.reducer.pending()
            if pending and not self.find_unused:
                names = [self.names(self.params[i]) for i in pending]
                shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                raise RuntimeError(
                    f"rank {dist.get_rank()}: {len(names)} parameter(s) received no gradient in this backward: "
                    f"{shown}. Every trainable parameter of a prepared model must take part in the loss under ZeRO "
                    "stages 2 and 3 (every backward is reduce-scattered); pass kwargs_handlers=["
                    "DistributedDataParallelKwargs(find_unused_parameters=True)] to Accelerator if some "
                    "parameters are legitimately unused, or freeze them (requires_grad=False).")
            for i in pending:  # zeros in the sum: the staging range is zeroed when the buffer is taken
                b = self.where[i]
                self._stage(b)
                first, last = self.reducer.mark_ready(i)
                if not self.reducer.defer:
                    self._launch(first, last)
            if self.reducer.defer:  # every bucket now, in order
                self.reducer.defer = False
                self._launch(0, len(self.buckets))
            while self.works:
                self._finish(self.works.pop(0))
            self.empty = False
            seen = self.seen
            if self.find_unused:
                flags = torch.tensor(seen, dtype=torch.int32, device=self.stats_device)
                collectives.all_reduce(flags)
                seen = [bool(v) for v in flags.tolist()]
            self.has = [h or s for h, s in zip(self.has, seen)]
            self.carries = [c or s for c, s in zip(self.carries, seen)]  # new scaled sums added
            # the buckets launch in plan order: gradients arriving in another order keep more
            # buckets open at once (up to all of them); what that took is not kept beyond this
            del self.free[self.keep_free:]
        finally:
            self.abort()

    def drain(self) -> None:
        """Waits for every reduce-scatter this shard launched and lands the sums (a strategy that
        bounds how many shards have reductions in flight at once calls it on the oldest)."""
        while self.works:
            self._finish(self.works.pop(0))

    def release_staging(self) -> None:
        """Drops the staging buffers kept for the next backward (full sharding: a unit's buffer
        is the unit's whole gradient, and units take turns)."""
        self.free.clear()

    def abort(self):
        """Forgets what a backward half did, so the next one starts clean."""
        self.reducer.launching = False
        self.reducer.requeue = False
        self.reducer.defer = False
        self.reducer.reset()
        for item in self.works:
            try:
                item[1].wait()
            except RuntimeError:
                pass
        self.works = []
        for b in list(self.staging):
            self._release(b)

    # ---- what the step reads ---------------------------------------------------------------
    def run(self, i):
        """Parameter i's owned run of the gradient shard (1-D), or None: no gradient since the
        last clear (or this process owns none of it)."""
        local, _, length = self.runs[i]
        if not self.has[i] or self.empty or length == 0:
            return None
        return self.shard[local:local + length]

    def local_stats(self, indices, inf_norm: bool):
        """(sum of squares, max |g|, non-finite) of this process's runs of parameters `indices`."""
        if self.empty:
            return 0.0, 0.0, False
        whole = len(set(indices)) == len(self.params)
        if whole and self.shard_buf is not None:  # CPU: one fused C pass
            if inf_norm:
                return _C.stats(self.shard_buf)
            s, nf = _C.sumsq(self.shard_buf)
            return s, 0.0, nf
        runs = [self.shard] if whole else [r for r in (self.run(i) for i in indices) if r is not None and r.numel()]
        if not runs:
            return 0.0, 0.0, False
        # per run, on its device, accumulated in fp32 (no wide copy of the shard); one sync
        parts = torch.stack([torch.stack([torch.linalg.vector_norm(r, dtype=torch.float32).square(),
                                          r.abs().max().float(), (~torch.isfinite(r)).any().float()]) for r in runs])
        s, m, nf = parts[:, 0].sum(), parts[:, 1].max(), parts[:, 2].max()
        s, m, nf = torch.stack([s, m, nf]).tolist()
        return s, m, bool(nf)

    def scale_(self, indices, factor: float):
        """Multiplies this process's runs of parameters `indices` by `factor` (the clip)."""
        if self.empty or factor == 1.0:
            return
        if len(set(indices)) == len(self.params) and factor == factor and self.shard_buf is not None:
            _C.scale_(self.shard_buf, factor)  # the padding stays zero (finite factor)
            return
        for i in indices:
            r = self.run(i)
            if r is not None:
                r.mul_(factor)

    def nonfinite(self, indices) -> bool:
        return self.local_stats(indices, inf_norm=False)[2]

    def unscale_(self, indices, inv_scale: float) -> bool:
        """GradScaler's unscale_ of this process's runs of parameters `indices`: those that still
        carry the loss scale are scaled and checked (the whole shard on CPU: one C pass that
        scales and checks); returns whether unscaling found NaN/Inf in any of `indices` (as
        GradScaler records found_inf at unscale_, not what a later write left)."""
        todo = sorted({i for i in indices if self.carries[i]})
        if todo:
            if self.empty:
                found = False
            elif len(todo) == len(self.params) and self.shard_buf is not None and inv_scale == inv_scale:
                found = bool(_C.scale_stats_(self.shard_buf, inv_scale)[2])  # the padding stays zero
            else:
                self.scale_(todo, inv_scale)
                found = self.nonfinite(todo)
            for i in todo:
                # per parameter when something overflowed: two optimizers over one shard each
                # skip on their own gradients only, as GradScaler checks each optimizer's
                hit = found and (len(todo) == 1 or self.nonfinite([i]))
                self.carries[i], self.found_at[i], self.unscaled_in_step[i] = False, hit, True
        # unscaled before the scaler's last update (another optimizer's step updated it): as
        # OutsideGrad's, checked as they are now, not divided again (GradManager.unscale)
        stale = [i for i in set(indices) if not self.carries[i] and not self.unscaled_in_step[i]]
        if stale:
            found = not self.empty and self.nonfinite(stale)
            for i in stale:
                self.found_at[i] = found and (len(stale) == 1 or self.nonfinite([i]))
                self.unscaled_in_step[i] = True
        return any(self.found_at[i] for i in indices)

    def unscaled_again(self, indices) -> list:
        """Parameters of `indices` unscaled since the scaler's last update that a backward has
        added to since: their runs hold an unscaled part and a scaled one."""
        return [i for i in indices if self.carries[i] and self.unscaled_in_step[i]]

    def new_step(self, indices) -> None:
        """The optimizer over `indices` stepped (the scaler updated): whatever their runs hold
        counts as scaled again."""
        for i in indices:
            self.carries[i], self.found_at[i] = True, False

    def new_update(self) -> None:
        """The scaler updated (any optimizer's step: accelerate updates it in each): GradScaler's
        per-optimizer state ends for every optimizer, so no unscale is a second one now."""
        self.unscaled_in_step = [False] * len(self.params)

    def clear(self, indices=None, set_to_none=True):
        """zero_grad for parameters `indices` (None: all): None again (set_to_none), or zeros
        where they hold a gradient."""
        if indices is None or len(set(indices)) == len(self.params):
            if set_to_none:
                self.empty = True
                self.has = [False] * len(self.params)
            elif not self.empty:
                self.shard.zero_()
            return
        if self.empty:
            return
        for i in indices:  # every owned run, whatever `has` says: a failed backward may have left sums there
            local, _, length = self.runs[i]
            if length:
                self.shard[local:local + length].zero_()
            if set_to_none:
                self.has[i] = False

    def full_grad(self, i):
        """Parameter i's whole gradient, gathered from every process (a collective every process
        calls with the same i), or None when it has none."""
        b = self.where[i]
        start, chunk, local = self.buckets[b][:3]
        if not self.has[i]:
            return None
        dtype = self.shard.dtype
        mine = self.shard[local:local + chunk] if not self.empty else torch.zeros(chunk, dtype=dtype,
                                                                                   device=self.device)
        full = torch.empty(chunk * self.world, dtype=dtype, device=self.device)
        collectives.all_gather_into_tensor(full, mine.contiguous())
        off, n = self.spans[i]
        return full[off - start:off - start + n].view(self.shapes[i]).clone()

    def nbytes(self) -> int:
        """Bytes this object holds: the shard and the staging buffers (whole, not the views in use;
        the shared window's slots once, whether or not a bucket is staged there)."""
        bufs = [self.shard, *self.free, *((t._base if t._base is not None else t) for t in self.staging.values())]
        if self.window is not None:
            bufs.append(self.window)
        distinct = {t.data_ptr(): t.numel() * t.element_size() for t in bufs}
        return sum(distinct.values())

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
