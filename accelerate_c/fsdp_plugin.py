"""FSDP configuration as users write it (docs/sharding.md, "ZeRO-3 / FSDP"):
`FullyShardedDataParallelPlugin` with accelerate's fields and defaults, the `FSDP_*` variables
`accelerate-c launch` exports from a config file's `fsdp_config` (read when a field is left
unset, as accelerate reads them), and `fsdp_settings`, which turns our plugin or accelerate's own
into what the full-sharding strategy runs (`FsdpSettings`), refusing by name what is not built.
Unlike accelerate's plugin, constructing one changes no environment variable."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "no": None}


def _flag(value) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "y", "on"):
        return True
    if s in ("0", "false", "no", "n", "off"):
        return False
    raise ValueError(f"expected a boolean, got {value!r}")


def _env(name: str, default=None):
    return os.environ.get("FSDP_" + name, default)


@dataclasses.dataclass
class FullyShardedDataParallelPlugin:
    """accelerate's FSDP plugin fields; None means "from FSDP_<NAME>, else accelerate's default"."""

    fsdp_version: int | None = None
    sharding_strategy: Any = None
    reshard_after_forward: Any = None
    backward_prefetch: Any = None
    mixed_precision_policy: Any = None
    auto_wrap_policy: Any = None
    cpu_offload: Any = None
    ignored_modules: Any = None
    state_dict_type: Any = None
    state_dict_config: Any = None
    optim_state_dict_config: Any = None
    limit_all_gathers: bool = True
    use_orig_params: bool | None = None
    param_init_fn: Any = None
    sync_module_states: bool | None = None
    forward_prefetch: bool | None = None
    activation_checkpointing: bool | None = None
    cpu_ram_efficient_loading: bool | None = None
    transformer_cls_names_to_wrap: list | None = None
    min_num_params: int | None = None

    def __post_init__(self):
        if self.fsdp_version is None:
            self.fsdp_version = int(_env("VERSION", "1"))
        if self.fsdp_version not in (1, 2):
            raise ValueError(f"FullyShardedDataParallelPlugin(fsdp_version={self.fsdp_version!r}): expected 1 or 2")
        if self.fsdp_version == 2:
            if self.reshard_after_forward is None:
                self.reshard_after_forward = _env("RESHARD_AFTER_FORWARD", "true")
        elif self.sharding_strategy is None:
            # FSDP1 takes reshard_after_forward as the strategy's name (transformers passes it so)
            given = self.reshard_after_forward
            self.sharding_strategy = given if isinstance(given, str) and given.upper() in STRATEGIES else \
                _env("SHARDING_STRATEGY", "FULL_SHARD")
        if self.auto_wrap_policy is None:
            self.auto_wrap_policy = _env("AUTO_WRAP_POLICY", "NO_WRAP")
        if self.transformer_cls_names_to_wrap is None and _env("TRANSFORMER_CLS_TO_WRAP"):
            self.transformer_cls_names_to_wrap = _env("TRANSFORMER_CLS_TO_WRAP").split(",")
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = self.transformer_cls_names_to_wrap.split(",")
        if self.min_num_params is None:
            self.min_num_params = int(_env("MIN_NUM_PARAMS", "0"))
        if self.cpu_offload is None:
            self.cpu_offload = _flag(_env("OFFLOAD_PARAMS", "false"))
        if self.state_dict_type is None:
            self.state_dict_type = _env("STATE_DICT_TYPE", "FULL_STATE_DICT" if self.fsdp_version == 1
                                        else "SHARDED_STATE_DICT")
        for name, var, default in (("use_orig_params", "USE_ORIG_PARAMS", "false"),
                                   ("sync_module_states", "SYNC_MODULE_STATES", "false"),
                                   ("forward_prefetch", "FORWARD_PREFETCH", "false"),
                                   ("activation_checkpointing", "ACTIVATION_CHECKPOINTING", "false"),
                                   ("cpu_ram_efficient_loading", "CPU_RAM_EFFICIENT_LOADING", "false")):
            if getattr(self, name) is None:
                setattr(self, name, _flag(_env(var, default)))
        if self.backward_prefetch is None:
            self.backward_prefetch = _env("BACKWARD_PREFETCH")
        if self.ignored_modules is None and _env("IGNORED_MODULES"):
            self.ignored_modules = _env("IGNORED_MODULES")


@dataclasses.dataclass(frozen=True)
class FsdpSettings:
    """What the full-sharding strategy runs."""

    version: int
    reshard_after_forward: bool
    wrap_policy: str  # one of WRAP_POLICIES
    wrap_classes: tuple
    min_num_params: int
    param_dtype: Any  # torch dtype of the gathers and the compute, or None (the parameters')
    state_dict_type: str
    cpu_ram_efficient_loading: bool
    activation_checkpointing: bool = False


