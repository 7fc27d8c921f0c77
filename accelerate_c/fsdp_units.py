"""Full sharding's units (docs/sharding.md, "ZeRO-3 / FSDP"): which modules are units (the wrap
policy), which parameters each holds, and how a unit's parameters move between their shard and
their full size.

A unit is a module the wrap policy picked (plus the root: the prepared model itself, holding
every parameter no picked module holds). Each unit's parameters are split by (dtype, trainable)
into shard groups (shard_plan.ShardGroup: one C plan each, one bucket per group, so a unit's
gather and its gradients' reduce-scatter are one collective per group). Outside forward and
backward a parameter's `.data` is its owned run of the group's persistent shard (1-D, possibly
empty): the process holds 1/N of the model and the Parameter objects stay the model's own.
`gather` fills a full-size flat buffer (in the compute dtype) with every process's chunk and
points each parameter at its view of it; `reshard` points them back at their runs and releases
the flat buffer's memory (its storage resized to zero bytes). Autograd's saved tensors keep
working across a reshard: a saved view of a parameter references the flat buffer's storage,
which is refilled in place before the unit's backward, and a saved parameter is the Parameter
itself, whose `.data` points at the full view again by then (assigning `.data` leaves the
parameter's version counter alone, and the collective writes bypass autograd).

This module makes the collective calls of a gather (collectives.gather_chunks) and nothing
else; the hooks that decide when to gather and reshard are the strategy's (strategies/fsdp.py).
"""
from __future__ import annotations

import torch

from . import collectives
from .shard_plan import ShardLayout
from .utils.other import is_compiled_module

ONE_BUCKET = 1 << 62  # a cap no unit reaches: each group is one bucket, one collective
ALIGN = 16  # elements: the same offsets in the fp32 shard and the 16-bit compute buffer


def unit_modules(model: torch.nn.Module, policy: str, class_names=(), min_num_params: int = 0) -> list:
    """The modules the wrap policy makes units, children before parents, the root (`model`)
    last. TRANSFORMER_BASED_WRAP: every module whose class name is in `class_names` (default:
    the model's `_no_split_modules`, as accelerate); SIZE_BASED_WRAP: every module holding more
    than `min_num_params` parameters (counted with its children, as accelerate's FSDP2 policy
    counts); NO_WRAP: the root only. A model torch.compile wrapped (compiled by the user before
    prepare()) is taken as the module inside: the wrapper holds no parameter of its own and its
    module is the root, as when prepare() compiles (else a size-based policy made the inner
    module a unit under an empty root, and a layer called outside the forward found its
    parameters still sharded)."""
    if is_compiled_module(model):
        return unit_modules(model._orig_mod, policy, class_names, min_num_params)
    if policy in (None, "NO_WRAP"):
        return [model]
    order = _bottom_up(model)[:-1]
    if policy == "TRANSFORMER_BASED_WRAP":
        names = list(class_names) if class_names else list(getattr(model, "_no_split_modules", None) or [])
        present = {type(m).__name__ for m in model.modules()}
        missing = [n for n in names if n not in present]
        if missing:
            raise ValueError(f"fsdp_transformer_layer_cls_to_wrap: no module of class {missing[0]!r} in "
                             f"{type(model).__name__} (classes present: {', '.join(sorted(present))})")
        picked = [m for m in order if type(m).__name__ in set(names)]
    elif policy == "SIZE_BASED_WRAP":
        picked = [m for m in order if sum(p.numel() for p in m.parameters()) > min_num_params]
    else:
        raise ValueError(f"fsdp_auto_wrap_policy={policy!r}: expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or "
                         "NO_WRAP")
    return picked + [model]


def _bottom_up(model):
    out = []

    def visit(m):
        for c in m.children():
            visit(c)
        out.append(m)

    visit(model)
    seen, unique = set(), []
    for m in out:  # a module reachable twice is one module
        if id(m) not in seen:
            seen.add(id(m))
            unique.append(m)
    return unique


