"""The resolved ZeRO configuration the sharding strategies consume (`ShardingConfig`), and the
one place the Accelerator turns a DeepSpeed plugin into it (`sharding_from_config`).

`resolve_sharding` reads a plugin (accelerate_c's or accelerate's own DeepSpeedPlugin), checks
every key (keys.py), applies the Accelerator's mixed precision and accumulation steps and fills
what is known at construction (fill.py); `fill_for_prepare` completes it at prepare() from the
data loaders, the model and the DummyOptim/DummyScheduler. `sharding_from_config` is what
Accelerator.__init__ calls: it refuses, after the checks, what the engine does not run yet.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from types import MappingProxyType

from .config_dict import AUTO, apply_mixed_precision, auto_paths, mixed_precision_of, where
from .fill import fill_at_construction, fill_at_prepare
from .keys import DeepSpeedFeatureError, check_config
from .plugin import is_deepspeed_plugin


@dataclass(frozen=True)
class BlockSpec:
    """A checked `optimizer` block (type 'AdamW' | 'Adam' | 'SGD', built by optim.build_optimizer)
    or `scheduler` block ('WarmupLR' | 'WarmupDecayLR' | 'WarmupCosineLR', optim.build_scheduler)
    and its params (some may be "auto" until prepare() fills them)."""

    type: str
    params: MappingProxyType

    def block(self) -> dict:
        return {"type": self.type, "params": dict(self.params)}


@dataclass(frozen=True)
class ShardingConfig:
    """What a ZeRO run is configured to do. Values still "auto" after construction (batch sizes
    from the data loader, reduce_bucket_size from the model, the optimizer/scheduler blocks'
    values from DummyOptim/DummyScheduler) are None here and listed in `pending` until
    fill_for_prepare fills them."""

    stage: int  # 0..3; the Accelerator runs 1 and 2
    mixed_precision: str  # 'no' | 'bf16' | 'fp16', from the config's enabled section
    gradient_accumulation_steps: int
    gradient_clipping: float | None  # max global 2-norm; None: no clipping (absent or 0)
    micro_batch_size: int | None  # train_micro_batch_size_per_gpu
    train_batch_size: int | None  # = micro x accumulation x world size (checked)
    world_size: int
    offload_optimizer: str  # 'none' | 'cpu'
    offload_optimizer_pin_memory: bool
    offload_param: str  # 'none' | 'cpu' (stage 3)
    # element counts, DeepSpeed's unit (reduce_bucket_bytes() for a dtype's bytes)
    reduce_bucket_size: int | None
    allgather_bucket_size: int
    ignore_unused_parameters: bool  # DeepSpeed's default True: a parameter without a gradient is fine
    # stage 3 (element counts; None while "auto")
    stage3_prefetch_bucket_size: int | None
    stage3_param_persistence_threshold: int | None
    stage3_gather_16bit_weights_on_model_save: bool
    # accepted, no effect on the numbers accelerate_c computes
    overlap_comm: bool | None
    contiguous_gradients: bool
    reduce_scatter: bool
    # fp16 loss scaling, DeepSpeed's names and defaults (used when mixed_precision == 'fp16')
    loss_scale: float  # > 0: static scale; 0: dynamic
    initial_scale_power: int
    loss_scale_window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_loss_scale: float
    optimizer: BlockSpec | None
    scheduler: BlockSpec | None
    is_train_batch_min: bool
    source: str | None  # the DeepSpeed config file, when the config came from one
    pending: tuple = ()  # dotted keys still "auto"
    config: MappingProxyType = field(default_factory=lambda: MappingProxyType({}), compare=False, repr=False)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale == 0

    def scaler_kwargs(self) -> dict:
        """DeepSpeed's fp16 settings as accelerate_c's LossScaler / GradScalerKwargs arguments: the
        scale starts at 2**initial_scale_power (or the static loss_scale), halves on an overflow
        and doubles after loss_scale_window clean steps. scaler_differences() lists what of
        DeepSpeed's scaler these arguments cannot say."""
        init = float(self.loss_scale) if self.loss_scale > 0 else 2.0 ** self.initial_scale_power
        return {"init_scale": init, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": self.loss_scale_window}

    def ds_scaler_kwargs(self) -> dict:
        """DeepSpeed's fp16 settings as accelerate_c's DeepSpeedScaler arguments (ds_scaler.py):
        its own rule, hysteresis and minimum scale included."""
        static = self.loss_scale > 0
        return {"init_scale": float(self.loss_scale) if static else 2.0 ** self.initial_scale_power,
                "loss_scale_window": int(self.loss_scale_window), "hysteresis": int(self.hysteresis),
                "consecutive_hysteresis": bool(self.consecutive_hysteresis),
                "min_loss_scale": float(self.min_loss_scale), "static": static}

    @property
    def fp16_auto_cast(self) -> bool:
        """fp16.auto_cast: DeepSpeed's engine casts the forward's floating inputs to fp16."""
        section = self.config.get("fp16") or {}
        return self.mixed_precision == "fp16" and section.get("auto_cast") is True

    def scaler_differences(self) -> list:
        """Where DeepSpeed's fp16 scaler, as configured, does what the GradScaler rule of
        accelerate_c's LossScaler (csrc/core/scaler.c) does not (empty outside fp16)."""
        if self.mixed_precision != "fp16":
            return []
        out = []
        if self.loss_scale > 0:
            out.append(f"loss_scale={self.loss_scale}: a static scale, never changed by overflows")
        if self.hysteresis > 1:
            out.append(f"hysteresis={self.hysteresis}: the scale is lowered only at the {self.hysteresis}th overflow "
                       "since it was last set" + (" in a row" if self.consecutive_hysteresis else ""))
        out.append(f"min_loss_scale={self.min_loss_scale}: the scale never goes below it, and an overflow at it "
                   "stops training")
        return out

    def reduce_bucket_bytes(self, element_size: int) -> int | None:
        return None if self.reduce_bucket_size is None else self.reduce_bucket_size * element_size

    def allgather_bucket_bytes(self, element_size: int) -> int:
        return self.allgather_bucket_size * element_size


def _plugin_config(plugin):
    """(a deep copy of the plugin's DeepSpeed config, its source file, is_train_batch_min);
    accelerate's own plugin is read through its public fields."""
    if not is_deepspeed_plugin(plugin):
        raise TypeError(f"deepspeed_plugin: expected a DeepSpeedPlugin (accelerate_c's or accelerate's), got "
                        f"{type(plugin).__module__}.{type(plugin).__name__}")
    config = getattr(plugin, "deepspeed_config", None)
    if not isinstance(config, dict):
        raise TypeError("deepspeed_plugin has no deepspeed_config dict")
    source = getattr(plugin, "config_file", None) or getattr(getattr(plugin, "hf_ds_config", None), "config_file", None)
    # accelerate reads the variable at prepare() when the field is unset
    moe = getattr(plugin, "transformer_moe_cls_names", None)
    how = f"DeepSpeedPlugin(transformer_moe_cls_names={moe!r})"
    if moe is None and os.environ.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
        moe = os.environ["ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"]
        how = f"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES={moe!r}"
    if moe:
        raise DeepSpeedFeatureError(f"{how}: mixture of experts (MoE) with DeepSpeed is not supported by accelerate_c")
    return copy.deepcopy(config), source, bool(getattr(plugin, "is_train_batch_min", True))


def _batch_sizes(config, world_size, source, strict):
    """(train_batch_size, micro, accumulation) with DeepSpeed's rules for the absent ones, and
    its check that train = micro x accumulation x world size; None for values still "auto", or
    both absent before `strict` (DeepSpeed needs one of them when prepare() starts the engine)."""
    train, micro, accum = (config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                   "gradient_accumulation_steps"))
    if accum is None:  # DeepSpeed's rule when the key is absent
        accum = train // micro // world_size if isinstance(train, int) and isinstance(micro, int) else 1
    if AUTO in (train, micro, accum):
        return (None if train == AUTO else train), (None if micro == AUTO else micro), accum
    if train is None and micro is None:
        if not strict:
            return None, None, accum
        raise ValueError(f"DeepSpeed config{where(source)}: set train_micro_batch_size_per_gpu (or train_batch_size): "
                         "DeepSpeed needs one of them")
    if micro is None:
        micro = train // world_size // accum
    if train is None:
        train = micro * accum * world_size
    if train != micro * accum * world_size:
        raise ValueError(f"DeepSpeed config{where(source)}: train_batch_size={train} must equal "
                         f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({accum}) x the "
                         f"number of processes ({world_size}) = {micro * accum * world_size}")
    return train, micro, accum