def _name(value, names, key):
    """An enum-like value (a name, an int index from 1, or an enum member) as its name."""
    if hasattr(value, "name"):
        value = value.name
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(names):
        return names[value - 1]
    if isinstance(value, str):
        if value.isdigit() and 1 <= int(value) <= len(names):
            return names[int(value) - 1]
        if value.upper() in names:
            return value.upper()
    raise ValueError(f"FSDP {key}={value!r}: expected one of {', '.join(names)}")


def _wrap_policy(plugin):
    policy = plugin.auto_wrap_policy
    if policy is None:
        return "NO_WRAP"
    if isinstance(policy, str):
        return _name(policy, WRAP_POLICIES, "auto_wrap_policy")
    fn = getattr(policy, "func", policy)  # functools.partial of torch's policies
    name = getattr(fn, "__name__", "")
    if name == "transformer_auto_wrap_policy":
        return "TRANSFORMER_BASED_WRAP"
    if name == "size_based_auto_wrap_policy":
        return "SIZE_BASED_WRAP"
    raise NotImplementedError(f"FSDP auto_wrap_policy={policy!r}: a custom wrap policy callable is not supported by "
                              "accelerate_c; use TRANSFORMER_BASED_WRAP (with transformer_cls_names_to_wrap), "
                              "SIZE_BASED_WRAP (with min_num_params) or NO_WRAP")


def _param_dtype(plugin, mixed_precision: str):
    """MixedPrecisionPolicy's param_dtype (reduce_dtype must match it: the reduce-scatter runs in
    the compute dtype), else the Accelerator's mixed precision, as accelerate sets the policy."""
    policy = plugin.mixed_precision_policy
    if policy is None:
        return _DTYPES.get(mixed_precision)
    if isinstance(policy, str):
        if policy not in _DTYPES:
            raise ValueError(f"FSDP mixed_precision_policy={policy!r}: expected one of {', '.join(_DTYPES)}")
        return _DTYPES[policy]
    get = policy.get if isinstance(policy, dict) else (lambda k, d=None: getattr(policy, k, d))
    param, reduce_ = get("param_dtype"), get("reduce_dtype")
    if isinstance(param, str):
        param = _DTYPES[param] if param in _DTYPES else getattr(torch, param, None)
    if isinstance(reduce_, str):
        reduce_ = _DTYPES[reduce_] if reduce_ in _DTYPES else getattr(torch, reduce_, None)
    if param is not None and param not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"FSDP mixed_precision_policy.param_dtype={param!r}: expected float32, bfloat16 or float16")
    if reduce_ is not None and reduce_ != (param or torch.float32):
        raise NotImplementedError(f"FSDP mixed_precision_policy.reduce_dtype={reduce_}: accelerate_c reduce-scatters "
                                  f"in the compute dtype ({param or torch.float32}); leave reduce_dtype unset or equal "
                                  "to param_dtype")
    return None if param == torch.float32 else param


