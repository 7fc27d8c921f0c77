"""Full sharding (ZeRO stage 3, FSDP2's semantics): parameters, gradients and optimizer state
each held 1/N per process (docs/sharding.md, "ZeRO-3 / FSDP").

Stage 2's machinery is reused whole: the gradients of each shard group are reduce-scattered by a
grad_shards.GradShard as backward delivers them (one bucket per group, so one collective per unit
and dtype), the norm is the all-reduce of the local sums, the user's optimizer is rebuilt in place
over this process's runs (strategies/zero.py). What stage 3 adds is that the parameters themselves
live as shards (fsdp_units.py): each unit is gathered by a forward pre-hook, released after its
forward (reshard_after_forward, not for the root, whose parameters the end of the forward and the
start of the backward both need), gathered again by a hook on its outputs' gradients before its
backward, and released once its gradients have landed and the gradients of its inputs exist. The
end of backward (an autograd engine callback) releases whatever is still gathered. Under mixed
precision (MixedPrecisionPolicy's param_dtype) the gathers and the compute are 16-bit, the shards
and the gradients' shards fp32, as FSDP2 keeps them.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..fsdp_units import build_units, unit_modules
from ..grad_shards import GradShard
from .replicas import broadcast_buffers, check_same_structure
from .zero import Owned
from .zero2 import Zero2Strategy

# units whose gradients' reduce-scatters may be in flight at once (each holds a staging buffer the
# size of the unit's unsharded gradient while it runs)
MAX_UNITS_IN_FLIGHT = 2


class FsdpModel:
    """A prepared model's units, with the interface strategies/zero.py reads of ModelShards:
    `gathers` (per trainable shard group: the group, its parameters, its full buffer), `owned`
    (id(param) -> Owned), `masters` (the trainable groups' fp32 shards: the masters, which
    sharded checkpoints save and reload, zero_checkpoint.py) and `views` (none)."""

    # the masters are the shards the parameters' values live in: a load of the weights fills
    # them (zero_checkpoint.plan_load needs no saved masters for them)
    masters_are_weights = True

    def __init__(self, units):
        self.units = units
        self.gathers, self.owned, self.masters, self.views = [], {}, {}, {}
        self.unit_of_group: dict = {}
        for unit in units:
            for ug in unit.groups:
                self.unit_of_group[id(ug.group)] = (unit, ug)
                if not ug.trainable:
                    continue
                self.gathers.append((ug.group, ug.params, ug.flat))
                self.masters[id(ug.group)] = ug.shard
                for p, run in zip(ug.params, ug.group.runs()):
                    self.owned[id(p)] = Owned(ug.group, *run)
        # id(param) -> (its UnitGroup, its index there), frozen parameters included
        self.where = {id(p): (ug, j) for unit in units for ug in unit.groups for j, p in enumerate(ug.params)}
        # the units in the order the last whole forward of the root ran them (the root first),
        # and the one being recorded: where prefetching looks for the unit that runs next
        self.order: list = []
        self.recording: list | None = None
        self.before: dict = {}  # id(unit) -> the unit that ran before its last run in `order`
        self.ahead: list = []  # units this forward prefetched that have not run yet

    def master(self, group):
        return self.masters[id(group)]



class _InputsDone(torch.autograd.Function):
    """Identity on a unit's inputs that need a gradient; its backward runs once their gradients
    exist, so the unit's parameters are no longer needed by this backward."""

    @staticmethod
    def forward(ctx, strategy, unit, *xs):
        ctx.strategy, ctx.unit = strategy, unit
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.strategy._inputs_done(ctx.unit)
        return (None, None) + grads


