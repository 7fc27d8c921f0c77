"""The gradient post-processing that runs on the flat gradient buffers (grad_layout.py).

The C core unscales, checks for overflow, measures and clips all gradients in one or two passes
per buffer instead of one small kernel per tensor. GradGroup adds to a buffer's layout the
unscale state of the current step and what its hooks do; GradManager holds every buffer of one
Accelerator and runs the step's phases on them, asking its strategy (strategies/: one
process, ddp.DDPStrategy, later sharding) what else each phase does. If the parameters are moved
or cast after prepare() (model.to(...)), the buffers are rebuilt at the next step.
"""
from __future__ import annotations

import math
import operator
import os

import torch
from torch.autograd.graph import increment_version

from . import _C
from .clip_math import FINITE_MAX, clip_coef, norm_dtype
from .grad_layout import GradLayout
from .loose_grads import LooseGrads, kernel_ok as loose_kernel_ok
from .strategies import GradStrategy


class GradGroup(GradLayout):
    """One flat buffer (GradLayout) with the unscale state of the current step and the hook
    phases, which it hands to the manager's strategy."""

    def __init__(self, params, dtype, device, manager, model_key=None, order=None):
        self.manager = manager
        self.model_key = model_key  # id() of the prepared model the parameters came from
        self.needs_unscale = False
        self.found_inf = False  # CPU: bool; CUDA: float32 device tensor (see unscale_)
        self.unscaled_in_step = False  # unscaled since the last fp16 optimizer step (refuse_unscale_again)
        # a backward on a sync step whose buckets were not reduced yet (the strategy's fallback,
        # sync_missed, does it before the gradients are read)
        self.pending_sync = False
        self.strategy_state = None  # the strategy's own per-buffer state (strategies/base.py)
        super().__init__(params, dtype, device, manager.bucket_caps, order)

    def build(self, order):
        super().build(order)
        if self.is_cuda:  # device scalars of GradScaler's unscale and of clip, allocated once
            self.inv_dev = torch.ones(1, dtype=torch.float32, device=self.device)
            self.found_dev = torch.zeros(1, dtype=torch.float32, device=self.device)
            self.stats_dev = torch.zeros(3, dtype=torch.float32, device=self.device)  # sumsq, maxabs, non-finite
            # a 16-bit buffer's own stats before its clip sum is replaced (_clip_cuda)
            self.part_dev = torch.zeros(3, dtype=torch.float32, device=self.device) \
                if self.dtype in (torch.float16, torch.bfloat16) else None

    def alloc_buffer(self, numel: int) -> torch.Tensor:
        return self.manager.strategy.alloc_buffer(numel, self.dtype, self.device)

    # ---- what the hooks call ------------------------------------------------------------
    def on_first(self):
        """The first gradient of this group in a backward: a new step for the unscale state;
        the strategy decides whether buckets are reduced while this backward runs; queues the
        end of backward (also for a raw loss.backward())."""
        if self.reducer.requeue:
            # more gradients after an end of backward that came too early (see
            # _end_of_backward): this backward goes on, in the graph task now running
            self.reducer.requeue = False
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            return
        self.begin_backward()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def begin_backward(self):
        """on_first's work without its callback; the strategy calls it directly for a group
        that got no gradient on this process in a backward its model reduces (find_unused:
        DDPStrategy.finish_ordered_groups)."""
        if not self.needs_unscale:  # first gradient since the last unscale: a new step
            self.needs_unscale = True
            self.found_inf = False
        strategy = self.manager.strategy
        sync = self.manager.sync_now(self.model_key)
        launching = strategy.begin_backward(self, sync)
        self.reducer.launching = launching
        # one process, once clip asked for a 2-norm: the hooks measure each gradient as it lands
        self.reducer.measure = strategy.measure_in_hooks(self, sync)
        # a reduced backward divides each gradient by the world size as it becomes ready (in
        # the hook, or folded into the copy-in): the all-reduce's sum is then the average
        self.reducer.prescale = strategy.prescale if launching else 1.0
        self.pending_sync = self.pending_sync or launching
        self.manager.note_sync_backward(self.model_key)

    def on_buckets(self, first, last):
        self.manager.strategy.buckets_ready(self, first, last)

    def _end_of_backward(self):
        """The autograd engine's callback, queued on the graph task that delivered this group's
        first gradient. Under reentrant activation checkpointing that may be a checkpointed
        segment's inner backward, which ends while the outer one still has gradients of this
        group to deliver (torch DDP waits for its last bucket instead). So when gradients are
        still missing on a reduced backward, the group waits: the next of its hooks queues this
        again on the task then running, and finish_awaiting() (after Accelerator.backward, or
        before the step reads gradients) completes a backward that delivers no more.
        With find_unused_parameters, at the end of the outermost backward (no autograd node is
        running on this thread: a nested task's end runs inside its outer node) the missing
        gradients are unused, and the group finishes there, as torch DDP's reducer does by the
        end of backward: a raw loss.backward() leaves `.grad` averaged before the loop reads or
        replaces it (join_uneven_inputs + find_unused drew that: a `.grad` replaced after a raw
        backward was overwritten by the local value at the step)."""
        strategy = self.manager.strategy
        if self.reducer.launching and not self.broken:
            if strategy.finishes_in_order(self):
                self.reducer.requeue = True  # the strategy's callback ends this backward
                return
            if self.reducer.pending() and not (strategy.missing_means_unused(self)
                                               and torch._C._current_autograd_node() is None):
                self.reducer.requeue = True  # the group waits for its next hook, or finish_awaiting
                return
        self.finish_backward()

    def finish_backward(self):
        self.reducer.requeue = False
        try:
            if self.reducer.launching and not self.broken:
                self.manager.strategy.end_of_backward(self)
                self.pending_sync = False
        finally:
            self.abort_backward()

    def abort_backward(self):
        """Forgets half-marked buckets so the next backward starts clean."""
        self.manager.strategy.abort_backward(self)
        self.reducer.requeue = False
        self.reducer.defer = False
        self.reducer.launching = False
        self.reducer.reset()

    # ---- unscale ------------------------------------------------------------------------
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
        self.unscaled_in_step = True

    def found_in(self, indices) -> bool | torch.Tensor:
        """Whether the (already unscaled) gradients of these params hold NaN/Inf: the group's
        flag when they are the whole group, else a check of just their ranges, so one
        optimizer's overflow does not skip another optimizer's step."""
        if len(set(indices)) == len(self.params) or not (torch.is_tensor(self.found_inf) or self.found_inf):
            return self.found_inf
        return self.nonfinite_in(indices)

    def nonfinite_in(self, indices) -> bool | torch.Tensor:
        """Whether the gradients of these params hold NaN/Inf now (read as they are, scaled or
        not): the whole buffer when they are the whole group, else just their ranges."""
        whole = len(set(indices)) == len(self.params)
        if self.is_cuda:
            if whole:
                return (~torch.isfinite(self.buf)).any().float()
            return torch.stack([(~torch.isfinite(self.views[i])).any() for i in indices]).any().float()
        return bool(_C.nonfinite(self.buf)) if whole else any(_C.nonfinite(self.views[i]) for i in indices)


