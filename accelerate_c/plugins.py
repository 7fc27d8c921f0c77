"""Which plugin and kwargs-handler objects the Accelerator takes, and which values it refuses.

A script moved from accelerate keeps building its configuration with accelerate's own classes
(`accelerate.utils.DistributedDataParallelKwargs(...)`), and transformers' Trainer always
passes a default `TorchDynamoPlugin()`: accelerate's objects of the classes accelerate_c has
(same names, same fields) are taken as they are, like ours, so that what the Accelerator
changes on them (ProjectConfiguration.iteration, DataLoaderConfiguration.split_batches) is
seen by the caller as with accelerate. Only values asking for something accelerate_c has not
built are refused, naming the argument and the value.
"""
from __future__ import annotations

import dataclasses

from .utils.dataclasses import TorchDynamoPlugin


def _is_accelerates(obj, cls) -> bool:
    """Whether obj is an instance of accelerate's class of the same name as ours (accelerate
    need not be importable: the class is recognised by its module)."""
    return any(base.__name__ == cls.__name__ and base.__module__.split(".")[0] == "accelerate"
               for base in type(obj).__mro__)


def kind_of(obj, classes):
    """The class among `classes` (ours) that obj is an instance of, or accelerate's
    counterpart of; None when none."""
    for cls in classes:
        if isinstance(obj, cls) or _is_accelerates(obj, cls):
            return cls
    return None


def check_kind(argument: str, obj, cls):
    """obj, when it is a `cls` (ours or accelerate's); else a TypeError naming the argument."""
    if obj is not None and kind_of(obj, (cls,)) is None:
        raise TypeError(f"Accelerator({argument}=...): expected a {cls.__name__} (accelerate_c's or accelerate's), "
                        f"got {type(obj).__module__}.{type(obj).__name__}")
    return obj


def describe(obj) -> str:
    """`Name(field=value, ...)` with only the fields that differ from the class's defaults (a
    kwargs handler says so itself: to_kwargs)."""
    if callable(getattr(obj, "to_kwargs", None)):
        return f"{type(obj).__name__}({', '.join(f'{k}={v!r}' for k, v in obj.to_kwargs().items())})"
    changed = []
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            value = getattr(obj, f.name, None)
            if default is dataclasses.MISSING or value != default:
                changed.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(changed)})"


def resolve_dynamo_plugin(plugin, backend):
    """The TorchDynamoPlugin in effect (accelerate's rules: dynamo_backend builds one; neither
    given: one from the ACCELERATE_DYNAMO_* variables). accelerate_c compiles nothing, so any
    backend but NO is refused."""
    if plugin is not None and backend is not None:
        raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
    if backend is not None:
        argument = f"dynamo_backend={backend!r}"
        plugin = TorchDynamoPlugin(backend=backend)
    elif plugin is not None:
        check_kind("dynamo_plugin", plugin, TorchDynamoPlugin)
        argument = f"dynamo_plugin={describe(plugin)}"
    else:
        plugin = TorchDynamoPlugin()
        argument = f"ACCELERATE_DYNAMO_BACKEND={str(getattr(plugin.backend, 'value', plugin.backend))!r}"
    name = str(getattr(plugin.backend, "value", plugin.backend)).upper()
    if name != "NO":
        raise NotImplementedError(f"Accelerator({argument}): torch dynamo backend {name} is not supported yet by "
                                  "accelerate_c, which does not compile models; use backend 'no' (the default), "
                                  "or torch.compile the model yourself before prepare()")
    return plugin


# Arguments whose mere presence turns a feature on in accelerate (it sets ACCELERATE_USE_FSDP,
# ..._DEEPSPEED, ..._MEGATRON_LM for any plugin given, default-valued or not)
_FEATURE_ARGUMENTS = {
    "deepspeed_plugin": "DeepSpeed", "deepspeed_plugins": "DeepSpeed", "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM", "torch_tp_plugin": "tensor parallelism",
    "parallelism_config": "ParallelismConfig (tensor/context/sharded data parallelism)",
    "log_with": "experiment trackers (log_with)",
}


