"""ZeRO stage 1: the optimizer's state sharded across processes, beside DDP (docs/sharding.md).

Gradients are reduced as DDPStrategy reduces them (all-reduced bucket by bucket while backward
runs, so every process holds the averaged gradients); what is sharded is the optimizer. Each
prepared model's trainable parameters get one shard plan per dtype (csrc/core/shard.c,
_C.ShardPlan: buckets in reverse registration order, each split into `world` equal chunks), and
every process owns, of each parameter, the run the plan gives it (possibly nothing). The user's
optimizer is rebuilt in place over those runs: each parameter in its param_groups is replaced by
a 1-D view of the part of it this process owns, so the same object keeps stepping with the same
hyperparameters and param_groups dicts (a scheduler built before prepare keeps working), and its
per-parameter state (Adam's moments) exists for the owned part only. Without mixed precision the
views are the parameters' own memory: the update writes the model directly, no master copy.

After each step the owned runs are all-gathered bucket by bucket (all_gather_into_tensor over a
bucket's chunks, two buckets in flight), so every process has the whole updated model again.

Only elementwise optimizers can be sharded this way (an update that mixes elements of a tensor,
as LBFGS's or a factored one's, would need the whole tensor): they are named in ELEMENTWISE,
and any other class is refused at prepare.
"""
from __future__ import annotations

import torch

from .. import _C
from .. import collectives
from .ddp import DDPStrategy

# optimizers whose update of an element reads only that element's gradient and state (by
# class, not by guess: a subclass may override step)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)

ALIGN_BYTES = 64  # each parameter and chunk starts on a cache line


class Owned:
    """What one process owns of one parameter: elements [param_offset, param_offset + length)
    of its flattened data, at [local_offset, ...) of the process's shard of `plan`."""

    __slots__ = ("plan", "index", "local_offset", "param_offset", "length")

    def __init__(self, plan, index, local_offset, param_offset, length):
        self.plan, self.index = plan, index
        self.local_offset, self.param_offset, self.length = local_offset, param_offset, length


