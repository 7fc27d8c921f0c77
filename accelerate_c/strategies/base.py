"""The seam between the flat gradient buffers and what a training strategy does with them.

GradManager (grads.py) owns the buffers and the local work on them (copy-in, unscale, norm,
clip). At each phase of a step it asks its strategy what else to do (docs/architecture.md, "One
training step"). This base class is the single-process strategy: nothing is communicated, the
gradients a process computes are the ones its optimizer reads, and the optimizer's state and the
model's parameters are whole on every process. ddp.DDPStrategy reduces buckets while backward
runs; a sharding strategy overrides the norm, found_inf, step and state-dict phases too.

A strategy keeps what it needs per buffer in `group.strategy_state` (set by attach) and never
writes the buffer's other fields; the buffers never read that state.
"""
from __future__ import annotations

from .. import fused_adam
from ..grad_layout import alloc_flat


class HookSums:
    """The single-process strategy's state per buffer (group.strategy_state)."""

    __slots__ = ("want",)

    def __init__(self, want=False):
        # clip_grad_norm_ asked for a 2-norm of this buffer: from then on, the backwards that
        # end a step have their hooks measure each gradient (the reducer's sums)
        self.want = want


class GradStrategy:
    """Single process: every phase is local."""

    world = 1
    # whether the prepared models' gradients live in GradManager's flat buffers; False: the
    # strategy holds them itself (ZeRO-2's gradient shards) and answers sharded_norm,
    # held_nonfinite and full_grad for them
    buffers_gradients = True
    # whether each process holds only its shard of the optimizers' state: checkpoints are then
    # written by every process and resharded on load (zero_checkpoint.py)
    sharded_state = False
    # whether checkpoints hold each process's shards of the model weights (model_shards.py)
    # rather than the whole weights written once
    sharded_weights = False
    # the factor each gradient is multiplied by as it lands in its range on a backward that
    # reduces (1/world for a sum that averages)
    prescale = 1.0

    # ---- prepare ------------------------------------------------------------------------
    def prepare_model(self, model, manager) -> None:
        """Accelerator.prepare_model, before the model's buffers are built."""

    def alloc_buffer(self, numel: int, dtype, device):
        """A zeroed flat gradient buffer for a group about to be laid out (a collective where a
        strategy places it in memory the processes share: every rank lays out its groups alike)."""
        return alloc_flat(numel, dtype, device)

    def attach(self, group, previous=None) -> None:
        """A buffer was built, rebuilt (`previous`: the strategy state of the buffer it
        replaces) or re-laid: (re)make what depends on its layout."""
        group.strategy_state = HookSums(getattr(previous, "want", False))

    # ---- backward -----------------------------------------------------------------------
    def begin_backward(self, group, sync: bool) -> bool:
        """The first gradient of a backward in `group`. `sync`: the model is not in no_sync().
        Returns whether this backward's buckets are handed to buckets_ready as they fill."""
        return False

    def measure_in_hooks(self, group, sync: bool) -> bool:
        """Whether the hooks of the backward now starting in `group` measure each gradient's
        sum of squares as it lands in its range (csrc/python/grad_hook_py.c, Reducer.sums): once
        clip_grad_norm_ asked for a 2-norm, on a backward outside no_sync() (accumulation
        micro-batches are rewritten by the next one: measuring them would be wasted), CPU
        buffers only (clip_norm_fused then pays one scaling pass)."""
        st = group.strategy_state
        return sync and not group.is_cuda and isinstance(st, HookSums) and st.want

    def buckets_ready(self, group, first: int, last: int) -> None:
        """Buckets [first, last) of `group` are complete (only on backwards begin_backward
        said are reduced)."""
        raise RuntimeError("a single-process backward does not reduce buckets")

    def end_of_backward(self, group) -> None:
        """A backward that begin_backward said is reduced delivered its last gradient."""

    def abort_backward(self, group) -> None:
        """A backward raised: forget what it started."""

    def finishes_in_order(self, group) -> bool:
        """Whether the backward now running in `group` is ended by the strategy, with the other
        groups of that backward in a fixed order, rather than by the group's own callback."""
        return False

    def missing_means_unused(self, group) -> bool:
        """Whether a parameter still without a gradient when the outermost backward ends is
        unused in that backward (find_unused_parameters: zeros in the sum), so that the group
        finishes there rather than waiting for finish_awaiting."""
        return False

    def start_join(self, model, manager):
        """join_uneven_inputs(): torch's Joinable for `model`, or None when nothing is shadowed."""
        return None

    def end_join(self) -> None:
        """join_uneven_inputs() is over."""

    # ---- before the gradients are read (GradManager.prepare_step) -----------------------
    def sync_missed(self, groups, unbuffered_models) -> None:
        """Reduces what the bucketed path could not: whole `groups` (rebuilt mid-step), and the
        unbuffered (float64) params of the prepared models `unbuffered_models` (id()s) that
        ran a sync backward since their last reduction."""

    def unbuffered_backward(self, model_key) -> bool:
        """A backward that reduces runs through a model with unbuffered (float64) params
        (several processes only): True when the strategy averages them at its end, else they
        wait for the end of Accelerator.backward, or for the step after a raw backward
        (sync_missed either way)."""
        return False

    # ---- norm, found_inf, step, state dict -----------------------------------------------
    def cached_sumsq(self, group):
        """(sum of squares, the same with each gradient's norm rounded to the buffer's dtype,
        non-finite) of `group`'s buffer as it is now (grads.sums), when the strategy
        measured it on the way (else None: the caller reads the buffer). One process: the sums
        the hooks took, valid only if every gradient was measured after its last write and
        nothing wrote the buffer since (its version counter: a `.grad` assignment or in-place
        change, resync's zeroing of a gradient-less range, unscale, a clip)."""
        if not group.is_cuda and isinstance(group.strategy_state, HookSums):
            return group.reducer.sums(group.flat._version)
        return None

    def want_sumsq(self, group) -> None:
        """clip_grad_norm_ asked for a 2-norm of `group`: measure it on the way from now on."""
        if isinstance(group.strategy_state, HookSums):
            group.strategy_state.want = True

    def total_sumsq(self, sumsq: float) -> float:
        """The sum of squares over every process's part of the gradients, from this process's
        part. Replicated gradients: this process's is the whole."""
        return sumsq

    def total_maxabs(self, maxabs: float) -> float:
        return maxabs

    def any_found_inf(self, found: bool) -> bool:
        """Whether any process's part of the gradients overflowed, from this process's."""
        return found

    def before_compile(self, model) -> None:
        """prepare() is about to torch.compile `model` (the last step of preparing it)."""

    def prepare_optimizer(self, optimizer) -> None:
        """Accelerator.prepare_optimizer, before the optimizer is wrapped (its models are
        prepared already): a sharding strategy rebuilds it in place here."""

    def model_params(self, optimizer) -> list:
        """The model parameters `optimizer` updates (a sharded optimizer lists views of them)."""
        return [p for group in optimizer.param_groups for p in group["params"]]

    def after_zero_grad(self, optimizer, set_to_none: bool) -> None:
        """`optimizer.zero_grad(set_to_none)` ran: a sharded optimizer's zero_grad only reached its
        views, and the strategy does the rest."""

    def sharded_norm(self, params, max_norm, norm_type):
        """clip_grad_norm_ over gradients the strategy holds itself (buffers_gradients False):
        the total norm as a 0-dim tensor, the gradients clipped to max_norm unless it is None;
        None when it holds none of `params`' gradients."""
        return None

    def held_nonfinite(self, params) -> bool:
        """Whether this process's part of the gradients of `params` the strategy holds itself
        has a NaN/Inf (then agreed by any_found_inf)."""
        return False

    def unscale_held(self, params, inv_scale: float) -> bool:
        """fp16 with torch's GradScaler semantics (FSDP's ShardedGradScaler): the gradients of
        `params` the strategy holds itself multiplied by inv_scale, each once until
        new_held_step; whether this process's part of them has a NaN/Inf (any_found_inf agrees)."""
        return False

    def new_held_step(self, params) -> None:
        """The optimizer over `params` stepped and the scaler updated: their held gradients count
        as scaled again, and no held gradient's next unscale is a second one."""

    def held_unscaled_again(self, params) -> list:
        """Those of `params` whose held gradient was unscaled since the scaler's last update and
        has been added to by a backward since (GradManager.refuse_unscale_again)."""
        return []

    def full_grad(self, p):
        """The whole gradient of `p` as the optimizer will read it (a collective where the
        gradients are sharded: every process calls it for the same parameter)."""
        return p.grad

    def after_step(self, optimizer) -> None:
        """`optimizer`'s step on a sync step ended (taken, or skipped on an fp16 overflow)."""

    def adopt_gradients(self, model, manager) -> None:
        """prepare_model of a trainable model when buffers_gradients is False: the strategy's
        own gradient storage for its parameters."""
        raise NotImplementedError("a strategy that does not use the flat buffers must adopt the gradients")

    def finish_awaiting(self) -> None:
        """GradManager.finish_awaiting for the gradients the strategy holds itself."""

    def clear_held(self) -> None:
        """GradManager.clear: forget the gradients the strategy holds itself (and their hooks)."""

    def abort_held(self) -> None:
        """A backward raised: the gradients the strategy holds itself forget what it started."""

    def refuse_checkpoint(self, doing: str) -> None:
        """Raises when `doing` (save_state, load_state) cannot be done under this strategy yet."""

    def optimizer_step(self, optimizer, closure=None):
        """The optimizer's update of the parameters it owns (torch's Adam/AdamW through the
        one-pass kernels where they give torch's values: fused_adam.py)."""
        return fused_adam.run_step(optimizer, closure)

    def load_targets(self, model):
        """(tensors load_state reads `model`'s saved weights into, by name; a callable that then
        applies them, or None when the tensors are the model's own)."""
        return model.state_dict(), None

    def weight_parts(self, model):
        """What a load of sharded weights (model_shards.py) fills on this process: {state-dict
        name: (a key shared by the names of one tensor, its shape, [(offset in its flattened
        elements, a tensor to fill with the elements from there on)])} for the parameters, the buffers {name:
        tensor}, and what to run once they are filled (None). Here every parameter is whole."""
        params = {id(p) for p in model.parameters()}
        parts, buffers = {}, {}
        for name, v in model.state_dict(keep_vars=True).items():
            if id(v) in params:
                parts[name] = (id(v), tuple(v.shape), [(0, v.detach())])
            else:
                buffers[name] = v.detach()
        return parts, buffers, None

    def model_state_dict(self, model, keep: bool | None = None) -> dict:
        """The full state dict of `model` (as a single-process model's). `keep`: whether this
        process needs it (None: the strategy's default); a strategy that gathers the weights
        (full sharding) gives {} where it is False."""
        return model.state_dict()