class FullShardStrategy(Zero2Strategy):
    """FSDP's FULL_SHARD (reshard_after_forward=True) and SHARD_GRAD_OP (False)."""

    stage = 3
    # free_memory() keeps the units: a model prepared again after it (find_executable_batch_size)
    # is already sharded and finds them (prepare_model). They are held weakly (self.models): the
    # model's own hooks hold its FsdpModel, so a model the loop drops goes with its units
    forgets_prepared = False

    def __init__(self, manager, handler=None, *, wrap_policy="NO_WRAP", wrap_classes=(), min_num_params=0,
                 reshard_after_forward=True, param_dtype=None, activation_checkpointing=False, device=None,
                 persist_below=0, empty_at_rest=False, ignore_unused=False, prefetch=True, sharded_weights=False):
        super().__init__(manager, handler, fp32_masters=False, ignore_unused=ignore_unused)
        self.device = torch.device("cpu") if device is None else torch.device(device)  # where the shards live
        self.wrap_policy = wrap_policy
        self.wrap_classes = tuple(wrap_classes or ())
        self.min_num_params = min_num_params
        self.reshard_after_forward = reshard_after_forward
        self.param_dtype = param_dtype  # the gathers' and the compute's dtype (None: the parameters')
        self.activation_checkpointing = activation_checkpointing
        self.persist_below = persist_below  # DeepSpeed's stage3_param_persistence_threshold (0: FSDP)
        self.empty_at_rest = empty_at_rest  # DeepSpeed's empty 16-bit parameters between steps (FSDP2: the runs)
        # launch the gather of the unit that runs next (forward order; reverse in backward) while
        # this one computes, as FSDP2 does: at most one unit gathered ahead. The order is the
        # last forward's, the same on every process when the forwards are (which gathering needs
        # anyway); a unit prefetched and then not run is released with the others
        self.prefetch = prefetch
        # checkpoints hold each process's shards of the weights (model_shards.py: FSDP's
        # SHARDED_STATE_DICT, DeepSpeed stage 3's checkpoints), not the gathered weights
        self.sharded_weights = sharded_weights
        self._final_queued = False
        self._in_flight: list = []  # GradShards whose reduce-scatters may still be running, oldest first
        self._state_dict_ok = 0  # > 0 while the strategy itself reads model.state_dict()
        # id(model) -> FsdpModel, weakly: each is held by its model's hooks (prepare_model), so it
        # lives as long as the model does, and a model dropped after free_memory() is freed
        self.models = weakref.WeakValueDictionary()

    # ---- prepare ------------------------------------------------------------------------
    def prepare_model(self, model, manager):
        if id(model) in self.models:
            return
        held = {id(p) for fsdp in self.models.values() for unit in fsdp.units for ug in unit.groups for p in ug.params}
        shared = [n for n, p in model.named_parameters() if id(p) in held]
        if shared:
            raise NotImplementedError(f"full sharding: parameters {', '.join(shared[:3])} belong to a model prepared "
                                      "before; prepare models that share parameters as one module")
        # every process starts from rank 0's weights: its buffers now, its parameters unit by
        # unit (build_units); the others may hold theirs on the meta device
        check_same_structure(model, src=0, allow_meta=True)
        _take_buffers(model, self.device, src=0)
        for name, p in model.named_parameters():
            manager.names.setdefault(id(p), name)
        modules = unit_modules(model, self.wrap_policy, self.wrap_classes, self.min_num_params)
        units = build_units(model, modules, self.world, self.rank, self.param_dtype, device=self.device, src=0,
                            persist_below=self.persist_below, empty_at_rest=self.empty_at_rest,
                            upcast=self.param_dtype is not None)
        self.models[id(model)] = fsdp = FsdpModel(units)
        self._hook_forwards(model, fsdp)
        if self.activation_checkpointing:
            for unit in units[:-1]:
                _checkpoint_forward(unit.module)
        # transformers' mark of a model FSDP manages (its is_fsdp_managed_module): generate()
        # then keeps a process whose sequences are done stepping until every process is
        # (synced_gpus), since each forward gathers units with all of them
        model._is_fsdp_managed_module = True
        model.register_state_dict_pre_hook(self._state_dict_guard)
        self._hook_full_loads(model, fsdp)

    def _hook_forwards(self, model, fsdp, wrap=None) -> None:
        """The units' forward hooks, each function passed through `wrap` when given."""
        w = wrap if wrap is not None else (lambda f: f)
        for unit in fsdp.units:
            m = unit.module
            unit.hooks.append(m.register_forward_pre_hook(w(self._pre_forward_hook(fsdp, unit)), with_kwargs=True))
            unit.hooks.append(m.register_forward_hook(w(self._post_forward_hook(fsdp, unit))))
        # a module holding root parameters run outside the model's own forward (T5's generate()
        # runs the encoder through get_encoder(), whose embedding is the shared one) gathers the
        # root first; it stays gathered until the root's next forward ends, a backward ends or a step
        root = fsdp.units[-1]
        held_by_root = {id(p) for ug in root.groups for p in ug.params}
        for m in model.modules():
            if m is model or m is root.module:
                continue
            if any(p is not None and id(p) in held_by_root for p in m._parameters.values()):
                root.hooks.append(m.register_forward_pre_hook(w(self._root_on_demand(root))))
                root.hooks.append(m.register_forward_hook(w(self._root_on_demand_backward(root))))

    def before_compile(self, model) -> None:
        """torch.compile is about to wrap `model`: its units' forward hooks are registered again,
        each under torch._dynamo.disable, so that they run as written, outside the compiled graph.
        Traced by dynamo, the `p.data` swaps of a gather and a reshard leave a parameter with a
        new gradient accumulator, not the one the compiled graph feeds (torch 2.13, with the eager
        backend too): a unit run again outside the compiled forward in the same step (an extra
        loss from a layer called directly) then had its gradient delivered twice, refused."""
        fsdp = self.models.get(id(model))
        if fsdp is None:
            return
        import torch._dynamo  # (the compile about to run imports it anyway)

        for unit in fsdp.units:
            for handle in unit.hooks:
                handle.remove()
            unit.hooks.clear()
        self._hook_forwards(model, fsdp, torch._dynamo.disable)

    def adopt_gradients(self, model, manager):
        """A GradShard per trainable group of every unit, in the compute dtype, its shard fp32."""
        fsdp = self.models[id(model)]
        for unit in fsdp.units:
            for ug in unit.groups:
                if not ug.trainable or any(id(p) in self.held for p in ug.params):
                    continue
                gs = GradShard(ug.group, ug.params, self.manager.name_of, self.find_unused, id(model),
                               dtype=ug.compute_dtype, shard_dtype=ug.shard.dtype)
                gs.on_launched = lambda done, _u=unit, _gs=gs: self._launched(_u, _gs, done)
                gs.keep_free = 0  # a unit's staging is its whole gradient: none kept between backwards
                # a process whose backward ran other units than its peers' hears of it here too
                gs.label = f"{ug.label} (every process must run the same units' forwards and backwards)"
                self.hold(gs)
        self.hook_model_zero_grad(model)

    def _full_shape(self, shards, p):
        ug, j = shards.where[id(p)]
        return torch.Size(ug.group.shapes[j])

    def _run_view(self, shards, p, o):
        """The optimizer steps the parameter's run of its unit's shard: the master itself."""
        _, ug = shards.unit_of_group[id(o.group)]
        return ug.shard.narrow(0, o.local_offset, o.length)

    # ---- the hooks ------------------------------------------------------------------------
    def _pre_forward_hook(self, fsdp, unit):
        def hook(module, args, kwargs):
            unit.gather(self.rank, self.world)
            if unit.state == "backward" or _in_backward():  # a checkpointed forward recomputed in backward:
                return None  # its graph is not backpropagated through, and the unit's own hooks did the rest
            unit.state = "forward"
            self._record_and_prefetch(fsdp, unit)
            if not torch.is_grad_enabled():
                return None
            flat, spec = tree_flatten((args, kwargs))
            at = [i for i, x in enumerate(flat) if torch.is_tensor(x) and x.requires_grad]
            if not at:
                return None
            outs = _InputsDone.apply(self, unit, *[flat[i] for i in at])
            for i, x in zip(at, outs):
                flat[i] = x
            unit.inputs_pending += 1
            return tree_unflatten(flat, spec)
        return hook

    def _post_forward_hook(self, fsdp, unit):
        def hook(module, args, output):
            if unit.state == "backward" or _in_backward():
                return None
            if unit.is_root and fsdp.recording is not None:
                _end_recording(fsdp)
                _release_ahead(fsdp)  # prefetched, then left out by this forward's path
            needs_grad = False
            if torch.is_grad_enabled():
                flat, _ = tree_flatten(output)
                for x in flat:
                    if torch.is_tensor(x) and x.requires_grad:
                        x.register_hook(self._pre_backward_hook(fsdp, unit))
                        needs_grad = True
            unit.state = "idle"
            # the root stays gathered while grad is on, even when no output tensor is visible (a
            # model returning a plain object): the end of backward or the step releases it
            if not torch.is_grad_enabled() or (not unit.is_root and (not needs_grad or self.reshard_after_forward)):
                unit.reshard(mid_step=needs_grad)  # gathered again for its backward: keep the dtype
            return None
        return hook

    def _pre_backward_hook(self, fsdp, unit):
        def hook(grad):
            if not self._final_queued:
                self._final_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward_all)
            if unit.state != "backward":
                unit.gather(self.rank, self.world)
                unit.state = "backward"
                unit.grads_done = not any(ug.trainable for ug in unit.groups)
                if self.prefetch:  # the unit whose backward comes next: the one that ran before it
                    nxt = fsdp.order[-1] if unit.is_root and len(fsdp.order) > 1 else fsdp.before.get(id(unit))
                    if nxt is not None and nxt.state == "idle" and not nxt.is_root:
                        nxt.prefetch(self.rank, self.world)
            return None
        return hook

    def _root_on_demand(self, root):
        def hook(module, args):
            if root.state == "idle":  # (a no-op when it is gathered: Unit.gather skips gathered groups)
                root.gather(self.rank, self.world)
            return None
        return hook

    def _root_on_demand_backward(self, root):
        """Outside the model's forward, with grad on: the root has no pre-backward hook there,
        and another backward's end (or a no_grad forward of the model) may release it before
        this graph's backward, so the outputs' gradients gather it again first."""
        def regather(grad):
            if not self._final_queued:
                self._final_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward_all)
            if root.state == "idle":
                root.gather(self.rank, self.world)
            return None

        def hook(module, args, output):
            if root.state != "idle" or not torch.is_grad_enabled() or _in_backward():
                return None
            flat, _ = tree_flatten(output)
            for x in flat:
                if torch.is_tensor(x) and x.requires_grad:
                    x.register_hook(regather)
            return None
        return hook

    def _record_and_prefetch(self, fsdp, unit):
        """Records the forward order (a forward of the root starts it; units run outside the
        root's forward are not recorded) and launches the gather of the unit that ran after this
        one in the last forward, when this forward has followed it so far."""
        if unit.is_root:
            fsdp.recording = [unit]
            _release_ahead(fsdp)  # left by a forward that raised before its end
        elif fsdp.recording is not None:
            fsdp.recording.append(unit)
            if unit in fsdp.ahead:
                fsdp.ahead.remove(unit)
        else:
            return
        at = len(fsdp.recording) - 1
        order = fsdp.order
        if self.prefetch and at + 1 < len(order) and order[at] is unit:
            nxt = order[at + 1]
            if nxt.state == "idle" and not nxt.is_root and not nxt.gathered:
                nxt.prefetch(self.rank, self.world)
                fsdp.ahead.append(nxt)

    def _inputs_done(self, unit):
        unit.inputs_pending = max(0, unit.inputs_pending - 1)
        self._maybe_release(unit)

    def _launched(self, unit, gs, done: bool):
        """A unit's gradients launched their reduce-scatter: at most MAX_UNITS_IN_FLIGHT units'
        staging buffers (each the unit's whole gradient) are alive at once; the oldest is waited
        for and lands in its shard."""
        if gs not in self._in_flight:
            self._in_flight.append(gs)
        while len(self._in_flight) > MAX_UNITS_IN_FLIGHT:
            oldest = self._in_flight.pop(0)
            oldest.drain()
            oldest.release_staging()
        if done:
            unit.grads_done = True
            self._maybe_release(unit)

    def _maybe_release(self, unit):
        if unit.state == "backward" and unit.grads_done and unit.inputs_pending == 0 and not unit.is_root:
            unit.reshard()
            unit.state = "idle"

    def _end_of_backward_all(self):
        """The end of a backward (an engine callback): every unit whose backward is over is
        released, the root included, as FSDP2 releases everything. A unit whose gradients or
        inputs' gradients are still to come stays gathered: this may be the end of a nested
        backward (a reentrant-checkpointed segment's) inside the one still running, whose next
        pre-backward hook queues this again; the optimizer step releases whatever is left."""
        self._final_queued = False
        self._in_flight.clear()  # each shard's own end of backward waits for what it launched
        for fsdp in self.models.values():
            for unit in fsdp.units:
                if unit.state == "backward":
                    if unit.grads_done and unit.inputs_pending == 0:
                        unit.reshard()
                        unit.state = "idle"
                elif unit.state == "idle":
                    unit.reshard()

    def _release_all(self, quiet: bool = False):
        """Every unit released; a prefetch that failed is raised (unless `quiet`) only once every
        unit is released, so none is left half-done."""
        self._final_queued = False
        error = None
        for fsdp in self.models.values():
            error = _release_model(fsdp, quiet) or error
        if error is not None:
            raise error

    def abort_held(self) -> None:
        super().abort_held()
        self._release_all(quiet=True)

    # ---- step -----------------------------------------------------------------------------
    def _gather_updated(self, book):
        """The step wrote the shards: a unit still gathered (a forward without backward) is
        stale, so every unit is released and the next forward gathers the new values."""
        self._release_all()

    def after_step(self, optimizer) -> None:
        """FSDP2: gradients stay until zero_grad, as torch's optimizers keep them. DeepSpeed's
        stage 3 (empty_at_rest): its engine clears them after every step, as at stages 1 and 2."""
        if self.empty_at_rest:
            super().after_step(optimizer)

    # ---- state dicts -----------------------------------------------------------------------
    def _state_dict_guard(self, module, prefix, keep_vars):
        if not self._state_dict_ok:
            raise RuntimeError("model.state_dict() of a model prepared with full sharding (FSDP / ZeRO stage 3): "
                               "each process holds only its shard of every parameter; use "
                               "accelerator.get_state_dict(model) for the full weights (every process calls it)")

    @contextlib.contextmanager
    def allow_state_dict(self):
        self._state_dict_ok += 1
        try:
            yield
        finally:
            self._state_dict_ok -= 1

    def full_params(self, model, keep: bool) -> dict:
        """Where `keep`: id(param) -> its full value in the shard's dtype; elsewhere {}.
        Gathered unit group by unit group (a collective every process calls): a process that
        does not keep them holds one group's full weights at a time, as FSDP2's full state dict
        with cpu_offload, which accelerate asks for."""
        fsdp = self.models[id(model)]
        out = {}
        with torch.no_grad():
            for unit in fsdp.units:
                for ug in unit.groups:
                    values = ug.gather_full(self.rank, self.world)
                    if keep:  # on the host, as accelerate's full state dict (cpu_offload): a GPU holds one group
                        out.update((id(p), v if v.is_cpu else v.cpu()) for p, v in zip(ug.params, values))
        return out

    def model_state_dict(self, model, keep: bool | None = None) -> dict:
        """The full state dict in the model's own names where `keep` (default: on the main
        process, {} on the others: accelerate's get_state_dict under FSDP2); a collective every
        process calls."""
        if id(model) not in self.models:
            return model.state_dict()
        keep = self.rank == 0 if keep is None else keep
        values = self.full_params(model, keep)
        if not keep:
            return {}
        with self.allow_state_dict():
            sd = model.state_dict(keep_vars=True)
        # on the host, as accelerate's full state dict with cpu_offload (buffers too)
        return {k: (values[id(v)] if id(v) in values else v.detach().cpu()) for k, v in sd.items()}

    def _hook_full_loads(self, model, fsdp):
        """`model.load_state_dict(full_weights)` works on the prepared model (as FSDP's full
        state-dict loading): each module's pre-hook takes its sharded parameters' entries out of
        the dict and copies this process's runs of them into the shards; the root's post-hook
        drops them from the missing keys."""
        where = fsdp.where
        taken: set = set()

        def pre_hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            with torch.no_grad():
                for name, p in module._parameters.items():
                    hit = where.get(id(p)) if p is not None else None
                    key = prefix + name
                    if hit is None or key not in state_dict:
                        continue
                    ug, j = hit
                    value = state_dict.pop(key)
                    shape = tuple(ug.group.shapes[j])
                    if tuple(value.shape) != shape:
                        error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} "
                                          f"from checkpoint, the shape in current model is {shape}.")
                        continue
                    ug.load_param(j, value)
                    taken.add(key)

        def post_hook(module, incompatible):
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in taken]
            taken.clear()
            _release_loaded(fsdp)

        for m in model.modules():
            if any(p is not None and id(p) in where for p in m._parameters.values()):
                m.register_load_state_dict_pre_hook(pre_hook)
        model.register_load_state_dict_post_hook(post_hook)

    def weight_shards(self, model):
        """What this process saves of `model` as sharded weights (model_shards.py): per unit
        group ({unit, plan, dtype, trainable, params: [{names, shape}]}, this process's shard),
        and the persistent buffers {name: tensor} (the same on every process)."""
        fsdp = self.models[id(model)]
        with self.allow_state_dict():
            sd = model.state_dict(keep_vars=True)
        names: dict = {}
        buffers = {}
        for name, v in sd.items():
            if id(v) in fsdp.where:
                names.setdefault(id(v), []).append(name)
            else:
                buffers[name] = v
        groups = []
        for unit in fsdp.units:
            for ug in unit.groups:
                info = {"unit": ug.label, "plan": ug.group.plan, "dtype": str(ug.shard.dtype).replace("torch.", ""),
                        "trainable": ug.trainable,
                        "params": [{"names": names.get(id(p)) or [self.manager.name_of(p)], "shape": list(shape)}
                                   for p, shape in zip(ug.params, ug.group.shapes)]}
                groups.append((info, ug.shard))
        return groups, buffers

    def weight_parts(self, model):
        """A sharded-weights load fills each parameter's owned run of its unit group's shard
        (this process's part only), the buffers as they are; then units gathered before the
        load are resharded (they hold the old values)."""
        fsdp = self.models.get(id(model))
        if fsdp is None:
            return super().weight_parts(model)
        with self.allow_state_dict():
            sd = model.state_dict(keep_vars=True)
        parts, buffers = {}, {}
        for name, v in sd.items():
            hit = fsdp.where.get(id(v))
            if hit is None:
                buffers[name] = v.detach()
                continue
            ug, j = hit
            part = ug.parts[j]
            parts[name] = (id(v), tuple(ug.group.shapes[j]), [] if part is None else [(part.param_offset, part.view)])

        def finish():
            _release_loaded(fsdp)
        return parts, buffers, finish

    def load_targets(self, model):
        """load_state reads the saved full weights into fresh full-size tensors (buffers into the
        model's own); applying them copies each process's runs into its shards."""
        fsdp = self.models.get(id(model))
        if fsdp is None:
            return super().load_targets(model)
        where = fsdp.where
        with self.allow_state_dict():
            sd = model.state_dict(keep_vars=True)
        targets, made = {}, {}
        for name, v in sd.items():
            hit = where.get(id(v))
            if hit is None:
                targets[name] = v.detach()
                continue
            if id(v) not in made:  # a tied parameter: one target under both names (an alias, as in the model)
                made[id(v)] = torch.empty(hit[0].group.shapes[hit[1]], dtype=hit[0].shard.dtype)
            targets[name] = made[id(v)]

        def apply():
            for name, v in sd.items():
                hit = where.get(id(v))
                if hit is not None:
                    hit[0].load_param(hit[1], targets[name])
            _release_loaded(fsdp)
        return targets, apply