def refuse_features(**arguments):
    """NotImplementedError naming the first argument given that asks for a feature not built."""
    for name, value in arguments.items():
        if value is not None:
            shown = describe(value) if dataclasses.is_dataclass(value) else repr(value)
            raise NotImplementedError(f"Accelerator({name}={shown}): {_FEATURE_ARGUMENTS[name]} is not supported yet "
                                      f"by accelerate_c (in accelerate, passing {name} turns it on); leave {name} "
                                      "at None")


# What a DeepSpeed configuration may hold until the whole of it is read (issue 13's
# configuration work): ZeRO stage 1 without offload, accumulation, and what changes no number.
# Anything else is refused by name rather than ignored.
_ZERO_KEYS = {"stage", "offload_optimizer", "offload_param", "stage3_gather_16bit_weights_on_model_save"}
_DS_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
            "zero_optimization", "gradient_clipping", "steps_per_print"}


def zero_from_plugin(plugin, gradient_accumulation_steps: int) -> tuple:
    """(ZeRO stage, gradient accumulation steps) from accelerate's DeepSpeedPlugin (or an object
    with its `deepspeed_config`). Refuses what accelerate_c does not build yet, naming the key."""
    if isinstance(plugin, dict) and "deepspeed" in plugin:  # TrainingArguments(deepspeed=...)
        raise NotImplementedError(f"deepspeed_plugin={plugin!r}: a DeepSpeed configuration from "
                                  "TrainingArguments(deepspeed=...) is not supported yet by accelerate_c; ZeRO stage 1 "
                                  "is, through Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))")
    cfg = getattr(plugin, "deepspeed_config", None)
    if not isinstance(cfg, dict):
        raise TypeError(f"deepspeed_plugin={type(plugin).__name__}: expected accelerate's DeepSpeedPlugin (with a "
                        "deepspeed_config dict)")

    def refuse(key, value):
        raise NotImplementedError(f"deepspeed_plugin: {key}={value!r} is not supported yet by accelerate_c (ZeRO "
                                  "stage 1 without offload is); remove it from the DeepSpeed configuration")

    for key, value in cfg.items():
        if key not in _DS_KEYS:
            refuse(key, value)
    if cfg.get("gradient_clipping") not in (None, 0):
        # accelerate's DeepSpeed engine clips at this value inside its step ("auto" is 1.0) and
        # accelerator.clip_grad_norm_ then only returns the norm; ZeRO-1 here clips where the
        # user calls clip_grad_norm_, as DDP does. Accepting the key would change the numbers
        # silently, so it is refused until the engine clips as DeepSpeed's does
        raise NotImplementedError(
            f"deepspeed_plugin: gradient_clipping={cfg['gradient_clipping']!r}: accelerate's DeepSpeed engine clips "
            "at it inside its step (\"auto\" is 1.0), which accelerate_c's ZeRO-1 does not do yet; pass "
            "DeepSpeedPlugin(..., gradient_clipping=0.0) and clip with accelerator.clip_grad_norm_ (docs/sharding.md)")
    zero = cfg.get("zero_optimization", {})
    for key, value in zero.items():
        if key not in _ZERO_KEYS:
            refuse(f"zero_optimization.{key}", value)
    for part in ("offload_optimizer", "offload_param"):
        device = (zero.get(part) or {}).get("device", "none")
        if device not in ("none", None):
            refuse(f"zero_optimization.{part}.device", device)
    stage = zero.get("stage", 0)
    if stage != 1:
        refuse("zero_optimization.stage", stage)
    ga = cfg.get("gradient_accumulation_steps", "auto")
    if ga != "auto":
        if gradient_accumulation_steps not in (1, ga):
            raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} differs from the DeepSpeed "
                             f"configuration's gradient_accumulation_steps={ga}")
        gradient_accumulation_steps = int(ga)
    return stage, gradient_accumulation_steps
