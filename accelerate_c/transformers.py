"""transformers' own Trainer, with every distributed mechanic on accelerate_c's Accelerator.

    # from transformers import Trainer
    from accelerate_c.transformers import Trainer

The subclass changes one thing: `create_accelerator_and_postprocess` builds an
`accelerate_c.Accelerator` from the same arguments transformers gives accelerate's (its own
`_build_accelerator_args`: mixed precision, DDP kwargs, the dynamo plugin, the parallelism
config), plus what transformers hands accelerate's PartialState when the TrainingArguments are
built (cpu, the process group's backend and timeout). Nothing is patched: transformers keeps
using the real accelerate for what is not training (big-model loading, hooks), and the
Trainer's loop, checkpoints and logging are transformers' own.

The transformers versions this is tested with are stated in SUPPORTED; any other version is
refused when the Trainer is built (transformers' Trainer internals change between releases).
This module imports the real `transformers` package (absolute imports: this file's name does
not shadow it)."""
from __future__ import annotations

import functools
import importlib.metadata
import inspect
from datetime import timedelta

import transformers
from packaging.version import Version

from accelerate_c.accelerator import Accelerator
from accelerate_c.utils.dataclasses import (
    DataLoaderConfiguration,
    DistributedType,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
)

# [lowest, highest) transformers version the subclass is tested with; requirements-dev.txt
# pins the test version (5.23.0)
SUPPORTED = ("5.23.0", "5.24.0")
TESTED_VERSION = "5.23.0"


def installed_version() -> str:
    """The installed transformers distribution's version (its metadata: transformers' lazy
    module object can be replaced in sys.modules, its metadata cannot)."""
    return importlib.metadata.version("transformers")


def check_transformers_version(version: str | None = None):
    """A RuntimeError naming the installed (or given) and the supported transformers versions,
    unless that version is in SUPPORTED."""
    found = version if version is not None else installed_version()
    low, high = (Version(v) for v in SUPPORTED)
    if not low <= Version(found) < high:
        raise RuntimeError(f"accelerate_c.transformers.Trainer: transformers {found} is not supported; it is tested "
                           f"with transformers >={SUPPORTED[0]},<{SUPPORTED[1]} (pinned for tests: "
                           f"{TESTED_VERSION}). Install a supported version, or use transformers.Trainer on accelerate")


def _refuse(args):
    """The TrainingArguments that ask transformers' Trainer for a mechanic accelerate_c's
    Accelerator does not take through this subclass, each refused by name."""
    if args.deepspeed is not None:
        raise NotImplementedError(
            f"TrainingArguments.deepspeed={args.deepspeed!r}: transformers' Trainer runs DeepSpeed through the "
            "deepspeed package's engine, which accelerate_c.transformers.Trainer does not use. Leave deepspeed=None "
            "(ZeRO-1/2 settings reach accelerate_c through the accelerate config file with accelerate_c's own "
            "Trainer), or use transformers.Trainer on accelerate")
    if args.fsdp_plugin_args is not None or args.fsdp:
        raise NotImplementedError(f"TrainingArguments.fsdp={args.fsdp!r}: FSDP is not supported yet by accelerate_c")


class Trainer(transformers.Trainer):
    """transformers.Trainer whose Accelerator is accelerate_c's (see the module docstring).
    Refused when built: an unsupported transformers version, `deepspeed=` (and a DeepSpeed
    accelerate config), `fsdp=`; the Accelerator itself refuses what it has not built
    (torch_compile's dynamo backends, parallelism_config)."""

    def __init__(self, *args, **kwargs):
        check_transformers_version()
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None and not isinstance(given, transformers.TrainingArguments):
            raise TypeError(f"accelerate_c.transformers.Trainer takes transformers.TrainingArguments, got "
                            f"{type(given).__module__}.{type(given).__name__} (accelerate_c.TrainingArguments goes "
                            "with accelerate_c.Trainer)")
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        args = self.args
        _refuse(args)
        # transformers accumulates itself: the Accelerator counts 1, and a num_steps given in
        # accelerator_config becomes the Trainer's accumulation (both given is an error)
        grad_acc = dict(args.accelerator_config.gradient_accumulation_kwargs or {})
        if "num_steps" in grad_acc:
            if args.gradient_accumulation_steps > 1:
                raise ValueError("TrainingArguments: accelerator_config.gradient_accumulation_kwargs.num_steps and "
                                 "gradient_accumulation_steps > 1 are both set; set only one")
            args.gradient_accumulation_steps = grad_acc["num_steps"]
        grad_acc["num_steps"] = 1
        cfg = args.accelerator_config
        dataloader_config = DataLoaderConfiguration(
            split_batches=cfg.split_batches, dispatch_batches=cfg.dispatch_batches, even_batches=cfg.even_batches,
            use_seedable_sampler=cfg.use_seedable_sampler, data_seed=args.data_seed, non_blocking=cfg.non_blocking)
        kwargs = self._build_accelerator_args(dataloader_config=dataloader_config, fsdp_plugin=None,
                                              gradient_accumulation_plugin=GradientAccumulationPlugin(**grad_acc))
        # what transformers gives accelerate's PartialState when the arguments are built
        init = {"timeout": timedelta(seconds=args.ddp_timeout)}
        if args.ddp_backend is not None:
            init["backend"] = args.ddp_backend
        handlers = list(kwargs.get("kwargs_handlers") or [])
        if not any(type(h).__name__ == "InitProcessGroupKwargs" for h in handlers):  # a subclass may give its own
            handlers.append(InitProcessGroupKwargs(**init))
        kwargs["kwargs_handlers"] = handlers
        kwargs["cpu"] = bool(args.use_cpu)
        self.accelerator = Accelerator(**kwargs)
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            raise NotImplementedError(
                "accelerate_c.transformers.Trainer under DeepSpeed (ACCELERATE_USE_DEEPSPEED / a DEEPSPEED accelerate "
                "config): transformers' Trainer drives the deepspeed package's engine, which accelerate_c does not "
                "use; use accelerate_c's own Trainer (accelerate_c.Trainer) for ZeRO-1/2")
        self.gather_function = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(self.gather_function).parameters:
            self.gather_function = functools.partial(self.gather_function,
                                                     use_gather_object=args.eval_use_gather_object)
        self.is_deepspeed_enabled = False
        self.is_fsdp_enabled = False


__all__ = ["Trainer", "SUPPORTED", "TESTED_VERSION", "check_transformers_version"]
