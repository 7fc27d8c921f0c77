"""DeepSpeed configuration as users write it, read into one `ShardingConfig` for the ZeRO
strategies: accelerate's DeepSpeedPlugin / DummyOptim / DummyScheduler, DeepSpeed JSON configs,
their "auto" values, and the keys accelerate_c takes or refuses. docs/sharding.md says what runs.

Modules by concern: plugin (the objects a script builds, reading configs), config_dict (key
paths, "auto", mixed-precision rules), keys (accepted and refused keys), fill (who fills which
"auto" value, when), optim (the optimizer/scheduler blocks in plain torch), sharding (the
resolved ShardingConfig and the Accelerator's entry point)."""
from .config_dict import AUTO, apply_mixed_precision, mixed_precision_of
from .fill import fill_from_training_args, fill_from_training_steps, hidden_size_of
from .keys import DeepSpeedConfigError, DeepSpeedFeatureError, check_config
from .optim import DeepSpeedSchedule, build_optimizer, build_scheduler, schedule_lr
from .plugin import (
    DeepSpeedPlugin,
    DummyOptim,
    DummyScheduler,
    HfDeepSpeedConfig,
    is_deepspeed_plugin,
    is_dummy_optim,
    is_dummy_scheduler,
    load_config,
)
from .sharding import (
    BlockSpec,
    ShardingConfig,
    build_sharding,
    fill_for_prepare,
    resolve_sharding,
    sharding_from_config,
)

__all__ = [
    "AUTO", "DeepSpeedConfigError", "DeepSpeedFeatureError", "DeepSpeedPlugin", "DeepSpeedSchedule", "DummyOptim",
    "DummyScheduler", "HfDeepSpeedConfig", "BlockSpec", "ShardingConfig",
    "apply_mixed_precision", "build_optimizer", "build_scheduler", "build_sharding", "check_config",
    "fill_for_prepare", "fill_from_training_args", "fill_from_training_steps", "hidden_size_of",
    "is_deepspeed_plugin", "is_dummy_optim", "is_dummy_scheduler", "load_config", "mixed_precision_of",
    "resolve_sharding", "schedule_lr", "sharding_from_config",
]
