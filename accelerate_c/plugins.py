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

from .deepspeed_config import DeepSpeedPlugin
from .utils.dataclasses import TorchDynamoPlugin, parse_flag_from_env


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
    given: one from the ACCELERATE_DYNAMO_* variables). prepare() compiles with it
    (compilation.py)."""
    if plugin is not None and backend is not None:
        raise ValueError("You cannot pass in both `dynamo_plugin` and `dynamo_backend`, please only pass in one.")
    if backend is not None:
        return TorchDynamoPlugin(backend=backend)
    if plugin is not None:
        check_kind("dynamo_plugin", plugin, TorchDynamoPlugin)
        return plugin
    return TorchDynamoPlugin()


def resolve_deepspeed_plugin(plugin, plugins):
    """The DeepSpeedPlugin in effect, or None (accelerate's rules): `deepspeed_plugin` and
    `deepspeed_plugins` are one argument under two names; a dict of named plugins makes its first
    one active; neither given, ACCELERATE_USE_DEEPSPEED=true (what `accelerate-c launch
    --use_deepspeed` or a DEEPSPEED config file sets) builds one from the ACCELERATE_DEEPSPEED_*
    variables. accelerate's own DeepSpeedPlugin objects are taken as they are."""
    if plugin is not None and plugins is not None:
        raise ValueError("Accelerator: deepspeed_plugin and deepspeed_plugins are the same argument under two names; "
                         "pass one of them, not both")
    given = plugin if plugin is not None else plugins
    if given is None:
        return DeepSpeedPlugin() if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") else None
    name = "deepspeed_plugin" if plugin is not None else "deepspeed_plugins"
    if isinstance(given, dict):
        if not given:
            raise ValueError(f"Accelerator({name}={{}}): the dict of DeepSpeed plugins is empty")
        for key, value in given.items():
            check_kind(f"{name}[{key!r}]", value, DeepSpeedPlugin)
        return next(iter(given.values()))
    return check_kind(name, given, DeepSpeedPlugin)


# Arguments whose mere presence turns a feature on in accelerate (it sets ACCELERATE_USE_FSDP,
# ..._MEGATRON_LM for any plugin given, default-valued or not)
_FEATURE_ARGUMENTS = {
    "fsdp_plugin": "FSDP",
    "megatron_lm_plugin": "Megatron-LM", "torch_tp_plugin": "tensor parallelism",
    "parallelism_config": "ParallelismConfig (tensor/context/sharded data parallelism)",
}


def refuse_features(**arguments):
    """NotImplementedError naming the first argument given that asks for a feature not built."""
    for name, value in arguments.items():
        if value is not None:
            shown = describe(value) if dataclasses.is_dataclass(value) else repr(value)
            raise NotImplementedError(f"Accelerator({name}={shown}): {_FEATURE_ARGUMENTS[name]} is not supported yet "
                                      f"by accelerate_c (in accelerate, passing {name} turns it on); leave {name} "
                                      "at None")
