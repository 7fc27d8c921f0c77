"""Flat gradient buffers and the gradient post-processing that runs on them.

At prepare() every trainable parameter of a model gets a range of one flat buffer per
(dtype, device): backward's gradient lands there and the C core unscales, checks for
overflow, measures and clips all gradients in one or two passes per buffer instead of one
small kernel per tensor. The multi-process reducer buckets the same buffers.

`.grad` behaves as in torch: None until a backward gives the parameter a gradient, None again
after zero_grad() (set_to_none). Whether a parameter has a gradient is never stored apart:
after resync() it is exactly `p.grad is view`. A post-accumulate-grad hook copies the gradient that
backward produced into the range and points `.grad` at it (what torch DDP's reducer does):
one copy, cheaper than zeroing the buffer and accumulating into zeros; later micro-batches
accumulate in place. `p.grad = None` / `p.grad = t` / model.zero_grad() work too, and
resync() brings in assignments made after backward. If the parameters are moved or cast
after prepare() (model.to(...)), the buffers are rebuilt at the next step.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.autograd.graph import increment_version

from . import _C

_ALIGN = 32  # elements; each range starts on a 64-byte boundary or better
_FINITE_MAX = {torch.float32: torch.finfo(torch.float32).max, torch.float16: torch.finfo(torch.float16).max,
               torch.bfloat16: torch.finfo(torch.bfloat16).max}


_HUGE_PAGE = 2 << 20


def _alloc_flat(numel: int, dtype, device) -> torch.Tensor:
    """A zeroed flat buffer. On the CPU, one of 2 MiB or more starts on a 2 MiB boundary and
    is advised onto transparent huge pages before it is first touched: every whole-buffer pass
    (backward's copy-in, the fused unscale/norm/clip, the optimizer's reads) then runs with
    512x fewer TLB misses (8-10% faster on a 55 MB buffer here; benchmarks/bench_step.py).
    The advice is a hint: where the kernel ignores it the buffer is the same, on 4 KiB pages."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is mapped yet
    start = (-raw.data_ptr()) % _HUGE_PAGE
    flat = raw[start:start + nbytes].view(dtype)
    _C.advise_hugepages(flat)
    return flat.zero_()