def _norm_dtype(groups):
    """torch's clip norm dtype (clip_math.norm_dtype) for the groups' gradients present: a bf16
    model with an fp32 layer that got no gradient clips in bf16."""
    return norm_dtype(g.dtype for g in groups if g.has_gradients())


def _combine_stats(accs):
    """(sumsq, maxabs, non-finite) of several devices' partials, on the first one's device, in a
    fixed order (the groups'), so the result does not depend on timing."""
    parts = torch.stack([a.to(accs[0].device) for a in accs])
    return torch.stack([parts[:, 0].sum(), parts[:, 1].max(), parts[:, 2].max()])


class OutsideGrad:
    """fp16 bookkeeping of one parameter whose gradient lives outside the buffers: whether the
    gradient still carries the loss scale, and whether unscaling it found NaN/Inf (what the step
    skips on, as GradScaler records found_inf at unscale_, not what a later write left). A
    post-accumulate-grad hook marks each new gradient (GradManager.track_outside)."""
    __slots__ = ("carries_scale", "found", "hook", "unscaled_in_step")

    def __init__(self):
        self.carries_scale, self.found, self.hook = True, False, None
        self.unscaled_in_step = False  # since the last fp16 optimizer step (GradManager.refuse_unscale_again)

    def new_gradient(self) -> None:
        self.carries_scale, self.found = True, False

    def unscaled(self, found: bool) -> None:
        self.carries_scale, self.found, self.unscaled_in_step = False, found, True

    def new_step(self) -> None:
        self.new_gradient()
        self.unscaled_in_step = False