_OPTIMIZER_TYPES = {"adamw": "AdamW", "adam": "Adam", "sgd": "SGD"}


def _spec(block, names=None):
    """The BlockSpec of a checked block (None when absent); `names`: the type's canonical spelling."""
    if block is None:
        return None
    kind = block["type"]
    if names is not None:
        kind = names[str(kind).lower()]
    return BlockSpec(kind, MappingProxyType(dict(block.get("params", {}))))


def build_sharding(config: dict, *, world_size: int, source: str | None = None, is_train_batch_min: bool = True,
                   strict: bool = False) -> ShardingConfig:
    """The ShardingConfig of a checked, (partly) filled config; `strict`: the config is final."""
    stage = check_config(config, source)
    zero = config["zero_optimization"]
    train, micro, accum = _batch_sizes(config, world_size, source, strict)
    clip = config.get("gradient_clipping")
    fp16 = config.get("fp16", {})
    offload = zero.get("offload_optimizer", {})
    reduce = zero.get("reduce_bucket_size", 500_000_000)  # DeepSpeed's defaults: 5e8 elements
    prefetch = zero.get("stage3_prefetch_bucket_size", 50_000_000)  # 5e7
    persist = zero.get("stage3_param_persistence_threshold", 100_000)  # 1e5
    return ShardingConfig(
        stage=stage, mixed_precision=mixed_precision_of(config, source),
        gradient_accumulation_steps=accum, gradient_clipping=float(clip) if clip not in (None, 0, AUTO) else None,
        micro_batch_size=micro, train_batch_size=train, world_size=world_size,
        offload_optimizer=offload.get("device", "none"), offload_optimizer_pin_memory=bool(offload.get("pin_memory")),
        offload_param=zero.get("offload_param", {}).get("device", "none"),
        reduce_bucket_size=None if reduce == AUTO else int(reduce),
        allgather_bucket_size=int(zero.get("allgather_bucket_size", 500_000_000)),
        ignore_unused_parameters=bool(zero.get("ignore_unused_parameters", True)),
        stage3_prefetch_bucket_size=None if prefetch == AUTO else int(prefetch),
        stage3_param_persistence_threshold=None if persist == AUTO else int(persist),
        stage3_gather_16bit_weights_on_model_save=zero.get("stage3_gather_16bit_weights_on_model_save") is True,
        overlap_comm=zero.get("overlap_comm"), contiguous_gradients=zero.get("contiguous_gradients", True),
        reduce_scatter=zero.get("reduce_scatter", True),
        loss_scale=fp16.get("loss_scale", 0), initial_scale_power=fp16.get("initial_scale_power", 16),
        loss_scale_window=fp16.get("loss_scale_window", 1000), hysteresis=fp16.get("hysteresis", 2),
        consecutive_hysteresis=fp16.get("consecutive_hysteresis", False),
        min_loss_scale=fp16.get("min_loss_scale", 1),
        optimizer=_spec(config.get("optimizer"), _OPTIMIZER_TYPES),
        scheduler=_spec(config.get("scheduler")),
        is_train_batch_min=is_train_batch_min, source=source, pending=tuple(auto_paths(config)),
        config=MappingProxyType(config))