class ModelShards:
    """The shard plans of one prepared model: one per dtype of its trainable parameters."""

    def __init__(self, model, world: int, rank: int, caps):
        first_cap, cap = caps
        seen, by_dtype = set(), {}
        for p in model.parameters():  # tied weights are one parameter
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                by_dtype.setdefault(p.dtype, []).append(p)
        self.gathers = []  # per plan: (its parameters, _gather_buckets)
        self.owned: dict = {}  # id(param) -> Owned
        for dtype, params in by_dtype.items():
            esize = params[0].element_size()
            plan = _C.ShardPlan(numel=[p.numel() for p in params], esize=esize, world=world,
                                align=max(1, ALIGN_BYTES // esize), first_cap_bytes=first_cap, cap_bytes=cap,
                                order=list(range(len(params) - 1, -1, -1)))
            for i, p in enumerate(params):
                self.owned[id(p)] = Owned(plan, i, *plan.param_shard(i, rank))
            self.gathers.append((params, _gather_buckets(plan, params, rank)))


def _gather_buckets(plan, params, rank: int) -> list:
    """What each step's all-gather of `plan` needs, read from the plan once at prepare: per
    bucket with elements, (its offset in the full buffer, its chunk, and per parameter the
    parameter, its full offset and numel, and its owned run relative to this rank's chunk)."""
    order = plan.order
    out = []
    for b_off, chunk, local, first, count in plan.buckets():
        if chunk == 0:
            continue
        members = []
        for k in range(first, first + count):
            i = order[k]
            _, off, n = plan.param(i)
            l_off, p_off, length = plan.param_shard(i, rank)
            members.append((params[i], off - b_off, n, l_off - local, p_off, length))
        out.append((b_off, chunk, members))
    return out


class ShardedOptimizer:
    """The bookkeeping of one optimizer rebuilt over owned runs."""

    __slots__ = ("originals", "views")

    def __init__(self):
        self.originals = []  # every model parameter the user's optimizer listed, in order
        self.views = []  # (view, parameter, Owned) for the runs this process owns


class Zero1Strategy(DDPStrategy):
    """DDP's gradient reduction with the optimizer's state sharded (ZeRO stage 1).

    fp32_masters (DeepSpeed's bf16/fp16 policy: the model is 16-bit): the optimizer steps fp32
    copies of the owned runs (created at prepare from the 16-bit values), reading the 16-bit
    gradients widened to fp32; after the step the masters are rounded into the 16-bit owned runs,
    which are then all-gathered. Memory: 2Ψ parameters + 2Ψ gradients + 12Ψ/N (master and
    Adam's two moments), against DDP's 16Ψ under autocast."""

    stage = 1

    def __init__(self, manager, handler=None, fp32_masters: bool = False):
        super().__init__(manager, handler)
        self.fp32_masters = fp32_masters
        self._next_scale = 1.0  # scale_next_step's factor
        self.models: dict = {}  # id(model) -> ModelShards
        self.optimizers: dict = {}  # id(torch optimizer) -> ShardedOptimizer
        self._staging: dict = {}  # (dtype, device) -> [two (chunk, full) buffer pairs]

    # ---- prepare ------------------------------------------------------------------------
    def prepare_model(self, model, manager):
        super().prepare_model(model, manager)  # rank 0's weights everywhere, forward sync
        self.models[id(model)] = ModelShards(model, self.world, self.rank, manager.bucket_caps)

    def _owned(self, p):
        for shards in self.models.values():
            o = shards.owned.get(id(p))
            if o is not None:
                return o
        return None

    def prepare_optimizer(self, optimizer) -> None:
        """Rebuilds `optimizer` in place over the runs of its parameters this process owns."""
        if type(optimizer) not in ELEMENTWISE:
            names = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise ValueError(f"ZeRO stage {self.stage} shards the optimizer's state element by element, which "
                             f"{type(optimizer).__module__}.{type(optimizer).__name__} does not allow for (only "
                             f"its own update rule knows which elements it mixes); supported: {names}")
        if id(optimizer) in self.optimizers:
            return
        book = ShardedOptimizer()
        old_state = optimizer.state
        new_state = type(old_state)() if isinstance(old_state, dict) else {}
        for gi, group in enumerate(optimizer.param_groups):
            kept = []
            for p in group["params"]:
                if not p.requires_grad:
                    kept.append(p)  # frozen: no gradient, no shard; the optimizer skips it as before
                    continue
                o = self._owned(p)
                if o is None:
                    raise ValueError(f"ZeRO stage {self.stage}: parameter {self.manager.name_of(p)} "
                                     f"(param_groups[{gi}]) is not a trainable parameter of a prepared model; "
                                     "prepare the model with the optimizer, before or in the same prepare() call")
                if p.layout != torch.strided or not p.is_contiguous():
                    raise ValueError(f"ZeRO stage {self.stage}: parameter {self.manager.name_of(p)} is not a "
                                     "contiguous dense tensor, so its owned run is not a view of it")
                book.originals.append(p)
                if o.length == 0:
                    continue  # another process owns all of it
                view = p.detach().view(-1).narrow(0, o.param_offset, o.length)
                if self.fp32_masters and p.dtype != torch.float32:
                    view = view.float()  # the master: a copy, stepped in fp32
                book.views.append((view, p, o))
                kept.append(view)
                if p in old_state:
                    new_state[view] = {k: self._slice_state(v, p, o, view.dtype) for k, v in old_state[p].items()}
            group["params"] = kept
        optimizer.state = new_state
        self.optimizers[id(optimizer)] = book

    @staticmethod
    def _slice_state(v, p, o, dtype):
        if torch.is_tensor(v) and v.shape == p.shape:
            return v.detach().reshape(-1).narrow(0, o.param_offset, o.length).to(dtype, copy=True)
        return v

    def model_params(self, optimizer) -> list:
        book = self.optimizers.get(id(optimizer))
        if book is None:
            return super().model_params(optimizer)
        # plus what param_groups gained after prepare (add_param_group: not sharded, stepped
        # whole on every process, as replicated parameters are)
        views = {id(v) for v, _, _ in book.views}
        known = {id(p) for p in book.originals}
        extra = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in views and id(p) not in known]
        if self.fp32_masters and any(p.requires_grad and p.dtype != torch.float32 for p in extra):
            # they have no fp32 master: stepped as they are, in 16 bits on gradients that still
            # carry the loss scale (DeepSpeed's engine never updates such parameters either)
            names = ", ".join(self.manager.name_of(p) for p in extra[:3])
            raise NotImplementedError(f"ZeRO stage {self.stage} with a 16-bit model: parameters added to the "
                                      f"optimizer after prepare ({names}) have no fp32 master weights; put every "
                                      "parameter in the optimizer before prepare()")
        return book.originals + extra

    # ---- step ---------------------------------------------------------------------------
    def scale_next_step(self, factor: float) -> None:
        """The next optimizer_step multiplies the gradients the masters read by `factor` (the
        engine's clip under the 16-bit policy, applied to the fp32 copies as DeepSpeed does)."""
        if not self.fp32_masters:
            raise RuntimeError("scale_next_step is for fp32 masters of a 16-bit model")
        self._next_scale = factor

    def optimizer_step(self, optimizer, closure=None):
        book = self.optimizers.get(id(optimizer))
        if book is None:
            return super().optimizer_step(optimizer, closure)
        factor, self._next_scale = self._next_scale, 1.0
        for view, p, o in book.views:
            g = p.grad
            if g is not None:
                g = g.detach().reshape(-1).narrow(0, o.param_offset, o.length)
                if g.dtype != view.dtype:  # a master: the 16-bit gradient widened (a transient copy)
                    g = g.to(view.dtype)
                    if factor != 1.0:
                        g.mul_(factor)
            view.grad = g
        try:
            out = optimizer.step(closure) if closure is not None else optimizer.step()
        finally:
            for view, _, _ in book.views:
                view.grad = None  # the gradient views must not outlive the step (zero_grad swaps .grad)
        with torch.no_grad():
            for view, p, o in book.views:
                if view.dtype != p.dtype:  # the updated master, rounded into the model's owned run
                    p.view(-1).narrow(0, o.param_offset, o.length).copy_(view)
        self._gather_updated(book)
        return out

    def after_zero_grad(self, optimizer, set_to_none: bool) -> None:
        """The rebuilt optimizer only knows the owned views: do to the model's gradients what its
        zero_grad would have done to them."""
        book = self.optimizers.get(id(optimizer))
        if book is None:
            return
        for p in book.originals:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def _gather_updated(self, book):
        """Every process gets every updated run: per plan of the models this optimizer updates,
        bucket by bucket, each bucket's owned runs copied into a chunk, all-gathered into the
        bucket's full layout and copied out into the parameters (two buckets in flight)."""
        # decided from the optimizer's full parameter list, the same on every process (what
        # this process owns is not: it may own nothing of a plan)
        wanted = {id(p) for p in book.originals}
        for shards in self.models.values():
            for params, buckets in shards.gathers:
                if any(id(p) in wanted for p in params):
                    self._gather_plan(params[0].dtype, params[0].device, buckets)

    def _pair(self, dtype, device, slot, chunk, full):
        key = (dtype, device)
        pairs = self._staging.setdefault(key, [None, None])
        pair = pairs[slot]
        if pair is None or pair[0].numel() < chunk:
            pair = pairs[slot] = (torch.zeros(chunk, dtype=dtype, device=device),
                                  torch.empty(full, dtype=dtype, device=device))
        return pair[0][:chunk], pair[1][:full]

    def _gather_plan(self, dtype, device, buckets):
        world = self.world
        inflight = []

        def finish(item):
            work, full, members = item
            work.wait()
            for p, off, n, _, _, _ in members:
                p.view(-1).copy_(full[off:off + n])

        with torch.no_grad():
            for b, (_, chunk, members) in enumerate(buckets):
                if len(inflight) == 2:
                    finish(inflight.pop(0))
                inp, full = self._pair(dtype, device, b % 2, chunk, chunk * world)
                for p, _, _, rel, p_off, length in members:
                    if length:
                        inp[rel:rel + length].copy_(p.view(-1)[p_off:p_off + length])
                work = collectives.all_gather_into_tensor(full, inp, async_op=True)
                inflight.append((work, full, members))
            while inflight:
                finish(inflight.pop(0))

    # ---- what is not built yet under sharding --------------------------------------------
    def start_join(self, model, manager):
        # the processes that ran out of data would skip the optimizer steps, and with them the
        # all-gather of the updated runs the others wait in
        raise NotImplementedError(f"join_uneven_inputs() under ZeRO stage {self.stage}: every process must take part "
                                  "in every optimizer step's all-gather; use even batches (the default)")

    def refuse_checkpoint(self, doing: str) -> None:
        raise NotImplementedError(f"{doing} under ZeRO stage {self.stage}: each process holds only its shard of "
                                  "the optimizer's state, and sharded checkpoints are not built yet (saving the "
                                  "main process's shard alone would lose the others')")