class GradGroup:
    """One flat buffer holding the gradients of parameters sharing a dtype and device."""

    def __init__(self, params, dtype, device, manager, order=None):
        self.manager = manager
        self.params = list(params)
        self.dtype = dtype
        self.device = device
        self.is_cuda = torch.device(device).type == "cuda"
        # what param.get_device() says for this group's device (-1: CPU)
        self.device_index = -1 if not self.is_cuda else (
            torch.device(device).index if torch.device(device).index is not None else self.params[0].get_device())
        self.needs_unscale = False
        self.found_inf = False  # CPU: bool; CUDA: float32 device tensor (see unscale_)
        self.broken = False
        # a backward on a sync step of a multi-process run whose buckets were not reduced yet
        self.pending_sync = False
        # (buffer version, sumsq, nonfinite) measured bucket by bucket as the all-reduces
        # finished (only once clip_grad_norm_ has asked for a 2-norm: want_stats); clip reuses it
        # instead of reading the buffer again
        self.stats = None
        self.want_stats = False
        self.relaid = False  # the layout follows the order gradients arrived in (after step 1)
        self.comm = None  # ddp.BucketComm on multi-process runs
        self.model_key = None  # id() of the prepared model the parameters came from
        self.nccl = False  # buckets launched by the C reducer over NCCL (ddp.BucketComm.attach)
        self.works = []  # buckets in flight: (bucket, work, range, wire tensor or None)
        self.hooks = []
        self._build(list(range(len(self.params)))[::-1] if order is None else order)
        for i, p in enumerate(self.params):
            if p.grad is not None:  # a gradient from before prepare() or a rebuild: bring it in
                with torch.no_grad():
                    self.views[i].copy_(p.grad)
                p.grad = self.views[i]

    def _build(self, order):
        """Lays the buffer out with the C bucket plan (gradients in `order`, the order they are
        expected to arrive in backward) and hooks every parameter to its range."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        first_cap, cap = self.manager.bucket_caps
        self.order = list(order)
        self.reducer = _C.Reducer([p.numel() for p in self.params], self.order, esize, first_cap, cap, _ALIGN,
                                  self._on_first, self._launch, self._slow)
        offsets, _ = self.reducer.layout()
        self.offsets = offsets
        self.flat = _alloc_flat(self.reducer.total(), self.dtype, self.device)
        self.views = [self.flat[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, self.params)]
        # the alignment gaps between ranges: zero, and kept zero (see scale_), so that
        # whole-buffer passes and bucket all-reduces read zeros there
        spans = sorted((o, o + p.numel()) for o, p in zip(offsets, self.params))
        ends = [0] + [e for _, e in spans]
        starts = [st for st, _ in spans] + [self.reducer.total()]
        self.gaps = [(e, st) for e, st in zip(ends, starts) if st > e]
        self.gap_index = None
        if self.is_cuda and self.gaps:
            self.gap_index = torch.cat([torch.arange(e, st) for e, st in self.gaps]).to(self.device)
        self.ptrs = [v.data_ptr() for v in self.views]
        # pointers are taken once here; per-step kernel calls pass this object, not a tensor
        self.buf = _C.Buffer(self.flat)
        self.reducer.set_buffer(self.buf)
        # each bucket's range, as a tensor for the collectives and a Buffer for the C kernels:
        # made once per layout, not per step
        spans = [self.reducer.range(b) for b in range(self.reducer.count())]
        self.buckets = [self.flat[s:s + n] for s, n in spans]
        self.bucket_bufs = [_C.Buffer(t) for t in self.buckets]
        self.wire_bufs = None  # per bucket: its wire-dtype buffer or None (ddp.BucketComm.wire_bufs)
        if self.is_cuda:  # device scalars of GradScaler's unscale and of clip, allocated once
            self.inv_dev = torch.ones(1, dtype=torch.float32, device=self.device)
            self.found_dev = torch.zeros(1, dtype=torch.float32, device=self.device)
            self.stats_dev = torch.zeros(3, dtype=torch.float32, device=self.device)  # sumsq, maxabs, non-finite
        for h in self.hooks:
            h.remove()
        # the hooks are C callables (_C.GradHook): a gradient that already is its view is
        # marked ready without running Python; the rest goes to _slow
        self.hooks = [p.register_post_accumulate_grad_hook(self.reducer.hook(i, v))
                      for i, (p, v) in enumerate(zip(self.params, self.views))]

    @torch.no_grad()
    def relayout(self, order):
        """Re-lays the buffer in `order` (every rank passes the same), keeping every
        parameter's gradient and `.grad` state."""
        old_views = self.views
        had = [p.grad is v for p, v in zip(self.params, old_views)]
        self._build(order)
        for p, old, new, h in zip(self.params, old_views, self.views, had):
            new.copy_(old)
            if h:
                p.grad = new
        self.stats = None
        self.relaid = True
        if self.comm is not None:
            self.comm.attach(self)

    # ---- what the hooks call ------------------------------------------------------------
    def _on_first(self):
        """The first gradient of this group in a backward: a new step for the unscale state;
        decides whether buckets are reduced while this backward runs, and queues the end of
        backward (also for a raw loss.backward())."""
        if self.reducer.requeue:
            # more gradients after an end of backward that came too early (see
            # _end_of_backward): this backward goes on, in the graph task now running
            self.reducer.requeue = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return
        if not self.needs_unscale:  # first gradient since the last unscale: a new step
            self.needs_unscale = True
            self.found_inf = False
        self.stats = None
        launching = self.comm is not None and self.manager.sync_now(self.model_key)
        self.reducer.launching = launching
        # a reduced backward divides each gradient by the world size as it becomes ready (in
        # the hook, or folded into the copy-in): the all-reduce's sum is then the average
        self.reducer.prescale = self.comm.prescale if launching else 1.0
        if launching:
            self.comm.start(self)
        self.pending_sync = self.pending_sync or launching
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _launch(self, first, last):
        self.comm.launch(self, first, last)

    def _end_of_backward(self):
        """The autograd engine's callback, queued on the graph task that delivered this group's
        first gradient. Under reentrant activation checkpointing that may be a checkpointed
        segment's inner backward, which ends while the outer one still has gradients of this
        group to deliver (torch DDP waits for its last bucket instead). So when gradients are
        still missing on a reduced backward, the group waits: the next of its hooks queues this
        again on the task then running, and finish_awaiting() (after Accelerator.backward, or
        before the step reads gradients) completes a backward that delivers no more."""
        if self.reducer.launching and not self.broken and self.reducer.pending():
            self.reducer.requeue = True  # the group waits for its next hook
            return
        self._finish_backward()

    def _finish_backward(self):
        self.reducer.requeue = False
        try:
            if self.reducer.launching and not self.broken:
                self.comm.finish(self)
        finally:
            self.works = []
            self.reducer.launching = False
            self.reducer.reset()

    def _slow(self, i, p) -> bool:
        """A gradient that is not the parameter's view (the first backward after zero_grad
        set it to None, or .grad was assigned): copy it in and re-point `.grad`, as torch DDP's
        reducer does. Returns False when the parameter was cast or moved after prepare()."""
        if p.dtype != self.dtype or p.device != self.device:
            self.broken = True  # rebuilt at the next step
            return False
        g = p.grad
        if g.requires_grad:
            # backward(create_graph=True): the gradient carries a graph; it stays as it is until
            # resync() at the step. Buckets cannot be reduced without it.
            if self.reducer.launching:
                raise RuntimeError("backward(create_graph=True) is not supported with several processes: the "
                                   "gradient of a parameter carries a graph and cannot be reduced in its bucket")
            return True
        view = self.views[i]
        with torch.no_grad():
            f = self.reducer.prescale  # 1.0 unless this backward is reduced (_on_first)
            if f != 1.0:
                torch.mul(g, f, out=view)  # the copy-in that also averages (torch DDP's trick)
            else:
                view.copy_(g)
        p.grad = view
        return True

    def loose_or_broken(self):
        """None when the group is broken: a parameter was cast or moved after prepare()
        (model.to(...) swaps `.grad.data` under the view, so the range would silently stop
        being used). Else the indices whose `.grad` is not its view, for resync(). One C walk
        over the parameters, run once per step (GradManager.prepare_step)."""
        if self.broken:
            return None
        return _C.grad_views(self.params, self.views, self.ptrs, self.dtype, self.device_index)

    @torch.no_grad()
    def resync(self, loose):
        """Brings the `.grad` assignments made outside backward (params `loose`, from
        loose_or_broken) into the buffer; zeroes the ranges of params without a gradient
        (their `.grad` stays None), so whole-buffer passes see zeros there."""
        for i in loose:
            p, v = self.params[i], self.views[i]
            g = p.grad
            if g is v:
                continue
            if g is None:
                v.zero_()  # stale since the last zero_grad; whole-buffer passes must see zeros
                continue
            if g.shape != v.shape:
                raise ValueError(f"a gradient of shape {tuple(g.shape)} was assigned to a parameter of shape "
                                 f"{tuple(v.shape)}")
            v.copy_(g)
            p.grad = v

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                p.grad = v.clone()

    # ---- kernels ------------------------------------------------------------------------
    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def wrote(self):
        """The C kernels wrote the buffer through DLPack, which torch cannot see: bump the
        version counter (shared by every view, so `.grad` readers and cached_stats see the
        change) as torch's own in-place ops would."""
        increment_version(self.flat)

    def scale_(self, factor: float):
        if factor == 1.0:
            return
        if self.is_cuda:
            _C.cuda_scale_(self.buf, factor, None, self.stream())
        else:
            _C.scale_(self.buf, factor)
        if math.isnan(factor):  # torch's clip of a NaN norm: 0 x NaN would poison the gaps
            self.zero_gaps()
        self.wrote()

    def zero_gaps(self):
        """Zeroes the gaps between the ranges after a pass that may have written non-finite
        values there (a NaN factor): otherwise every later step's norm and overflow check, and
        every rank's all-reduce, would see them."""
        if self.gap_index is not None:
            self.flat.index_fill_(0, self.gap_index, 0)
        elif not self.is_cuda:
            for start, end in self.gaps:
                self.flat[start:end].zero_()

    def unscale_(self, inv_scale: float):
        """GradScaler's unscale_ over the whole buffer: one pass that scales and checks."""
        if self.is_cuda:
            self.inv_dev.fill_(inv_scale)
            self.found_dev.zero_()
            _C.cuda_unscale_check_(self.buf, self.inv_dev, self.found_dev, None, self.stream())
            self.found_inf = self.found_dev  # stays on the device until the step needs it
        else:
            _, _, nonfinite = _C.scale_stats_(self.buf, inv_scale)
            self.found_inf = bool(nonfinite)
        self.wrote()
        self.needs_unscale = False

    def cached_stats(self):
        """(sumsq, nonfinite) of the buffer if nothing wrote to it since the reducer's averaging
        pass measured it (any in-place change through a view bumps the version)."""
        if self.stats is not None and self.stats[0] == self.flat._version:
            return self.stats[1:]
        return None

    def found_in(self, indices) -> bool | torch.Tensor:
        """Whether the (already unscaled) gradients of these params hold NaN/Inf: the group's
        flag when they are the whole group, else a check of just their ranges, so one
        optimizer's overflow does not skip another optimizer's step."""
        if len(set(indices)) == len(self.params) or not (torch.is_tensor(self.found_inf) or self.found_inf):
            return self.found_inf
        if self.is_cuda:
            return torch.stack([(~torch.isfinite(self.views[i])).any() for i in indices]).any().float()
        return any(_C.nonfinite(self.views[i]) for i in indices)