def assign_params(units: list) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Per unit (same order), the (name, parameter) pairs it holds: the innermost unit that
    reaches a parameter holds it, and a parameter reached from two units that do not nest (a
    tied weight) goes to the root, which stays gathered through forward and backward."""
    root = units[-1]
    names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    owner: dict = {}
    for k, m in enumerate(units):
        inner = set()
        for j in range(k):  # units inside m hold their own
            if any(u is units[j] for u in m.modules()):
                inner.update(id(p) for p in units[j].parameters())
        for p in m.parameters():
            if id(p) in inner:
                continue
            prev = owner.get(id(p))
            if prev is None:
                owner[id(p)] = k
            elif prev != k:
                owner[id(p)] = len(units) - 1
    out = [[] for _ in units]
    for p in root.parameters():
        out[owner[id(p)]].append((names[id(p)], p))
    return out


class UnitGroup:
    """One (dtype, trainable) group of a unit: its plan (shard_plan.ShardGroup), its persistent
    shard (the parameters' dtype), each parameter's owned run of it, and the full-size flat
    buffer in the compute dtype whose memory exists only while the unit is gathered."""

    def __init__(self, group, params, compute_dtype, label: str = "unit", values=None, empty_at_rest: bool = False):
        self.label = label  # the unit's module, for errors: "unit 'layers.3' (LlamaDecoderLayer)"
        self.group = group
        self.params = params  # in plan parameter order
        self.trainable = params[0].requires_grad
        # this rank's runs of the parameters' values (default: as prepare found them)
        self.shard = group.load_shard(params if values is None else values)
        self.compute_dtype = compute_dtype if compute_dtype is not None else group.dtype
        # made once, outside any inference_mode() a forward may run in (an inference tensor
        # cannot take part in autograd later); its storage is resized, never replaced
        self.flat = torch.empty(group.plan.total, dtype=self.compute_dtype, device=group.device)
        self.full_views = group.param_views(self.flat)
        self.parts = group.owned_views(self.shard)  # per parameter: its OwnedPart of the shard, or None
        if empty_at_rest:
            # DeepSpeed stage 3's parameter between steps: an empty tensor of the model's
            # (compute) dtype, as its partitioned parameters are (code that reads p.dtype in a
            # parent's forward sees the 16-bit model); the values live in the shard
            self.runs = [torch.empty(0, dtype=self.compute_dtype, device=group.device) for _ in params]
        else:  # FSDP2's: the parameter's owned run of the shard
            self.runs = [part.view if part is not None else self.shard[:0] for part in self.parts]
        self.nbytes = self.flat.untyped_storage().nbytes()
        self.gathered = True  # as made: the storage exists (released by the first reshard)
        self.pending = None  # a prefetched gather's works, until finish()

    def load_param(self, j: int, full: torch.Tensor) -> None:
        """This process's run of parameter j from a full-size tensor of it (a loaded weight)."""
        part = self.parts[j]
        if part is not None:
            with torch.no_grad():
                part.view.copy_(full.detach().reshape(-1)[part.param_offset:part.param_offset + part.view.numel()])

    def point_at_runs(self):
        for p, run in zip(self.params, self.runs):
            p.data = run

    def gather(self, rank: int, world: int, async_op: bool = False) -> None:
        """Every process's chunk into the flat buffer; the parameters viewing it. A collective.
        With `async_op` it is only launched (a prefetch): the parameters keep viewing their runs
        until `finish()`, which the next plain gather (the unit's own hook) calls."""
        if self.pending is not None:
            if not async_op:
                self.finish()
            return
        storage = self.flat.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        works = []
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat):
            for start, chunk, local, _, _ in self.group.buckets:
                if chunk == 0:
                    continue
                full = self.flat[start:start + chunk * world]
                # the chunk as this rank owns it, cast once to the compute dtype (its padding is zeros)
                full[rank * chunk:(rank + 1) * chunk].copy_(self.shard[local:local + chunk])
                works.append(self._collective(full, rank, world, "gather of the parameters", async_op))
        self.gathered = True
        if async_op:
            self.pending = [w for w in works if w is not None]
        else:
            self._point_at_full()

    def finish(self) -> None:
        """Waits for a prefetched gather; the parameters then view the full buffer."""
        works, self.pending = self.pending, None
        try:
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise RuntimeError(f"{self.label}: the prefetched gather of the parameters failed or timed out; every "
                               f"process must run the same units' forwards ({e})") from e
        self._point_at_full()

    def _point_at_full(self):
        for p, v in zip(self.params, self.full_views):
            p.data = v

    def gather_full(self, rank: int, world: int) -> list:
        """Every parameter's full value in the shard's dtype, in fresh tensors (the state dict's
        values: fp32 masters, not the 16-bit compute copies). A collective; the unit's own
        buffers and parameters are left as they are."""
        full = torch.zeros(self.group.plan.total, dtype=self.shard.dtype, device=self.shard.device)
        for start, chunk, local, _, _ in self.group.buckets:
            if chunk:
                part = full[start:start + chunk * world]
                part[rank * chunk:(rank + 1) * chunk].copy_(self.shard[local:local + chunk])
                self._collective(part, rank, world, "gather of the full weights (get_state_dict)")
        return self.group.param_views(full)

    def _collective(self, full, rank, world, what, async_op=False):
        """One in-place all-gather; a failure (a process that never joined it: a collective called
        on one process only, a forward skipped on one) names the unit."""
        try:
            return collectives.gather_chunks(full, rank, world, async_op=async_op)
        except RuntimeError as e:
            raise RuntimeError(f"rank {rank}: full sharding, {self.label}: the {what} failed or timed out; every "
                               f"process must run the same units' forwards and call get_state_dict / save_model "
                               f"together ({e})") from e

    def reshard(self, quiet: bool = False, mid_step: bool = False) -> None:
        """Back to the runs; the flat buffer's memory released. A prefetch still in flight is
        waited for first (the collective writes into that memory); `quiet` (an abort) drops its
        error, which the failing call already raised. `mid_step` (after a forward whose backward
        will gather the unit again): the parameters view an empty tensor of the compute dtype
        instead, since torch drops a parameter's gradient accumulator when `p.data` changes
        dtype, and a unit run twice before one backward would then get two (its gradient
        delivered twice); the runs come back when the backward or the step releases the unit."""
        if self.pending is not None:
            try:
                self.finish()
            except RuntimeError:
                if not quiet:
                    raise
        if mid_step and self.compute_dtype != self.shard.dtype:
            empty = self.flat[:0]
            for p in self.params:
                p.data = empty
        else:
            self.point_at_runs()
        self.flat.untyped_storage().resize_(0)
        self.gathered = False