def _take_buffers(model, device, src: int) -> None:
    """Every process takes rank `src`'s buffers on `device`, non-persistent ones included (a
    rotary embedding's inv_freq, which transformers leaves as a placeholder on the processes
    that load on the meta device); a buffer on the meta device is first made there."""
    made: dict = {}  # id(old buffer) -> its replacement: a buffer registered twice stays one tensor
    for module in model.modules():
        for name, b in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if b.is_meta or b.device != device:
                if id(b) not in made:
                    made[id(b)] = torch.empty_like(b, device=device) if b.is_meta else b.to(device)
                # setattr on a registered buffer replaces it and keeps its persistence
                setattr(module, name, made[id(b)])
    broadcast_buffers(model, src)


def _release_model(fsdp, quiet: bool = False):
    """Every unit of one model released, whatever its state; the first prefetch error met
    (unless `quiet`), returned once every unit is released."""
    error = None
    fsdp.recording = None
    fsdp.ahead.clear()
    for unit in fsdp.units:
        unit.state = "idle"
        unit.inputs_pending = 0
        try:
            unit.reshard(quiet)
        except RuntimeError as e:
            error = error or e
            unit.reshard(quiet=True)
    return error


def _release_loaded(fsdp) -> None:
    """After new values were loaded into the shards (between steps): every unit released,
    whatever state the last step left it in, since one still gathered holds the old values. Not
    only idle ones: a step skipped on an fp16 overflow runs no optimizer step, whose all-gather
    releases the units, so DeepSpeed's persistent parameters stayed gathered through load_state
    and the next forward computed with the values from before it."""
    error = _release_model(fsdp)
    if error is not None:
        raise error


def _release_ahead(fsdp) -> None:
    for left in fsdp.ahead:
        if left.state == "idle":
            left.reshard()
    fsdp.ahead.clear()


def _end_recording(fsdp) -> None:
    """The root's forward ended: its units' order is the one the next forward and this
    backward prefetch by (the backward runs it in reverse: before[u] comes after u)."""
    order, fsdp.recording = fsdp.recording, None
    fsdp.order = order
    fsdp.before = {}
    for k in range(1, len(order)):
        fsdp.before[id(order[k])] = order[k - 1] if k > 1 else None


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward on this thread (a forward now is an
    activation checkpoint's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _checkpoint_forward(module):
    """FSDP's activation_checkpointing: the unit's forward runs under non-reentrant
    torch.utils.checkpoint (accelerate applies it to the wrapped layers). The recomputation
    inside backward calls the forward itself, not the module, so no hook runs then: the unit was
    gathered by its pre-backward hook before any of its saved tensors is needed."""
    import functools

    from torch.utils.checkpoint import checkpoint

    if getattr(module, "_ac_checkpointed", False):
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
    module._ac_checkpointed = True