def _combine_stats(accs):
    """(sumsq, maxabs, non-finite) of several devices' partials, on the first one's device, in a
    fixed order (the groups'), so the result does not depend on timing."""
    parts = torch.stack([a.to(accs[0].device) for a in accs])
    return torch.stack([parts[:, 0].sum(), parts[:, 1].max(), parts[:, 2].max()])


class GradManager:
    """All flat gradient groups of one Accelerator, and the operations the step needs."""

    def __init__(self):
        self.groups: list[GradGroup] = []
        self.where: dict[int, tuple[GradGroup, int]] = {}  # id(param) -> (group, index)
        self.epoch = 0  # bumped whenever groups or `where` change (full_groups' cache key)
        self._full_cache = None
        # params outside the buffers (not in a prepared model, or float64): id -> [needs_unscale, hook]
        self.loose: dict[int, list] = {}
        self.extra: list = []  # trainable params of prepared models that have no buffer
        self.extra_hooks: list = []
        self.extra_pending = False  # an extra param got a gradient on a sync step, not reduced yet
        self.names: dict[int, str] = {}  # id(param) -> its name in the model, for error messages
        # bucket sizes of the reducer: torch DDP's (first bucket 1 MiB, then bucket_cap_mb)
        self.bucket_caps = (1024 * 1024, 25 * 1024 * 1024)
        self.comm = None  # ddp.BucketComm when several processes train
        # id(model) -> depth of Accelerator.no_sync(model): its backward does not communicate
        self.no_sync_models: dict[int, int] = {}
        self.force_sync = 0  # inside Accelerator.trigger_sync_in_backward()
        self.joining: dict = {}  # id(model) -> ddp.ModelJoinable inside join_uneven_inputs()

    def configure(self, comm=None, bucket_cap_mb: float | None = None):
        """Multi-process runs: the communicator and the bucket cap (DistributedDataParallelKwargs)."""
        if bucket_cap_mb is not None and bucket_cap_mb != 25:
            # as torch DDP: a cap given by the user applies to the first bucket too (accelerate
            # passes only non-default values on, so 25 means torch's defaults)
            if not bucket_cap_mb > 0:
                raise ValueError(f"DistributedDataParallelKwargs(bucket_cap_mb={bucket_cap_mb!r}) must be > 0")
            cap = max(1, int(bucket_cap_mb * 1024 * 1024))
            self.bucket_caps = (cap, cap)
        self.comm = comm
        for g in self.groups:
            g.comm = comm
            if comm is not None:
                comm.attach(g)

    def sync_now(self, model_key) -> bool:
        """Whether a backward of that model starting now reduces gradients across processes:
        as with torch DDP, unless it runs inside no_sync(model) (which accumulate() enters on
        accumulation steps)."""
        return bool(self.force_sync) or not self.no_sync_models.get(model_key)

    def start_join(self, model):
        """join_uneven_inputs(): the Joinable that shadows `model`'s collectives once this
        process runs out of data."""
        from .ddp import ModelJoinable

        j = ModelJoinable(self, model)
        self.joining[id(model)] = j
        return j

    def add_model(self, model: torch.nn.Module):
        for name, p in model.named_parameters():
            self.names.setdefault(id(p), name)
        self._add_params(list(model.parameters()), model_key=id(model))

    def name_of(self, p) -> str:
        return self.names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")

    def _add_params(self, params, pending_sync=False, model_key=None):
        by_key: dict = {}
        for p in params:
            if not p.requires_grad or id(p) in self.where:
                continue  # frozen params need no buffer; shared params are registered once
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError("sparse or non-strided parameters are not supported by the gradient buffers")
            bucket = by_key.setdefault((p.dtype, p.device), [])
            if all(q is not p for q in bucket):
                bucket.append(p)
        for (dtype, device), group_params in by_key.items():
            if dtype not in _FINITE_MAX:
                # e.g. float64: no C kernels; these stay ordinary torch gradients
                for p in group_params:
                    if all(q is not p for q in self.extra):
                        self.extra.append(p)
                        self.extra_hooks.append(p.register_post_accumulate_grad_hook(
                            lambda param, key=model_key: self._extra_hook(key)))
                continue
            g = GradGroup(group_params, dtype, device, self)
            g.model_key = model_key
            g.comm = self.comm
            if self.comm is not None:
                self.comm.attach(g)
            g.pending_sync = pending_sync
            self.groups.append(g)
            self.epoch += 1
            for i, p in enumerate(group_params):
                self.where[id(p)] = (g, i)

    def finish_awaiting(self):
        """Completes the reduced backwards whose end came with gradients still missing and that
        delivered no more (GradGroup._end_of_backward): the missing ones are then really unused
        (an error without find_unused_parameters, zeros with it). Every rank calls this at the
        same point: the end of Accelerator.backward, and prepare_step for a raw loss.backward()."""
        for g in list(self.groups):
            if g.reducer.requeue:
                g._finish_backward()

    def abort_backward(self):
        """After a backward that raised: forget half-marked buckets so the next one starts clean."""
        for g in self.groups:
            g.works = []
            g.reducer.requeue = False
            g.reducer.defer = False
            g.reducer.launching = False
            g.reducer.reset()

    def _extra_hook(self, model_key):
        if self.comm is not None and self.sync_now(model_key):
            self.extra_pending = True

    def prepare_step(self):
        """What every entry point that reads gradients (clip, unscale, optimizer step) runs
        first: rebuild groups invalidated by model.to(...), bring `.grad` assignments into the
        buffers; on a sync step of a multi-process run, reduce what the bucketed reducer could
        not (groups rebuilt mid-step, float64 params) with one all-reduce each (every rank
        reaches the same entry points)."""
        self.finish_awaiting()
        self.sync_views()
        if self.comm is None:
            return
        todo = [g for g in self.groups if g.pending_sync]
        if todo or self.extra_pending:
            from .ddp import sync_gradients

            sync_gradients(self, todo, self.extra if self.extra_pending else [])

    def sync_views(self):
        """One walk per group: resyncs the `.grad` assignments of intact groups and rebuilds
        the groups whose parameters were cast or moved since prepare() (a rebuilt group takes
        the gradients in as it is built)."""
        for g in list(self.groups):
            loose = g.loose_or_broken()
            if loose is not None:
                g.resync(loose)
                continue
            params = g.params
            g.remove()
            self.groups.remove(g)
            self.epoch += 1
            for p in params:
                self.where.pop(id(p), None)
            # a group broken during a sync backward missed its bucketed reduction
            self._add_params(params, pending_sync=g.pending_sync, model_key=g.model_key)

    def clear(self):
        for g in self.groups:
            g.remove()
        for _, hook in self.loose.values():
            hook.remove()
        for h in self.extra_hooks:
            h.remove()
        self.groups, self.where, self.loose, self.extra, self.extra_hooks = [], {}, {}, [], []
        self.epoch += 1
        self._full_cache = None
        self.extra_pending = False

    def _loose_needs_unscale(self, p) -> bool:
        """Whether a param outside the buffers got a (scaled) gradient since its last unscale;
        a hook keeps track, so each gradient is unscaled exactly once."""
        entry = self.loose.get(id(p))
        if entry is None:
            entry = [True, None]

            def hook(param, entry=entry):
                entry[0] = True

            entry[1] = p.register_post_accumulate_grad_hook(hook)
            self.loose[id(p)] = entry
        return entry[0]

    def split(self, params):
        """Groups touched by `params`, as {group: [indices]}, plus the params we do not manage."""
        touched, loose = {}, []
        for p in params:
            hit = self.where.get(id(p))
            if hit is None:
                loose.append(p)
            else:
                touched.setdefault(hit[0], []).append(hit[1])
        return touched, loose

    def full_groups(self, params):
        """The groups exactly covered by `params` (each param once), or None when params cover
        part of a group, repeat a param (torch would count it twice), or include a param with a
        gradient that we do not manage: then the generic torch path is used. Training loops
        pass the same parameters at every step: the answer is cached on their identities."""
        cache = self._full_cache
        if (cache is not None and cache[0] == self.epoch and len(cache[1]) == len(params)
                and all(map(operator.is_, params, cache[1]))):
            groups, loose = cache[2], cache[3]
        else:
            groups, loose = self._cover(params)
            self._full_cache = (self.epoch, tuple(params), groups, loose)
        if groups is None or any(p.grad is not None for p in loose):
            return None
        return groups

    def _cover(self, params):
        """(groups exactly covered by params or None, params we do not manage)."""
        if len({id(p) for p in params}) != len(params):
            return None, []
        touched, loose = self.split(params)
        for g, idx in touched.items():
            if len(idx) != len(g.params):
                return None, loose
        return list(touched), loose

    def ready(self, params, inv_scale: float | None = None) -> bool:
        """Brings the gradients of `params` up to date for a consumer (optimizer step,
        unscale_gradients, clip_grad_value_): groups rebuilt if needed, all-reduced on a sync
        step, assignments resynced (all three by prepare_step), and unscaled when inv_scale is
        given. Returns whether any of these params' gradients is non-finite (only checked when
        unscaling)."""
        self.prepare_step()
        touched, loose = self.split(params)
        return self.unscale(touched, loose, inv_scale) if inv_scale is not None else False

    def unscale(self, touched: dict, loose, inv_scale: float) -> bool:
        """Unscales what still carries the loss scale in the groups of `touched` ({group:
        indices}) and the `loose` params; returns True if any of *these params'* gradients is
        non-finite. CUDA flags are combined on the device: one device->host sync per call."""
        found, device_flags = False, []
        for g, idx in touched.items():
            if g.needs_unscale:
                g.unscale_(inv_scale)
            f = g.found_in(idx)
            if torch.is_tensor(f):
                device_flags.append(f.reshape(()))
            else:
                found = found or f
        for p in loose:
            if p.grad is not None and self._loose_needs_unscale(p):
                p.grad.mul_(inv_scale)
                self.loose[id(p)][0] = False
            if p.grad is not None and not found:
                found = not bool(torch.isfinite(p.grad).all())
        if device_flags and not found:
            found = bool(torch.stack(device_flags).sum().item())
        return found

    def clip_norm_fused(self, groups, max_norm: float, norm_type: float, inv_scale: float | None):
        """Total norm of the gradients in `groups` (unscaling first those that still carry the
        loss scale, when inv_scale is given) and clip them to max_norm, with
        torch.nn.utils.clip_grad_norm_'s formula. CPU: one read pass plus one scaling pass per
        buffer; on multi-process sync steps only the scaling pass (the reducer's averaging pass
        measured the buffer already). Returns the norm as a 0-dim tensor of the gradients' dtype (on the device for
        CUDA groups: no host synchronisation), or None when the groups mix CPU and CUDA."""
        if all(g.is_cuda for g in groups) and groups:
            return self._clip_cuda(groups, max_norm, norm_type, inv_scale)
        if any(g.is_cuda for g in groups):
            return None
        per = []
        for g in groups:
            inv = inv_scale if (inv_scale is not None and g.needs_unscale) else 1.0
            if norm_type == 2.0:
                g.want_stats = True  # from the next reduced backward on, measured while it is hot
            cached = g.cached_stats() if norm_type == 2.0 and inv <= 1.0 else None
            if cached is not None:  # the reducer's averaging pass measured the buffer as it is
                (sumsq, nonfinite), maxabs = cached, 0.0
            elif norm_type == 2.0 and inv <= 1.0:
                # unscaling by <= 1 cannot overflow: the memory-bound pass suffices
                sumsq, nonfinite = _C.sumsq(g.buf)
                maxabs = 0.0
            else:
                sumsq, maxabs, nonfinite = _C.stats(g.buf)
            found = bool(nonfinite) or maxabs * inv > _FINITE_MAX[g.dtype]
            per.append((g, inv, sumsq * inv * inv, maxabs * inv, found))
        if norm_type == math.inf:
            total = max((m for _, _, _, m, _ in per), default=0.0)
        else:
            total = math.sqrt(sum(s for _, _, s, _, _ in per))
        any_found = any(f for *_, f in per)
        if any_found:
            total = math.nan if any(math.isnan(s) for _, _, s, _, _ in per) else math.inf
        # torch's formula in torch's arithmetic: the norm comes out in the gradients' dtype (fp32
        # when they mix dtypes) and the coefficient is computed in it, so a bf16 model is clipped
        # by the same rounded coefficient as torch's; non-finite norms included (an fp16 step
        # that overflowed is skipped anyway, but its gradients end as torch leaves them: x 0
        # for inf, x NaN for NaN)
        dtypes = {g.dtype for g in groups}
        norm = torch.tensor(total, dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32)
        coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
        for g, inv, _, _, found in per:
            g.scale_(inv * coef)
            if inv != 1.0:
                g.needs_unscale = False
                g.found_inf = found
        return norm

    def _clip_cuda(self, groups, max_norm, norm_type, inv_scale):
        for g in groups:
            if inv_scale is not None and g.needs_unscale:
                g.unscale_(inv_scale)
        # A kernel may touch only its own device's memory (models spread over GPUs by
        # hf_device_map): each device accumulates into the scratch of its first group on its own
        # current stream, then the partials are combined on the first device.
        per_dev = {}
        for g in groups:
            if g.device_index not in per_dev:
                per_dev[g.device_index] = g.stats_dev.zero_()  # sumsq, maxabs, non-finite
            _C.cuda_stats_(g.buf, per_dev[g.device_index], g.stream())
        accs = list(per_dev.values())
        acc = accs[0] if len(accs) == 1 else _combine_stats(accs)
        total = acc[1] if norm_type == math.inf else acc[0].sqrt()
        # a NaN gradient makes the sum of squares NaN (squares are >= 0, so only NaN gives NaN):
        # the norm is then NaN, as torch's; other non-finite values give inf
        bad = torch.where(torch.isnan(acc[0]), torch.full_like(total, math.nan), torch.full_like(total, math.inf))
        total = torch.where(acc[2] > 0, bad, total)
        dtypes = {g.dtype for g in groups}
        total = total.to(dtypes.pop() if len(dtypes) == 1 else torch.float32)  # torch's norm dtype
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coefs = {}  # the coefficient on each device
        for g in groups:
            if g.device_index not in coefs:
                coefs[g.device_index] = coef.reshape(1).to(g.stats_dev.device)
            _C.cuda_scale_(g.buf, 1.0, coefs[g.device_index], g.stream())
            g.zero_gaps()  # the coefficient may be NaN, and the host does not know without a sync
            g.wrote()
        return total

    def new_scaler_step(self, params):
        """After an fp16 optimizer step (the scaler's update): as with torch's GradScaler, whose
        per-step state ends at update(), whatever gradients these params hold from now on count
        as scaled again and are unscaled and checked at the next step, with or without a
        backward in between (the zeros a zero_grad(set_to_none=False) left, say, find nothing;
        an overflow of the step just taken must not skip the next one). Only groups this
        optimizer covers whole: another optimizer over the rest of a group has not stepped."""
        touched, loose = self.split(params)
        for g, idx in touched.items():
            if len(set(idx)) == len(g.params):
                g.needs_unscale = True
                g.found_inf = False
        for p in loose:
            entry = self.loose.get(id(p))
            if entry is not None:
                entry[0] = True