class Unit:
    """A unit: its module, its groups, and where it is in a training step."""

    __slots__ = ("module", "groups", "index", "is_root", "state", "grads_done", "inputs_pending", "hooks")

    def __init__(self, module, index: int, is_root: bool):
        self.module = module
        self.groups: list[UnitGroup] = []
        self.index = index
        self.is_root = is_root
        self.state = "idle"  # idle | forward | backward
        self.grads_done = True  # the trainable groups' gradients all landed in this backward
        self.inputs_pending = 0  # forwards whose inputs' gradients backward has not computed yet
        self.hooks = []

    @property
    def gathered(self) -> bool:
        return any(g.gathered for g in self.groups)

    def gather(self, rank, world):
        for g in self.groups:
            if not g.gathered or g.pending is not None:
                g.gather(rank, world)

    def prefetch(self, rank, world):
        """Launches the gather of a unit that will run next; its own hook finishes it."""
        for g in self.groups:
            if not g.gathered:
                g.gather(rank, world, async_op=True)

    def reshard(self, quiet: bool = False, mid_step: bool = False):
        for g in self.groups:
            if g.gathered:
                g.reshard(quiet, mid_step)


def build_units(model, modules, world: int, rank: int, compute_dtype=None, device=None, src=None,
                persist_below: int = 0, empty_at_rest: bool = False, upcast: bool = False) -> list[Unit]:
    """The units of `model` (modules from unit_modules), each parameter moved into its shard on
    `device` (default: where it is). With `src`, every process takes rank src's values (a
    collective): one broadcast per unit group, each unit resharded as soon as it is built, so a
    process whose model is on the meta device (cpu_ram_efficient_loading) holds one unit's
    weights at a time: while it is built, three buffers of its size (its parameters' storage,
    the broadcast buffer, the gathered flat buffer; fewer is future work). Parameters of
    at most `persist_below` elements go to the root unit, gathered through the whole forward
    and backward (DeepSpeed's persistent parameters). With `upcast`, trainable 16-bit parameters
    become fp32 masters unit by unit (the fp32 copy of one unit at a time, never the model's)."""
    held = assign_params(modules)
    if persist_below > 0:
        for k in range(len(held) - 1):
            # DeepSpeed's rule: a parameter of at most the threshold's elements persists
            held[-1].extend(x for x in held[k] if x[1].numel() <= persist_below)
            held[k] = [x for x in held[k] if x[1].numel() > persist_below]
    module_names = {id(m): n for n, m in model.named_modules()}
    units = []
    for k, (m, named) in enumerate(zip(modules, held)):
        label = f"unit {module_names.get(id(m)) or '<root>'!r} ({type(m).__name__})"
        unit = Unit(m, k, is_root=k == len(modules) - 1)
        params = [p for _, p in named]
        if device is not None:
            _place(params, device, keep_values=src is None or rank == src)
        if upcast:  # fp32 masters of 16-bit parameters, as accelerate's FSDP2 path
            for p in params:
                if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                    p.data = p.data.float()
        for trainable in (True, False):
            subset = [p for p in params if p.requires_grad == trainable]
            if not subset:
                continue
            # forward order (the plan's default is reverse): the gathered flat reads in module order
            layout = ShardLayout.from_params(subset, world, rank, align=ALIGN, first_cap_bytes=ONE_BUCKET,
                                             cap_bytes=ONE_BUCKET, order=range(len(subset)))
            for group in layout:
                members = [subset[j] for j in group.indices]
                cd = compute_dtype if (compute_dtype is not None and group.dtype.is_floating_point) else None
                values = None if src is None else _from_src(group, members, rank, src, label)
                unit.groups.append(UnitGroup(group, members, cd, label, values, empty_at_rest))
        unit.reshard()  # the parameters point at their runs: the unit's full storage goes
        units.append(unit)
    return units


