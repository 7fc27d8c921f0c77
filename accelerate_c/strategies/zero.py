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

The trainable parameters are views of one flat buffer per shard group in the plan's layout
(ModelShards), so after each step the owned runs are all-gathered bucket by bucket in place
(collectives.gather_chunks, two buckets in flight) and every process has the whole updated model
again.

Only elementwise optimizers can be sharded this way (an update that mixes elements of a tensor,
as LBFGS's or a factored one's, would need the whole tensor): they are named in ELEMENTWISE,
and any other class is refused at prepare.
"""
from __future__ import annotations

import datetime
import math
import weakref
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import collectives
from ..shard_plan import ShardGroup, ShardLayout
from .ddp import DDPStrategy

# optimizers whose update of an element reads only that element's gradient and state (by
# class, not by guess: a subclass may override step)
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.RMSprop,
               torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)

ALIGN_BYTES = 64  # each parameter and chunk starts on a cache line


def elementwise_state(v, view) -> bool:
    """A state value with one entry per element of the run (Adam's moments), not a scalar."""
    return torch.is_tensor(v) and v.dim() == 1 and v.numel() == view.numel()


class Owned(NamedTuple):
    """What one process owns of one parameter: elements [param_offset, param_offset + length)
    of its flattened data, at [local_offset, ...) of its shard group's shard."""
    group: ShardGroup
    local_offset: int
    param_offset: int
    length: int


class ModelShards:
    """The shard layout of one prepared model (shard_plan.ShardLayout: one plan per dtype and
    device of its trainable parameters), each parameter's owned run, what each step's all-gather
    reads (per group: its parameters and its flat buffer), and the fp32 masters
    (one flat fp32 shard per 16-bit group, made when an optimizer first needs them).

    The trainable parameters become views of one flat buffer per group in the plan's full layout
    (`flats`; DeepSpeed's stage 1 and 2 flatten them the same way): bucket b's range of it is
    `world` equal chunks, of which this process's is its owned runs, so the all-gather after the
    step lands in place (no staging buffer, no copies out). The Parameter objects stay the same;
    their storage moves (a reference to a parameter's old `.data` taken before prepare goes stale)."""

    def __init__(self, model, world: int, rank: int, caps):
        first_cap, cap = caps
        seen, trainable = set(), []
        for p in model.parameters():  # tied weights are one parameter
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append(p)
        layout = ShardLayout.from_params(trainable, world, rank, first_cap_bytes=first_cap, cap_bytes=cap,
                                         align_bytes=ALIGN_BYTES)
        self.gathers = []  # per group: (group, its parameters in plan order, its flat buffer)
        self.owned: dict = {}  # id(param) -> Owned
        self.masters: dict = {}  # id(group) -> its fp32 master shard
        self.views: dict = {}  # id(group) -> the parameters' views of its flat buffer
        for group in layout:
            params = [trainable[j] for j in group.indices]
            flat = _param_buffer(group)
            views = group.param_views(flat)
            with torch.no_grad():
                for p, v in zip(params, views):
                    v.copy_(p.detach())
                    p.data = v
            self.views[id(group)] = views
            for p, run in zip(params, group.runs()):
                self.owned[id(p)] = Owned(group, *run)
            self.gathers.append((group, params, flat))

    def master(self, group) -> torch.Tensor:
        """The group's fp32 master shard, loaded from the parameters' owned runs when first made."""
        m = self.masters.get(id(group))
        if m is None:
            params = next(ps for g, ps, _ in self.gathers if g is group)
            m = self.masters[id(group)] = group.load_shard(
                params, torch.zeros(group.plan.shard_numel, dtype=torch.float32, device=group.device))
        return m


def _param_buffer(group) -> torch.Tensor:
    """A zeroed flat buffer for a shard group's parameters. On CPU processes whose collectives go
    through shared memory it lives in a shared window (collectives.shared_buffer, a collective:
    every process prepares the same models in the same order), so that the all-gather after each
    step reads the other processes' chunks where their optimizer wrote them, with no copy in
    (docs/collectives.md, "Windows")."""
    if torch.device(group.device).type == "cpu":
        shared = collectives.shared_buffer(group.plan.total, group.dtype, zero_copy_only=True)
        if shared is not None:
            return shared
    return torch.zeros(group.plan.total, dtype=group.dtype, device=group.device)


def _forget_book(books: dict, key: int, book) -> None:
    """A rebuilt optimizer was collected: its entry goes, unless its id() now names another."""
    if books.get(key) is book:
        del books[key]


class ShardedOptimizer:
    """The bookkeeping of one optimizer rebuilt over owned runs."""

    __slots__ = ("originals", "views", "listed")

    def __init__(self):
        self.originals = []  # every model parameter the user's optimizer listed, in order
        self.views = []  # (view, parameter, Owned) for the runs this process owns
        self.listed = []  # per param group, every parameter it listed at prepare (frozen ones too)


class Zero1Strategy(DDPStrategy):
    """DDP's gradient reduction with the optimizer's state sharded (ZeRO stage 1).

    fp32_masters (DeepSpeed's bf16/fp16 policy: the model is 16-bit): the optimizer steps views
    of one fp32 master shard per shard group (loaded at prepare from the 16-bit values), reading
    the 16-bit gradients widened to fp32; after the step each bucket's chunk of the master shard,
    rounded to 16 bits, is what this process sends to the all-gather that updates the model. Memory: 2Ψ parameters + 2Ψ gradients + 12Ψ/N (master and
    Adam's two moments), against DDP's 16Ψ under autocast."""

    stage = 1
    sharded_state = True  # save_state / load_state go through zero_checkpoint.py
    # free_memory() forgets the prepared models and optimizers (clear_held)
    forgets_prepared = True

    def __init__(self, manager, handler=None, fp32_masters: bool = False, ignore_unused: bool = False):
        super().__init__(manager, handler)
        # DeepSpeed's zero_optimization.ignore_unused_parameters (its default: True): a parameter
        # that gets no gradient counts as zeros, as find_unused_parameters makes DDP count it
        self.find_unused = self.find_unused or ignore_unused
        self.fp32_masters = fp32_masters
        self._next_scale = 1.0  # scale_next_step's factor
        self.models: dict = {}  # id(model) -> ModelShards
        self.optimizers: dict = {}  # id(torch optimizer) -> ShardedOptimizer
        # every optimizer rebuilt over owned runs, also those free_memory() made the strategy forget
        self.rebuilt = weakref.WeakSet()

    # ---- prepare ------------------------------------------------------------------------
    def prepare_model(self, model, manager):
        super().prepare_model(model, manager)  # rank 0's weights everywhere, forward sync
        self.models[id(model)] = ModelShards(model, self.world, self.rank, manager.bucket_caps)

    def _owned(self, p):
        """(the ModelShards that has p, p's Owned), or (None, None)."""
        for shards in self.models.values():
            o = shards.owned.get(id(p))
            if o is not None:
                return shards, o
        return None, None

    def prepare_optimizer(self, optimizer) -> None:
        """Rebuilds `optimizer` in place over the runs of its parameters this process owns."""
        if type(optimizer) not in ELEMENTWISE:
            names = ", ".join(c.__name__ for c in ELEMENTWISE)
            raise ValueError(f"ZeRO stage {self.stage} shards the optimizer's state element by element, which "
                             f"{type(optimizer).__module__}.{type(optimizer).__name__} does not allow for (only "
                             f"its own update rule knows which elements it mixes); supported: {names}")
        if id(optimizer) in self.optimizers:
            return
        if optimizer in self.rebuilt:
            raise ValueError(f"ZeRO stage {self.stage}: this {type(optimizer).__name__} was prepared before "
                             "free_memory(), which dropped it; its param_groups now list the runs of the old "
                             "shards, not the model's parameters. Create a new optimizer after free_memory() (as "
                             "accelerate's find_executable_batch_size loop does)")
        book = ShardedOptimizer()
        old_state = optimizer.state
        new_state = type(old_state)() if isinstance(old_state, dict) else {}
        for gi, group in enumerate(optimizer.param_groups):
            book.listed.append(list(group["params"]))
            kept = []
            for p in group["params"]:
                if not p.requires_grad:
                    kept.append(p)  # frozen: no gradient, no shard; the optimizer skips it as before
                    continue
                shards, o = self._owned(p)
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
                view = self._run_view(shards, p, o)
                book.views.append((view, p, o))
                kept.append(view)
                if p in old_state:
                    shape = self._full_shape(shards, p)
                    new_state[view] = {k: self._slice_state(v, shape, o, view.dtype) for k, v in old_state[p].items()}
            group["params"] = kept
        optimizer.state = new_state
        self.optimizers[id(optimizer)] = book
        self.rebuilt.add(optimizer)
        # the book holds the model's parameters: it goes with the optimizer (full sharding keeps
        # its books across free_memory(), so a dropped optimizer must not keep a dropped model)
        weakref.finalize(optimizer, _forget_book, self.optimizers, id(optimizer), book)

    def clear_held(self) -> None:
        """free_memory(): the prepared models' shards and the rebuilt optimizers are forgotten, so
        a model and optimizer the loop drops are freed with their parameter buffers (shared
        windows under the shm collectives; kept until the Accelerator went before). A model
        prepared again gets new shards (prepare_model), an optimizer prepared again is refused
        by name (prepare_optimizer)."""
        super().clear_held()
        if self.forgets_prepared:
            self.models, self.optimizers = {}, {}

    def _run_view(self, shards, p, o):
        """The 1-D tensor the rebuilt optimizer steps for the run `o` of `p`."""
        if self.fp32_masters and p.dtype != torch.float32:  # its run of the group's fp32 master
            return shards.master(o.group).narrow(0, o.local_offset, o.length)
        # the parameter's own memory: the update writes the model directly
        return p.detach().view(-1).narrow(0, o.param_offset, o.length)

    def _full_shape(self, shards, p):
        """p's whole shape (full sharding overrides: there p.shape is its owned run's between steps)."""
        return p.shape

    @staticmethod
    def _slice_state(v, shape, o, dtype):
        if torch.is_tensor(v) and v.shape == shape:
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
            g = self._grad_of(p, o)
            if g is not None:
                if g.dtype != view.dtype:  # a master: the 16-bit gradient widened (a transient copy)
                    g = g.to(view.dtype)
                    if factor != 1.0:
                        g.mul_(factor)
            view.grad = g
        try:
            out = super().optimizer_step(optimizer, closure)
        finally:
            for view, _, _ in book.views:
                view.grad = None  # the gradient views must not outlive the step (zero_grad swaps .grad)
        self._gather_updated(book)  # a master reaches its parameter through the all-gather
        return out

    def _grad_of(self, p, o):
        """The gradient of the run `o` of `p` the optimizer reads (1-D), or None."""
        g = p.grad
        return None if g is None else g.detach().reshape(-1).narrow(0, o.param_offset, o.length)

    def after_step(self, optimizer) -> None:
        """DeepSpeed's engine clears the gradients after every step, skipped or not, at every
        stage (a loop without zero_grad trains the same): what zero_grad would clear."""
        self.after_zero_grad(optimizer, True)

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
        """Every process gets every updated run: each shard group of the models this optimizer
        updates is all-gathered in place (_gather_group)."""
        # decided from the optimizer's full parameter list, the same on every process (what
        # this process owns is not: it may own nothing of a group)
        wanted = {id(p) for p in book.originals}
        for shards in self.models.values():
            for group, params, flat in shards.gathers:
                if any(id(p) in wanted for p in params):
                    self._gather_group(group, params, flat, shards.views[id(group)], shards.masters.get(id(group)))

    def _gather_group(self, group, params, flat, views, master):
        """Bucket by bucket, this process's chunk of the group's flat buffer (its master shard's
        chunk rounded to 16 bits, or already the updated parameters' owned runs) all-gathered in
        place (two buckets in flight)."""
        world, rank = self.world, self.rank
        for p, v in zip(params, views):
            # a parameter whose storage was replaced after prepare (model.to(), p.data = ...) would
            # silently stop receiving the updates
            if p.data_ptr() != v.data_ptr() or p.dtype != v.dtype:
                raise RuntimeError(f"ZeRO stage {self.stage}: parameter {self.manager.name_of(p)} no longer views the "
                                   "flat buffer prepare() laid it in (its storage was replaced: model.to(), .data = "
                                   "..., load_state_dict(assign=True)); do that before prepare()")
        inflight = []
        with torch.no_grad():
            for start, chunk, local, _, _ in group.buckets:
                if chunk == 0:
                    continue
                if len(inflight) == 2:
                    inflight.pop(0).wait()
                full = flat[start:start + chunk * world]
                if master is not None:  # one contiguous rounding copy (the padding is zeros)
                    full[rank * chunk:(rank + 1) * chunk].copy_(master[local:local + chunk])
                inflight.append(collectives.gather_chunks(full, rank, world, async_op=True))
            while inflight:
                inflight.pop(0).wait()

    # ---- the whole optimizer state --------------------------------------------------------
    def optimizer_groups(self, book):
        """The shard groups an optimizer steps, in an order every process agrees on: (id of the
        model, group, its parameters in plan order, the model's ModelShards)."""
        wanted = {id(p) for p in book.originals}
        out = []
        for key, shards in self.models.items():
            for group, params, _ in shards.gathers:
                if any(id(p) in wanted for p in params):
                    out.append((key, group, params, shards))
        return out

    def full_optimizer_state_dict(self, optimizer, timeout_s: float = 60.0) -> dict:
        """`optimizer.state_dict()` as the unsharded optimizer would give it (torch's layout:
        per-parameter state, parameters numbered across param_groups in order), gathered from
        every process's shard: a collective every process must call. A process that calls it
        alone gets an error naming the processes that did not, after `timeout_s`, not a hang."""
        book = self.optimizers.get(id(optimizer))
        if book is None:
            return optimizer.state_dict()
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            raise RuntimeError(f"full_optimizer_state_dict is a collective: every process must call it; not every "
                               f"one did within {timeout_s:g} s ({e})") from None
        by_param = {id(p): (view, o) for view, p, o in book.views}
        # scalars and the keys each process's runs hold, from every process (small)
        mine = {}
        for view, p, o in book.views:
            st = optimizer.state.get(view, {})
            mine[id(p)] = ({k for k, v in st.items() if elementwise_state(v, view)},
                           {k: v for k, v in st.items() if not elementwise_state(v, view)})
        numbered = [p for ps in book.listed for p in ps]
        index = {id(p): k for k, p in enumerate(numbered)}
        local = [(index[pid], sorted(keys), other) for pid, (keys, other) in mine.items()]
        everyone = [None] * self.world
        dist.all_gather_object(everyone, local)
        keys_of, other_of = {}, {}
        for rows in everyone:
            for k, keys, other in rows:
                keys_of.setdefault(k, set()).update(keys)
                other_of.setdefault(k, other)
        state = {}
        for _, group, params, _ in self.optimizer_groups(book):
            n = group.plan.shard_numel
            keys = sorted({kk for p in params if id(p) in index for kk in keys_of.get(index[id(p)], ())})
            for key in keys:
                dtype = next(optimizer.state[v][key].dtype for v, p, _ in book.views
                             if id(p) in {id(q) for q in params} and key in optimizer.state.get(v, {}))
                flat = torch.zeros(n, dtype=dtype, device=group.device)
                for p in params:
                    hit = by_param.get(id(p))
                    if hit is not None and key in optimizer.state.get(hit[0], {}):
                        flat[hit[1].local_offset:hit[1].local_offset + hit[1].length].copy_(optimizer.state[hit[0]][key])
                full = torch.empty(n * self.world, dtype=dtype, device=group.device)
                collectives.all_gather_into_tensor(full, flat)
                for j, p in enumerate(params):
                    k = index.get(id(p))
                    if k is None or key not in keys_of.get(k, ()):
                        continue
                    t = torch.empty(math.prod(group.shapes[j]), dtype=dtype, device=group.device)
                    for q in range(self.world):
                        l_off, p_off, length = group.plan.param_shard(j, q)
                        if length:
                            t[p_off:p_off + length].copy_(full[q * n + l_off:q * n + l_off + length])
                    state.setdefault(k, dict(other_of.get(k, {})))[key] = t.view(group.shapes[j])
        for k, other in other_of.items():
            state.setdefault(k, dict(other))
        groups = []
        start = 0
        for pg, listed in zip(optimizer.param_groups, book.listed):
            groups.append({**{kk: v for kk, v in pg.items() if kk != "params"},
                           "params": list(range(start, start + len(listed)))})
            start += len(listed)
        return {"state": {k: state[k] for k in sorted(state)}, "param_groups": groups}

    # ---- what is not built yet under sharding --------------------------------------------
    def start_join(self, model, manager):
        # the processes that ran out of data would skip the optimizer steps, and with them the
        # all-gather of the updated runs the others wait in
        raise NotImplementedError(f"join_uneven_inputs() under ZeRO stage {self.stage}: every process must take part "
                                  "in every optimizer step's all-gather; use even batches (the default)")