def fsdp_settings(plugin, mixed_precision: str = "no", device_type: str = "cpu") -> FsdpSettings:
    """The settings of `plugin` (ours, or accelerate's own FullyShardedDataParallelPlugin)."""
    version = int(getattr(plugin, "fsdp_version", 1) or 1)
    if version == 2:
        raf = plugin.reshard_after_forward
        if isinstance(raf, str) and raf.upper() in STRATEGIES:
            raf = raf.upper() == "FULL_SHARD"
        elif not isinstance(raf, bool):
            raf = _flag(raf)
    else:
        given = plugin.sharding_strategy if plugin.sharding_strategy is not None else plugin.reshard_after_forward
        strategy = _name(given, STRATEGIES, "sharding_strategy")
        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise NotImplementedError(f"FSDP sharding_strategy={strategy}: accelerate_c builds FULL_SHARD and "
                                      "SHARD_GRAD_OP (use DDP for NO_SHARD)")
        raf = strategy == "FULL_SHARD"
    offload = plugin.cpu_offload
    offload = bool(getattr(offload, "offload_params", offload)) if not isinstance(offload, bool) else offload
    if offload and device_type != "cpu":
        raise NotImplementedError("FSDP cpu_offload=True on GPUs is not built in accelerate_c yet (on CPU processes "
                                  "the shards and the step are on the CPU already)")
    if getattr(plugin, "activation_checkpointing_offload", False) or \
            _flag(os.environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", "false")):
        raise NotImplementedError("FSDP activation_checkpointing_offload=True is not built in accelerate_c")
    if getattr(plugin, "ignored_modules", None):
        raise NotImplementedError("FSDP ignored_modules is not supported by accelerate_c yet")
    sdt = _name(plugin.state_dict_type, STATE_DICT_TYPES, "state_dict_type")
    if sdt == "LOCAL_STATE_DICT":
        raise NotImplementedError("FSDP state_dict_type=LOCAL_STATE_DICT is not supported by accelerate_c; use "
                                  "FULL_STATE_DICT or SHARDED_STATE_DICT")
    wrap = _wrap_policy(plugin)
    classes = tuple(plugin.transformer_cls_names_to_wrap or ())
    return FsdpSettings(version=version, reshard_after_forward=bool(raf), wrap_policy=wrap, wrap_classes=classes,
                        min_num_params=int(plugin.min_num_params or 0),
                        param_dtype=_param_dtype(plugin, mixed_precision), state_dict_type=sdt,
                        cpu_ram_efficient_loading=bool(getattr(plugin, "cpu_ram_efficient_loading", False)),
                        activation_checkpointing=bool(getattr(plugin, "activation_checkpointing", False)))


def plugin_from_training_args(fsdp, fsdp_config) -> FullyShardedDataParallelPlugin | None:
    """The plugin TrainingArguments' `fsdp` / `fsdp_config` describe, by transformers' rules
    (its TrainingArguments._process_fsdp_args: options in `fsdp` such as "full_shard auto_wrap
    offload", `fsdp_config` a dict or a JSON file with or without its fsdp_ prefixes, FSDP2 by
    default, TRANSFORMER_BASED_WRAP by default). None when `fsdp` is off."""
    import json

    if not fsdp:
        return None
    if isinstance(fsdp_config, (str, os.PathLike)):
        with open(fsdp_config, encoding="utf-8") as f:
            fsdp_config = json.load(f)
    cfg = {(k[5:] if k.startswith("fsdp_") else k): v for k, v in dict(fsdp_config or {}).items()}
    options = fsdp.split() if isinstance(fsdp, str) else list(fsdp) if isinstance(fsdp, (list, tuple)) else []
    options = [o.lower() for o in options]
    unknown = [o for o in options if o not in ("full_shard", "shard_grad_op", "offload", "auto_wrap")]
    if unknown:
        raise NotImplementedError(f"TrainingArguments.fsdp option {unknown[0]!r}: accelerate_c builds full_shard, "
                                  "shard_grad_op, offload and auto_wrap")
    version = int(cfg.get("version", 2))
    policy = cfg.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy not in WRAP_POLICIES:
        raise ValueError(f"fsdp_config.auto_wrap_policy={policy!r}: expected one of {', '.join(WRAP_POLICIES)}")
    classes = cfg.get("transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [classes]
    reshard = cfg.get("reshard_after_forward", "shard_grad_op" not in options)
    if version == 1:
        reshard = "SHARD_GRAD_OP" if "shard_grad_op" in options else str(reshard).upper() \
            if str(reshard).upper() in STRATEGIES else ("FULL_SHARD" if _flag(reshard) else "SHARD_GRAD_OP")
    return FullyShardedDataParallelPlugin(
        fsdp_version=version, auto_wrap_policy=policy,
        min_num_params=int(cfg.get("min_num_params", 0)) if policy == "SIZE_BASED_WRAP" else 0,
        transformer_cls_names_to_wrap=list(classes) if classes and policy == "TRANSFORMER_BASED_WRAP" else None,
        cpu_offload=bool(cfg.get("cpu_offload", False)) or "offload" in options,
        cpu_ram_efficient_loading=_flag(cfg.get("cpu_ram_efficient_loading", False)),
        state_dict_type=cfg.get("state_dict_type", "FULL_STATE_DICT"),
        activation_checkpointing=_flag(cfg.get("activation_checkpointing", False)),
        reshard_after_forward=reshard if version == 1 else _flag(reshard))


def resolve_fsdp_plugin(given):
    """The plugin in effect: the one given, else one built from the FSDP_* variables when
    ACCELERATE_USE_FSDP is true (what `accelerate-c launch` sets for distributed_type FSDP)."""
    if given is not None:
        if isinstance(given, dict) and "fsdp" in given:  # what accelerate_c's TrainingArguments hands on
            return plugin_from_training_args(given["fsdp"], given.get("fsdp_config"))
        if not hasattr(given, "auto_wrap_policy") or not hasattr(given, "state_dict_type"):
            raise TypeError(f"Accelerator(fsdp_plugin=...): expected a FullyShardedDataParallelPlugin, got "
                            f"{type(given).__name__}")
        return given
    if _flag(os.environ.get("ACCELERATE_USE_FSDP", "false")):
        return FullyShardedDataParallelPlugin()
    return None