def _place(params, device, keep_values: bool) -> None:
    """Puts `params` on `device`: moved when their values are needed, else (another process's
    values will be loaded into their runs) only allocated there, which is also what a
    parameter on the meta device gets."""
    for p in params:
        if p.is_meta:
            # a meta tensor's data cannot be re-pointed at real memory; swapping the contents of
            # the Parameter object keeps it the object the module and the optimizer hold (its
            # attributes are carried over: swap_tensors swaps __dict__ too)
            real = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, real)
            p.__dict__.update(real.__dict__)
        elif p.device != device:
            with torch.no_grad():
                p.data = p.data.to(device) if keep_values else torch.empty_like(p, device=device)


def _from_src(group, members, rank: int, src: int, label: str) -> list:
    """The group's parameters as rank `src` holds them, in one full-size buffer broadcast from
    it (a collective; the values of the other processes' parameters are not read)."""
    full = torch.empty(group.plan.total, dtype=group.dtype, device=group.device)
    views = group.param_views(full)
    if rank == src:
        with torch.no_grad():
            for v, p in zip(views, members):
                v.copy_(p.detach())
    try:
        collectives.broadcast(full, src=src)
    except RuntimeError as e:
        raise RuntimeError(f"rank {rank}: full sharding, {label}: the broadcast of rank {src}'s weights at prepare "
                           f"failed or timed out ({e})") from e
    return views