def resolve_sharding(plugin, *, mixed_precision: str = "no", gradient_accumulation_steps: int = 1,
                     num_processes: int = 1) -> ShardingConfig:
    """The ShardingConfig for `plugin` as an Accelerator with these settings sees it at
    construction. Raises for any key accelerate_c cannot run (keys.py)."""
    config, source, train_min = _plugin_config(plugin)
    check_config(config, source)  # before anything is filled: errors name the user's own values
    apply_mixed_precision(config, mixed_precision, source)
    fill_at_construction(config, gradient_accumulation_steps, source)
    return build_sharding(config, world_size=num_processes, source=source, is_train_batch_min=train_min)


def fill_for_prepare(sharding: ShardingConfig, *, dataloaders=(), model=None, optimizer=None, scheduler=None,
                     split_batches: bool = False) -> ShardingConfig:
    """`sharding` completed as accelerate's prepare() completes the DeepSpeed config: from the
    data loaders, model, optimizer and scheduler of one prepare() call (see fill.fill_at_prepare)."""
    config = copy.deepcopy(dict(sharding.config))
    fill_at_prepare(config, dataloaders=dataloaders, model=model, optimizer=optimizer, scheduler=scheduler,
                    num_processes=sharding.world_size, split_batches=split_batches,
                    is_train_batch_min=sharding.is_train_batch_min, source=sharding.source)
    return build_sharding(config, world_size=sharding.world_size, source=sharding.source,
                          is_train_batch_min=sharding.is_train_batch_min, strict=model is not None)


def sharding_from_config(plugin, *, mixed_precision: str = "no", gradient_accumulation_steps: int = 1,
                         num_processes: int = 1) -> ShardingConfig:
    """What Accelerator.__init__ calls with its DeepSpeed plugin: the configuration read and
    checked in full (each bad key with its own error), then refused where the engine does not
    run: stage 0, and fp16 at stage 3 (its loss scaling over full sharding is not built yet)."""
    sharding = resolve_sharding(plugin, mixed_precision=mixed_precision,
                                gradient_accumulation_steps=gradient_accumulation_steps, num_processes=num_processes)
    src = f" (DeepSpeed config {sharding.source})" if sharding.source else ""
    if sharding.stage == 0:
        raise NotImplementedError(f"DeepSpeed ZeRO stage 0{src}: DeepSpeed without ZeRO is not supported by "
                                  "accelerate_c; use plain data parallelism (no DeepSpeed) or stage 1 or 2")
    return sharding
