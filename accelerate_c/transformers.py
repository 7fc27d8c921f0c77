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

import contextlib
import functools
import importlib.metadata
import inspect
import os
from datetime import timedelta

import torch
import transformers
from packaging.version import Version

from accelerate_c.accelerator import Accelerator
from accelerate_c import model_shards
from accelerate_c.checkpointing import (load_model_shards, load_sharded_optimizers, save_model_shards,
                                         save_sharded_optimizers)
from accelerate_c.fsdp_plugin import FullyShardedDataParallelPlugin
from accelerate_c.utils.operations import fp32_loss_only
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


class Trainer(transformers.Trainer):
    """transformers.Trainer whose Accelerator is accelerate_c's (see the module docstring).
    Refused when built: an unsupported transformers version, `deepspeed=` (and a DeepSpeed
    accelerate config); the Accelerator itself refuses what it has not built
    (parallelism_config)."""

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
        # TrainingArguments(fsdp=..., fsdp_config=...): the plugin transformers would build, ours
        fsdp_plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args) if args.fsdp_plugin_args else None
        kwargs = self._build_accelerator_args(dataloader_config=dataloader_config, fsdp_plugin=fsdp_plugin,
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
        # transformers' FSDP branches call accelerate's torch-FSDP helpers; full sharding here is
        # accelerate_c's own, so the Trainer takes its generic paths and the overrides below
        self.is_fsdp_enabled = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """transformers' compute_loss. Where it reads only the loss of the outputs (no outputs
        returned, no compute_loss_func, no label smoothing), the prepared forward converts only
        the loss to fp32 under mixed precision (operations.fp32_loss_only): the same loss, and
        no fp32 copy of the logits that nothing reads."""
        reads_outputs = return_outputs or self.compute_loss_func is not None or self.label_smoother is not None
        with contextlib.nullcontext() if reads_outputs else fp32_loss_only():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)

    # ---- full sharding (an accelerate config with distributed_type FSDP) ----------------------
    def _sharded(self) -> bool:
        return self.accelerator.distributed_type == DistributedType.FSDP and self.accelerator.num_processes > 1

    def _sharded_weights(self) -> bool:
        """Checkpoints hold each process's shard of the weights (FSDP's SHARDED_STATE_DICT)."""
        return self._sharded() and self.accelerator._grads.strategy.sharded_weights

    def save_model(self, output_dir=None, _internal_call: bool = False) -> None:
        """Under full sharding the weights are gathered (every process takes part) and the main
        process writes them in the model's own format, so from_pretrained(output_dir) loads them.
        A checkpoint's (`_internal_call`) under SHARDED_STATE_DICT: each process writes its shard
        (no process gathers the model) and the main process the model's config."""
        if not self._sharded():
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if _internal_call and getattr(self, "_in_checkpoint", False) and self._sharded_weights():
            save_model_shards(self.accelerator, output_dir)
            config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
            if self.args.should_save and callable(getattr(config, "save_pretrained", None)):
                config.save_pretrained(output_dir)
            return
        state_dict = self.accelerator.get_state_dict(self.model, keep=self.args.should_save)  # where it is written
        if self.args.should_save:
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model, trial) -> None:
        # save_model's internal calls from a checkpoint write shards; push_to_hub's and others'
        # (also internal) gather the weights into files from_pretrained loads
        self._in_checkpoint = True
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self._in_checkpoint = False

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """A checkpoint of sharded weights (save_model above) loads from every process's shard,
        on any number of processes. transformers asks before prepare (its FSDP branches are off
        here); under full sharding the load waits until the model is prepared (each process then
        reads only its elements: _load_optimizer_and_scheduler), elsewhere it reads whole
        parameters now."""
        if not model_shards.is_sharded(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if model is None and self._sharded() and not self.accelerator._models:  # before prepare
            self._shards_to_load = resume_from_checkpoint
            return
        load_model_shards(self.accelerator, model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not model_shards.is_sharded(best):
            return super()._load_best_model()
        load_model_shards(self.accelerator, self.model, best)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under full sharding each process writes its own optimizer shard (plus the plans), never
        the whole state; the scheduler as transformers saves it."""
        if not self._sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        save_sharded_optimizers(self.accelerator, output_dir)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        pending, self._shards_to_load = getattr(self, "_shards_to_load", None), None
        if pending is not None:  # the sharded weights, now that the model is (_load_from_checkpoint)
            load_model_shards(self.accelerator, self.model, pending)
        if checkpoint is None or not self._sharded():
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_sharded_optimizers(self.accelerator, checkpoint)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))


__all__ = ["Trainer", "SUPPORTED", "TESTED_VERSION", "check_transformers_version"]