class GradManager:
    """All flat gradient groups of one Accelerator, and the operations the step needs."""

    def __init__(self):
        self.groups: list[GradGroup] = []
        self.where: dict[int, tuple[GradGroup, int]] = {}  # id(param) -> (group, index)
        self.epoch = 0  # bumped whenever groups or `where` change (full_groups' cache key)
        self._full_cache = None
        # params an optimizer steps that are outside the buffers (not in a prepared model,
        # float64, or one CPU process: loose_grads.py): id -> their fp16 bookkeeping
        self.outside: dict[int, OutsideGrad] = {}
        # trainable params of prepared models that have no buffer (float64: no C kernels); their
        # gradients stay ordinary torch tensors
        self.unbuffered: list = []
        self.unbuffered_hooks: list = []
        # id() of a prepared model -> its unbuffered params, in the order they were found (the
        # same on every rank)
        self.unbuffered_of: dict = {}
        # id()s of the models whose unbuffered params wait for the step's reduction
        self.unbuffered_pending: set = set()
        self.names: dict[int, str] = {}  # id(param) -> its name in the model, for error messages
        # bucket sizes of the reducer: torch DDP's (first bucket 1 MiB, then bucket_cap_mb)
        self.bucket_caps = (1024 * 1024, 25 * 1024 * 1024)
        self.strategy: GradStrategy = GradStrategy()
        # id(model) -> depth of Accelerator.no_sync(model): its backward does not communicate
        self.no_sync_models: dict[int, int] = {}
        self.force_sync = 0  # inside Accelerator.trigger_sync_in_backward()
        # one CPU process: gradients left as autograd's tensors (loose_grads.py), unless the
        # Accelerator runs a sharding plugin there (allow_loose False) or
        # ACCELERATE_C_GRAD_BUFFERS=flat asks for the flat buffers
        self.loose = LooseGrads(self)
        self.allow_loose = True

    def configure(self, strategy: GradStrategy, bucket_cap_mb: float | None = None):
        """Multi-process runs: the strategy and the bucket cap (DistributedDataParallelKwargs)."""
        if bucket_cap_mb is not None and bucket_cap_mb != 25:
            # as torch DDP: a cap given by the user applies to the first bucket too (accelerate
            # passes only non-default values on, so 25 means torch's defaults)
            if not bucket_cap_mb > 0:
                raise ValueError(f"DistributedDataParallelKwargs(bucket_cap_mb={bucket_cap_mb!r}) must be > 0")
            cap = max(1, int(bucket_cap_mb * 1024 * 1024))
            self.bucket_caps = (cap, cap)
        self.strategy = strategy
        for g in self.groups:
            strategy.attach(g)

    @property
    def distributed(self) -> bool:
        return self.strategy.world > 1

    def sync_now(self, model_key) -> bool:
        """Whether a backward of that model starting now reduces gradients across processes:
        as with torch DDP, unless it runs inside no_sync(model) (which accumulate() enters on
        accumulation steps)."""
        return bool(self.force_sync) or not self.no_sync_models.get(model_key)

    def prepare_model(self, model: torch.nn.Module, trainable: bool = True):
        """Accelerator.prepare_model: the strategy's part, then (unless the model is prepared
        for evaluation only) buffers for its trainable parameters."""
        self.strategy.prepare_model(model, self)
        if trainable:
            if self.strategy.buffers_gradients:
                self.add_model(model)
            else:  # ZeRO-2: the strategy keeps the gradients as shards
                self.strategy.adopt_gradients(model, self)

    def add_model(self, model: torch.nn.Module):
        """Flat buffers for the trainable parameters of `model` (on one CPU process its hooks
        instead: loose_grads.py)."""
        for name, p in model.named_parameters():
            self.names.setdefault(id(p), name)
        params = list(model.parameters())
        if self._loose_wanted():
            self.loose.add([p for p in params if p.device.type == "cpu"])
            params = [p for p in params if p.device.type != "cpu"]
        self._add_params(params, model_key=id(model))

    def _loose_wanted(self) -> bool:
        """One process, no sharding plugin, CPU parameters: no flat buffer (loose_grads.py says
        why), unless ACCELERATE_C_GRAD_BUFFERS=flat."""
        mode = os.environ.get("ACCELERATE_C_GRAD_BUFFERS", "auto").strip().lower() or "auto"
        if mode not in ("auto", "flat"):
            raise ValueError(f"ACCELERATE_C_GRAD_BUFFERS={mode!r}: expected 'auto' (the default: no flat gradient "
                             "buffers on one CPU process) or 'flat' (always)")
        return mode == "auto" and self.allow_loose and not self.distributed

    def start_join(self, model):
        """join_uneven_inputs(): the Joinable that shadows `model`'s collectives once this
        process runs out of data."""
        return self.strategy.start_join(model, self)

    def end_join(self):
        self.strategy.end_join()

    def name_of(self, p) -> str:
        return self.names.get(id(p), f"<parameter of shape {tuple(p.shape)}>")

    def groups_of(self, model_key) -> list:
        return [g for g in self.groups if g.model_key == model_key]

    def _add_params(self, params, model_key=None, replaced=None):
        """Buffers for `params` (`replaced`: the broken group they come from, whose strategy
        state carries over)."""
        by_key: dict = {}
        for p in params:
            if not p.requires_grad or id(p) in self.where or id(p) in self.loose.params:
                continue  # frozen params need no buffer; shared params are registered once
            if p.is_sparse or p.layout != torch.strided:
                raise ValueError("sparse or non-strided parameters are not supported by the gradient buffers")
            bucket = by_key.setdefault((p.dtype, p.device), [])
            if all(q is not p for q in bucket):
                bucket.append(p)
        for (dtype, device), group_params in by_key.items():
            if dtype not in FINITE_MAX:
                for p in group_params:
                    if all(q is not p for q in self.unbuffered):
                        self.unbuffered.append(p)
                        self.unbuffered_of.setdefault(model_key, []).append(p)
                        self.unbuffered_hooks.append(p.register_post_accumulate_grad_hook(
                            lambda param, key=model_key: self._unbuffered_hook(key)))
                continue
            g = GradGroup(group_params, dtype, device, self, model_key=model_key)
            # a group broken during a sync backward missed its bucketed reduction
            g.pending_sync = replaced is not None and replaced.pending_sync
            self.strategy.attach(g, None if replaced is None else replaced.strategy_state)
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
                g.finish_backward()
        self.strategy.finish_awaiting()

    def average_pending_unbuffered(self):
        """At both ends of Accelerator.backward (finish_awaiting first at its end), and on entering
        accumulate() and no_sync(): the float64
        parameters a sync backward left pending are averaged now, as torch DDP averages the
        bucket holding them after every backward that reduces, rather than at the step: with
        several sync backwards before a step a 16-bit comm hook then re-rounds the running sum
        as torch's does (soak cases 6464376765, 6467673569), and `.grad` read after the call is
        the average. At the other points for a raw sync loss.backward() before them, whose
        gradients must be averaged before the next backward adds more (a review: a raw sync
        backward, then a no_sync micro-batch). Here, not in their hooks or at the autograd engine's end of backward:
        every rank reaches these points with no backward running, under reentrant
        checkpointing too, whatever order its autograd delivered gradients in or which of them
        control flow left out, and the pending models are averaged in the manager's order
        (flags agreed first: reduce_unbuffered). Raw sync backwards with none of these calls
        between them, or before the step, are averaged together at the step (prepare_step)."""
        if self.distributed and self.unbuffered_pending:
            self.strategy.sync_missed([], self.unbuffered_pending)
            self.unbuffered_pending = set()

    def abort_backward(self):
        """After a backward that raised: forget half-marked buckets so the next one starts clean."""
        for g in self.groups:
            g.abort_backward()
            # what the aborted backward started is forgotten: its bucketed reduction must not be
            # redone by the next step's fallback over gradients a later backward reduced itself
            g.pending_sync = False
        self.unbuffered_pending = set()
        self.strategy.abort_held()

    def _unbuffered_hook(self, model_key):
        self.note_sync_backward(model_key)

    def note_sync_backward(self, model_key):
        """A backward that may reduce delivered a gradient of `model_key` (an unbuffered
        param's hook, or a group's first gradient: GradGroup.begin_backward). If it does reduce
        and the model has unbuffered (float64) params, the strategy averages them at its end,
        or they wait for the step: marked on every rank, also where control flow gave none of
        them a gradient here (the reduction is a collective: every rank must decide alike)."""
        if model_key in self.unbuffered_of and self.distributed and self.sync_now(model_key):
            if not self.strategy.unbuffered_backward(model_key):
                self.unbuffered_pending.add(model_key)

    def prepare_step(self):
        """What every entry point that reads gradients (clip, unscale, optimizer step) runs
        first: rebuild groups invalidated by model.to(...), bring `.grad` assignments into the
        buffers; then the strategy reduces what its bucketed path could not (every rank reaches
        the same entry points)."""
        self.finish_awaiting()
        self.sync_views()
        if not self.distributed:
            return
        todo = [g for g in self.groups if g.pending_sync]
        if todo or self.unbuffered_pending:
            self.strategy.sync_missed(todo, self.unbuffered_pending)
            for g in todo:
                g.pending_sync = False
            self.unbuffered_pending = set()

    def sync_views(self):
        """One walk per group: resyncs the `.grad` assignments of intact groups and rebuilds
        the groups whose parameters were cast or moved since prepare() (a rebuilt group takes
        the gradients in as it is built)."""
        for g in list(self.groups):
            unsynced = g.unsynced()
            if unsynced is not None:
                if unsynced:  # most steps none: resync's no_grad context alone costs ~10 us
                    g.resync(unsynced)
                continue
            g.remove()
            self.groups.remove(g)
            self.epoch += 1
            for p in g.params:
                self.where.pop(id(p), None)
            self._add_params(g.params, model_key=g.model_key, replaced=g)

    def clear(self):
        self.strategy.clear_held()
        for g in self.groups:
            g.remove()
        for rec in self.outside.values():
            rec.hook.remove()
        for h in self.unbuffered_hooks:
            h.remove()
        self.groups, self.where, self.outside, self.unbuffered, self.unbuffered_hooks = [], {}, {}, [], []
        self.unbuffered_of = {}
        self.unbuffered_pending = set()
        self.loose.clear()
        self.epoch += 1
        self._full_cache = None

    def track_outside(self, p) -> OutsideGrad:
        """The fp16 bookkeeping of `p`, a parameter outside the buffers. Created on first use,
        when the gradient it finds carries the loss scale; a hook marks each later one, so that
        each gradient is unscaled exactly once."""
        rec = self.outside.get(id(p))
        if rec is None:
            rec = self.outside[id(p)] = OutsideGrad()

            def hook(param, rec=rec):
                rec.new_gradient()

            rec.hook = p.register_post_accumulate_grad_hook(hook)
        return rec

    def split(self, params):
        """Groups touched by `params`, as {group: [indices]}, plus the params we do not manage."""
        touched, outside = {}, []
        for p in params:
            hit = self.where.get(id(p))
            if hit is None:
                outside.append(p)
            else:
                touched.setdefault(hit[0], []).append(hit[1])
        return touched, outside

    def full_groups(self, params):
        """The groups exactly covered by `params` (each param once), or None when params cover
        part of a group, repeat a param (torch would count it twice), or include a param with a
        gradient that we do not manage: then the generic torch path is used. Training loops
        pass the same parameters at every step: the answer is cached on their identities."""
        cache = self._full_cache
        if (cache is not None and cache[0] == self.epoch and len(cache[1]) == len(params)
                and all(map(operator.is_, params, cache[1]))):
            groups, outside = cache[2], cache[3]
        else:
            groups, outside = self._cover(params)
            self._full_cache = (self.epoch, tuple(params), groups, outside)
        if groups is None or any(p.grad is not None for p in outside):
            return None
        return groups

    def _cover(self, params):
        """(groups exactly covered by params or None, params we do not manage)."""
        if len({id(p) for p in params}) != len(params):
            return None, []
        touched, outside = self.split(params)
        for g, idx in touched.items():
            if len(idx) != len(g.params):
                return None, outside
        return list(touched), outside

    def ready(self, params, inv_scale: float | None = None) -> bool:
        """Brings the gradients of `params` up to date for a consumer (optimizer step,
        unscale_gradients, clip_grad_value_): groups rebuilt if needed, all-reduced on a sync
        step, assignments resynced (all three by prepare_step), and unscaled when inv_scale is
        given. Returns whether any of these params' gradients is non-finite (only checked when
        unscaling)."""
        self.prepare_step()
        touched, outside = self.split(params)
        return self.unscale(touched, outside, inv_scale) if inv_scale is not None else False

    def found_nonfinite(self, params) -> bool:
        """Whether any gradient of `params` holds NaN/Inf, checked as they are (still carrying
        the loss scale: DeepSpeed's overflow check, which unscales only the fp32 copies later),
        agreed by every process (the strategy's any_found_inf)."""
        self.prepare_step()
        touched, outside = self.split(params)
        found = False
        for g, idx in touched.items():
            found = found or bool(g.nonfinite_in(idx))
        for p in outside:
            if not found and p.grad is not None:
                found = not bool(torch.isfinite(p.grad).all())
        found = found or self.strategy.held_nonfinite(outside)
        return self.strategy.any_found_inf(found)

    def unscale(self, touched: dict, outside, inv_scale: float) -> bool:
        """Unscales what still carries the loss scale in the groups of `touched` ({group:
        indices}) and the `outside` params; returns True if any of *these params'* gradients is
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
        for p in outside:
            g = p.grad
            if g is None:
                continue
            rec = self.track_outside(p)
            if rec.carries_scale:
                if loose_kernel_ok(g):  # one C pass scales and checks (one process: every gradient)
                    rec.unscaled(bool(_C.scale_stats_(g, inv_scale)[2]))
                    increment_version(g)  # a write through DLPack, which torch cannot see
                else:
                    g.mul_(inv_scale)
                    rec.unscaled(not bool(torch.isfinite(g).all()))
            elif not rec.unscaled_in_step:
                # unscaled before the scaler's last update (another optimizer's step updated it):
                # GradScaler unscales and checks this optimizer's gradients again at its step;
                # accelerate_c does not divide twice, but checks them as they are now (a clip by
                # a NaN coefficient since, from the other optimizer's inf, skips this step too)
                rec.unscaled(not bool(torch.isfinite(g).all()))
            # as GradScaler: what unscaling found, not what a later write (a clip by value
            # clamping an inf) left
            found = found or rec.found
        # gradients the strategy holds as shards (FSDP under fp16: ShardedGradScaler's unscale)
        found = self.strategy.unscale_held(outside, inv_scale) or found
        if device_flags and not found:
            found = bool(torch.stack(device_flags).sum().item())
        return self.strategy.any_found_inf(found)

    def clip_norm_fused(self, groups, max_norm: float | None, norm_type: float, inv_scale: float | None):
        """Total norm of the gradients in `groups` (unscaling first those that still carry the
        loss scale, when inv_scale is given) and clip them to max_norm (None: the norm only), with
        torch.nn.utils.clip_grad_norm_'s formula. CPU: one read pass plus one scaling pass per
        buffer, or only the scaling pass when the strategy measured the buffer on the way and
        nothing wrote it since (one process: the hooks measured each gradient as it landed;
        DDP: each bucket after its all-reduce). Returns the norm as a 0-dim tensor of the
        gradients' dtype (on the device for CUDA groups: no host synchronisation), or None when
        the groups mix CPU and CUDA."""
        if all(g.is_cuda for g in groups) and groups:
            return self._clip_cuda(groups, max_norm, norm_type, inv_scale)
        if any(g.is_cuda for g in groups):
            return None
        # torch's clip takes each gradient's norm in the gradient's dtype: a 16-bit model's
        # per-parameter norms are rounded to 16 bits before the total (GradLayout.sums). The
        # norm alone (max_norm None: DeepSpeed's, in fp32) is the exact one
        pick = 1 if max_norm is not None else 0
        per = []
        for g in groups:
            inv = inv_scale if (inv_scale is not None and g.needs_unscale) else 1.0
            # torch unscales before it takes the per-gradient norms: a 16-bit group still
            # carrying the loss scale rounds each norm unscaled (a scaled fp16 norm past 65504
            # would be inf), so the sums measured on the way (rounded at scale 1) do not serve it
            rounds = bool(pick) and g.segs is not None
            if norm_type == 2.0:
                self.strategy.want_sumsq(g)  # from the next backward on, measured while it is hot
            usable = norm_type == 2.0 and inv <= 1.0 and not (rounds and inv != 1.0)
            cached = self.strategy.cached_sumsq(g) if usable else None
            if cached is not None:  # measured on the way (hooks, or DDP's buckets) and unchanged since
                sumsq, nonfinite, maxabs = cached[pick] * inv * inv, cached[2], 0.0
            elif norm_type == 2.0 and inv <= 1.0:
                # unscaling by <= 1 cannot overflow: the memory-bound pass suffices
                exact, rounded, nonfinite = g.sums(scale=inv)
                sumsq, maxabs = (rounded if rounds else exact * inv * inv), 0.0
            else:
                sumsq, maxabs, nonfinite = _C.stats(g.buf)
                sumsq *= inv * inv
                if norm_type == 2.0 and rounds:  # rare: a loss scale below 1
                    sumsq = g.sums(scale=inv)[1]
            found = bool(nonfinite) or maxabs * inv > FINITE_MAX[g.dtype]
            per.append((g, inv, sumsq, maxabs * inv, found))
        # the strategy adds the other processes' parts (replicated gradients: none)
        sumsq = self.strategy.total_sumsq(sum(s for _, _, s, _, _ in per))
        if norm_type == math.inf:
            total = self.strategy.total_maxabs(max((m for _, _, _, m, _ in per), default=0.0))
        else:
            total = math.sqrt(sumsq)
        if self.strategy.any_found_inf(any(f for *_, f in per)):
            # squares are >= 0: only a NaN gradient makes their sum NaN
            total = math.nan if math.isnan(sumsq) else math.inf
        # torch's formula in torch's arithmetic: the norm comes out in the gradients' dtype (fp32
        # when they mix dtypes) and the coefficient is computed in it, so a bf16 model is clipped
        # by the same rounded coefficient as torch's; non-finite norms included (an fp16 step
        # that overflowed is skipped anyway, but its gradients end as torch leaves them: x 0
        # for inf, x NaN for NaN)
        if max_norm is None:  # the norm only, in fp32 (not rounded to 16 bits: DeepSpeed's)
            return torch.tensor(total, dtype=torch.float32)
        norm, coef = clip_coef(total, max_norm, _norm_dtype(groups))
        for g, inv, _, _, found in per:
            g.scale_(inv * coef)
            if inv != 1.0:
                g.needs_unscale = False
                g.found_inf = found
                g.unscaled_in_step = True
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
            acc = per_dev[g.device_index]
            if norm_type == 2.0 and max_norm is not None and g.dtype in (torch.float16, torch.bfloat16):
                # torch's clip takes each gradient's norm in its 16-bit dtype before the total
                # (GradLayout.sums on CPU): the same per-gradient norms, from torch's own
                # multi-tensor kernel, replace the exact sum of squares
                part = g.part_dev.zero_()
                _C.cuda_stats_(g.buf, part, g.stream())
                part[0] = torch.stack(torch._foreach_norm(g.views)).float().square().sum()
                acc[0] += part[0]
                acc[1:] = torch.maximum(acc[1:], part[1:])
            else:
                _C.cuda_stats_(g.buf, acc, g.stream())
        accs = list(per_dev.values())
        acc = accs[0] if len(accs) == 1 else _combine_stats(accs)
        total = acc[1] if norm_type == math.inf else acc[0].sqrt()
        # a NaN gradient makes the sum of squares NaN (squares are >= 0, so only NaN gives NaN):
        # the norm is then NaN, as torch's; other non-finite values give inf
        bad = torch.where(torch.isnan(acc[0]), torch.full_like(total, math.nan), torch.full_like(total, math.inf))
        total = torch.where(acc[2] > 0, bad, total)
        if max_norm is None:  # the norm only, in fp32 (not rounded to 16 bits: DeepSpeed's)
            return total
        total = total.to(_norm_dtype(groups))  # torch's norm dtype
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
        touched, outside = self.split(params)
        for g, idx in touched.items():
            if len(set(idx)) == len(g.params):
                g.needs_unscale = True
                g.found_inf = False
        for p in outside:
            rec = self.outside.get(id(p))
            if rec is not None:
                rec.new_step()
        # update() ends GradScaler's per-optimizer state for every optimizer (accelerate updates
        # in each optimizer's step): no gradient's next unscale is a second one (a GAN's clip of
        # D unscales G's gradients too; G's own clip after D's step is no second unscale_)
        for g in self.groups:
            g.unscaled_in_step = False
        for rec in self.outside.values():
            rec.unscaled_in_step = False
        self.strategy.new_held_step(outside)

    def refuse_unscale_again(self, params, what: str) -> None:
        """Before a user's unscale (unscale_gradients, clip_grad_norm_, clip_grad_value_ under
        fp16): torch's GradScaler refuses a second unscale_ of an optimizer before its step
        (accelerate raises with it). Unscaling here is per gradient, so calling again over
        gradients already unscaled changes nothing and is let through; but a gradient unscaled
        earlier in this step that a backward has added to since holds an unscaled part and a
        scaled one, and unscaling it again would divide the first part twice (clip on every
        micro-batch of an accumulation window, say): refused, naming a parameter."""
        touched, outside = self.split(params)
        bad = [g.params[0] for g in touched if g.needs_unscale and g.unscaled_in_step]
        for p in outside:
            rec = self.outside.get(id(p))
            if rec is not None and p.grad is not None and rec.carries_scale and rec.unscaled_in_step:
                bad.append(p)
        bad += self.strategy.held_unscaled_again(outside)
        if bad:
            name = self.names.get(id(bad[0]), f"a parameter of shape {tuple(bad[0].shape)}")
            raise RuntimeError(
                f"{what} under fp16: the gradients (e.g. of {name}) were unscaled earlier in this step and a backward "
                "has added to them since; unscaling again would divide the earlier part twice (torch's GradScaler "
                "refuses a second unscale_() before the optimizer step, and accelerate with it). Under gradient "
                "accumulation, unscale or clip only when accelerator.sync_gradients is True")
