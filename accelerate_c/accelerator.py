"""The Accelerator: accelerate 1.15's public API, with gradient work done by the C core."""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import warnings
from types import MethodType

import torch

from . import _C, checkpointing, host_malloc
from .autocast import AutocastForward, autocast_context
from .batch_sharding import BatchSamplerShard
from .data_loader import DataLoaderDispatcher, DataLoaderShard, prepare_data_loader, skip_first_batches
from .stateful_loader import stateful_dataloader_class
from .deepspeed_config import sharding_from_config
from .deepspeed_config.prepare import prepare_args
from .strategies.ddp import DDPStrategy
from .strategies.zero import Zero1Strategy
from .strategies.zero2 import Zero2Strategy
from .strategies.fsdp import FullShardStrategy
from .fsdp_plugin import fsdp_settings, resolve_fsdp_plugin
from .compilation import compile_prepared, compiles, made_by_prepare, plain_keys, prepared_inner
from .grads import GradManager
from .optimizer import AcceleratedOptimizer
from .accelerator_grads import GradientFacade
from .accelerator_process import ProcessFacade
from .accelerator_tracking import TrackerFacade
from .parallelism import ParallelismNames
from .profiling import ProfileFacade
from .absent_features import AbsentFeatureNames, refuse_lomo
from .plugins import check_kind, kind_of, refuse_features, resolve_deepspeed_plugin, resolve_dynamo_plugin
from .ds_scaler import DeepSpeedScaler
from .scaler import LossScaler
from .scheduler import AcceleratedScheduler
from .state import AcceleratorState, GradientState
from .training_args import accelerator_kwargs, load_training_args
from .utils.dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    HostMallocKwargs,
    ProfileKwargs,
    InitProcessGroupKwargs,
    CpuCommKwargs,
    PrecisionType,
    ProjectConfiguration,
    parse_choice_from_env,
    parse_flag_from_env,
)
from .utils import operations as ops
from .utils.operations import convert_outputs_to_fp32, recursively_apply
from .utils.other import extract_model_from_parallel, is_compiled_module

_split_batches = object()  # sentinel: tells "not passed" from False, as accelerate does

_HANDLERS = (AutocastKwargs, GradScalerKwargs, DistributedDataParallelKwargs, InitProcessGroupKwargs, CpuCommKwargs,
             HostMallocKwargs, ProfileKwargs)


def _batch_sampler_shard(dataloader):
    """The BatchSamplerShard that shards a prepared map-style data loader, or None (iterable
    datasets, one process)."""
    for candidate in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None)):
        if isinstance(candidate, BatchSamplerShard):
            return candidate
        inner = getattr(candidate, "batch_sampler", None)  # skip_first_batches' SkipBatchSampler
        if isinstance(inner, BatchSamplerShard):
            return inner
    return None


def _on_meta(model) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _cast_inputs_half(module, args, kwargs):
    """DeepSpeed's fp16.auto_cast: the forward's floating-point tensor inputs (nested in lists,
    tuples and dicts too) cast to fp16."""
    def half(t):
        return t.half() if t.is_floating_point() else t
    return recursively_apply(half, args), recursively_apply(half, kwargs)


class Accelerator(GradientFacade, ProcessFacade, TrackerFacade, ParallelismNames, ProfileFacade, AbsentFeatureNames):
    """Creates the training state and wraps models, optimizers, schedulers and data loaders.

    Parameters and their order are accelerate 1.15's, so positional and keyword calls bind the
    same. Parameters for features accelerate_c has not built yet raise NotImplementedError
    when given a non-default value, rather than being ignored."""

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = _split_batches,
        mixed_precision: PrecisionType | str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin=None,
        fsdp_plugin=None,
        torch_tp_plugin=None,
        megatron_lm_plugin=None,
        rng_types: list | None = None,
        log_with=None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list | None = None,
        dynamo_backend=None,
        dynamo_plugin=None,
        deepspeed_plugins=None,
        parallelism_config=None,
    ):
        refuse_features(megatron_lm_plugin=megatron_lm_plugin,
                        torch_tp_plugin=torch_tp_plugin, parallelism_config=parallelism_config)
        if parse_flag_from_env("ACCELERATE_USE_MEGATRON_LM"):
            raise NotImplementedError("ACCELERATE_USE_MEGATRON_LM=true: Megatron-LM is not supported by accelerate_c")
        ds_plugin = resolve_deepspeed_plugin(deepspeed_plugin, deepspeed_plugins)
        fsdp_plugin = resolve_fsdp_plugin(fsdp_plugin)
        if fsdp_plugin is not None and ds_plugin is not None:
            raise ValueError("Accelerator: a DeepSpeed plugin and an FSDP plugin at once; choose one")
        # backend NO (the default; transformers' Trainer always passes a plugin) compiles nothing
        dynamo = resolve_dynamo_plugin(dynamo_plugin, dynamo_backend)
        check_kind("project_config", project_config, ProjectConfiguration)
        check_kind("gradient_accumulation_plugin", gradient_accumulation_plugin, GradientAccumulationPlugin)
        check_kind("dataloader_config", dataloader_config, DataLoaderConfiguration)

        # project
        self.project_configuration = project_config or ProjectConfiguration(project_dir=project_dir)
        if project_dir is not None and self.project_configuration.project_dir is None:
            self.project_configuration.set_directories(project_dir)
        self.setup_trackers(log_with)  # accelerator_tracking.py

        # mixed precision: argument, then environment, then "no"
        if mixed_precision is None:
            mixed_precision = parse_choice_from_env("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = str(mixed_precision.value if isinstance(mixed_precision, PrecisionType) else mixed_precision)
        if mixed_precision not in PrecisionType.list():
            raise ValueError(f"Unknown mixed_precision mode: {mixed_precision!r}. Choose between "
                             f"{PrecisionType.list()}")
        if mixed_precision == "fp8":
            raise NotImplementedError("mixed_precision='fp8' is not supported by accelerate_c; use 'bf16' or 'fp16'")

        # kwargs handlers: one of each kind
        self.autocast_handler = None
        self.scaler_handler = None
        self.ddp_handler = None
        self.init_handler = None
        self.host_malloc_handler = None  # accelerate_c's own (host_malloc.py)
        self.cpu_comm_handler = None  # accelerate_c's own (collectives.select_cpu_comm)
        seen = set()
        for handler in kwargs_handlers or []:
            kind = kind_of(handler, _HANDLERS)  # ours, or accelerate's class of the same name
            if kind is None:
                raise NotImplementedError(f"kwargs handler {type(handler).__name__} is not supported yet by "
                                          f"accelerate_c (supported: {[h.__name__ for h in _HANDLERS]})")
            if kind in seen:
                raise ValueError(f"You can only pass one {kind.__name__} in `kwargs_handlers`.")
            seen.add(kind)
            if kind is AutocastKwargs:
                self.autocast_handler = handler
            elif kind is GradScalerKwargs:
                self.scaler_handler = handler
            elif kind is DistributedDataParallelKwargs:
                self.ddp_handler = handler
            elif kind is HostMallocKwargs:
                self.host_malloc_handler = handler
            elif kind is CpuCommKwargs:
                self.cpu_comm_handler = handler
            elif kind is ProfileKwargs:
                self.profile_handler = handler  # profile() (profiling.py)
            else:
                self.init_handler = handler

        cpu = bool(cpu) or parse_flag_from_env("ACCELERATE_USE_CPU")
        init_kwargs = self.init_handler.to_kwargs() if self.init_handler is not None else {}
        if self.cpu_comm_handler is not None:
            init_kwargs["cpu_comm"] = self.cpu_comm_handler.comm
        self.state = AcceleratorState(mixed_precision=mixed_precision, cpu=cpu, _from_accelerator=True,
                                      **init_kwargs)
        self.state.dynamo_plugin = dynamo  # where accelerate keeps it

        # gradient accumulation: argument or plugin, never both
        if gradient_accumulation_plugin is not None:
            if gradient_accumulation_steps != 1:
                raise ValueError("You can only pass one of `gradient_accumulation_steps` and "
                                 "`gradient_accumulation_plugin`: put num_steps in the plugin.")
        else:
            if gradient_accumulation_steps == 1:
                raw = parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "1")
                raw = "1" if raw == "auto" else raw  # a DeepSpeed config file's "auto": the DeepSpeed config decides
                try:
                    gradient_accumulation_steps = int(raw)
                except ValueError:
                    raise ValueError(f"ACCELERATE_GRADIENT_ACCUMULATION_STEPS={raw!r} is not an integer") from None
            gradient_accumulation_plugin = GradientAccumulationPlugin(num_steps=gradient_accumulation_steps)
        steps = gradient_accumulation_plugin.num_steps
        if steps is None:
            gradient_accumulation_plugin.num_steps = steps = 1
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be an integer >= 1, got {steps!r}")
        self.gradient_state = GradientState(gradient_accumulation_plugin=gradient_accumulation_plugin)

        # DeepSpeed: the whole configuration is read and checked here, each bad key with its own
        # error (deepspeed_config/). Its accumulation count and precision win over the
        # Accelerator's, as in accelerate. Unlike accelerate, which drops DeepSpeed under
        # cpu=True, the configuration holds on CPU processes too (gloo).
        self.sharding = None
        self.deepspeed_plugin = None  # accelerate's name: the active plugin under DeepSpeed, else None
        if ds_plugin is not None:
            self.sharding = sharding_from_config(ds_plugin, mixed_precision=mixed_precision,
                                                 gradient_accumulation_steps=steps,
                                                 num_processes=self.state.num_processes)
            if self.sharding.offload_param == "cpu" and self.state.device.type != "cpu":
                raise NotImplementedError("DeepSpeed zero_optimization.offload_param.device='cpu' on "
                                          f"{self.state.device}: parameter offload from a GPU is not built in "
                                          "accelerate_c yet (on CPU processes the parameters are on the CPU already)")
            if self.sharding.offload_optimizer == "cpu" and self.state.device.type != "cpu":
                raise NotImplementedError("DeepSpeed zero_optimization.offload_optimizer.device='cpu' on "
                                          f"{self.state.device}: optimizer offload from a GPU is not built in "
                                          "accelerate_c yet (on CPU processes the state is on the CPU already)")
            self.state.distributed_type = DistributedType.DEEPSPEED
            self.deepspeed_plugin = ds_plugin
            self.state.set_deepspeed_plugin(ds_plugin)
            mixed_precision = self.state.mixed_precision = self.sharding.mixed_precision
            if self.sharding.gradient_accumulation_steps != steps:
                steps = gradient_accumulation_plugin.num_steps = self.sharding.gradient_accumulation_steps
                self.gradient_state = GradientState(gradient_accumulation_plugin=gradient_accumulation_plugin)
        self._zero_stage = self.sharding.stage if self.sharding is not None else None
        self._fsdp = None  # FSDP: full sharding (strategies/fsdp.py), autocast as without it
        if fsdp_plugin is not None:
            self._fsdp = fsdp_settings(fsdp_plugin, mixed_precision, self.state.device.type)
            self.state.distributed_type = DistributedType.FSDP
            self.state.set_fsdp_plugin(fsdp_plugin, self._fsdp.version == 2)

        # data loaders
        if dataloader_config is None:
            dataloader_config = DataLoaderConfiguration()
        if split_batches is not _split_batches:
            dataloader_config.split_batches = bool(split_batches)
        if dataloader_config.use_stateful_dataloader:
            stateful_dataloader_class()  # torchdata missing: ImportError naming it, now rather than at prepare
        self.dataloader_config = dataloader_config
        self.device_placement = device_placement
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.rng_types = rng_types if rng_types is not None else ["generator"]

        # mixed precision machinery. A deliberate difference from accelerate 1.15, which trains
        # in fp32 when asked for fp16 on a CPU: we run fp16 autocast and loss scaling there too.
        # Under DeepSpeed there is no autocast: the engine trains the model itself in 16 bits
        # (params and gradients) with fp32 master weights in the optimizer (as accelerate's
        # DeepSpeed path does; strategies/zero.py)
        self.native_amp = mixed_precision in ("fp16", "bf16") and self.sharding is None
        self._compute_dtype = None  # the 16-bit dtype models are cast to under DeepSpeed
        if self.sharding is not None and mixed_precision != "no":
            self._compute_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        if mixed_precision == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError("mixed_precision='bf16' needs a GPU with bfloat16 support")
        self.scaler = None
        if mixed_precision == "fp16" and self.sharding is not None:
            # DeepSpeed's own rule (hysteresis, min_loss_scale), from the configuration's fp16 section
            if self.scaler_handler is not None:
                warnings.warn("GradScalerKwargs is not used under DeepSpeed: the DeepSpeed configuration's fp16 "
                              "section (initial_scale_power, loss_scale_window, hysteresis, min_loss_scale, "
                              "loss_scale) sets the loss scale, as in accelerate", stacklevel=2)
            self.scaler = DeepSpeedScaler(**self.sharding.ds_scaler_kwargs())
        elif mixed_precision == "fp16":
            kw = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            scaler = LossScaler(**kw)
            self.scaler = scaler if scaler.is_enabled() else None

        self.step = 0
        self._grads = GradManager()
        # a sharding plugin on one process keeps its flat buffers (its strategies are built on them)
        self._grads.allow_loose = self.sharding is None and self._fsdp is None
        # the C kernels use as many threads as torch's intra-op pool (the launcher sets
        # OMP_NUM_THREADS per process): never more threads than the cores the process was given
        _C.set_num_threads(max(1, torch.get_num_threads()))
        # opt-in only: process-wide (HostMallocKwargs / ACCELERATE_C_MALLOC_TUNING=1)
        host_malloc.apply(self.host_malloc_handler)
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._eval_only: set = set()  # id() of models prepared with evaluation_mode=True only
        self._custom_objects = []
        self.flag_tensor = None

    @classmethod
    def from_training_args(cls, args, **overrides) -> "Accelerator":
        """An Accelerator configured from transformers-style TrainingArguments (an
        accelerate_c.TrainingArguments, a dict of its fields, or a .json/.yaml file), mapped as
        transformers' Trainer maps them; `overrides` replace single constructor arguments.
        See docs/trainer.md for the table."""
        kwargs = accelerator_kwargs(load_training_args(args))
        kwargs.update(overrides)
        return cls(**kwargs)

    def prepare(self, *args, device_placement=None):
        """Prepares models, optimizers, data loaders and schedulers; returns them in order.
        Objects of other types come back unchanged."""
        if device_placement is None:
            device_placement = [None] * len(args)
        elif len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        built = ()  # positions of what the DeepSpeed configuration built in this call
        if self.sharding is not None:
            # accelerate's DeepSpeed preparation: "auto" values filled from this call's objects,
            # DummyOptim / DummyScheduler replaced by what the configuration describes
            given = args
            self.sharding, args = prepare_args(self.sharding, args, split_batches=self.split_batches)
            built = {i for i, (a, g) in enumerate(zip(args, given)) if a is not g}
        out = list(args)
        # models first, so their gradient buffers exist before optimizers are wrapped;
        # schedulers last, since they need the wrapped optimizers
        for kinds in ((torch.nn.Module,), (torch.optim.Optimizer, torch.utils.data.DataLoader),
                      (torch.optim.lr_scheduler.LRScheduler,)):
            for i, (obj, dp) in enumerate(zip(args, device_placement)):
                # prepared optimizers and loaders too (registered again after free_memory(), as
                # accelerate does); a prepared scheduler is no LRScheduler and passes through, as there
                if isinstance(obj, kinds):
                    out[i] = self._prepare_one(obj, dp, engine=i in built)
        return out[0] if len(out) == 1 else tuple(out)

    def _prepare_one(self, obj, device_placement, engine=False):
        if isinstance(obj, torch.nn.Module):
            return self.prepare_model(obj, device_placement=device_placement)
        if isinstance(obj, torch.optim.Optimizer):
            return self.prepare_optimizer(obj, device_placement=device_placement)
        if isinstance(obj, torch.utils.data.DataLoader):
            return self.prepare_data_loader(obj, device_placement=device_placement)
        return self.prepare_scheduler(obj, _engine=engine)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """Moves the model to the device, wraps its forward in autocast (fp32 outputs) under
        mixed precision and gives its trainable parameters flat gradient buffers."""
        if device_placement is None:
            device_placement = self.device_placement
        # a wrapper prepare() compiled stands for its model (prepared again after free_memory():
        # the model is, and the same wrapper is returned)
        given, made = model, made_by_prepare(model)
        model = made if made is not None else self._registered(model)
        if any(m is model for m in self._models):
            if evaluation_mode or id(model) not in self._eval_only:
                return given
            # prepared for evaluation first (the Trainer's evaluate() before train()): its
            # gradients get their buffers or shards now, or they would never be reduced
            self._eval_only.discard(id(model))
            self._grads.prepare_model(model, trainable=True)
            return given
        self._models.append(model)
        if evaluation_mode:
            self._eval_only.add(id(model))
        if device_placement and not getattr(model, "hf_device_map", None) and not (
                _on_meta(model) and self.use_distributed):
            # (a model on the meta device, on processes other than the main one, is placed by the
            # strategy: full sharding loads the main process's weights into it, the others refuse)
            model.to(self.device)
        if self._compute_dtype is not None and not evaluation_mode:  # accelerate leaves those as they are
            if not self.use_distributed:
                raise NotImplementedError(
                    f"DeepSpeed with {self.mixed_precision} on one process: the 16-bit model with fp32 master "
                    "weights is built for ZeRO on several processes only so far; launch 2 or more processes, or "
                    "drop the bf16/fp16 section of the DeepSpeed configuration")
            model.to(self._compute_dtype)  # as DeepSpeed's engine: parameters and buffers
            if self.sharding.fp16_auto_cast and not hasattr(model, "_ds_input_cast"):
                model._ds_input_cast = model.register_forward_pre_hook(_cast_inputs_half, with_kwargs=True)
        if self.use_distributed and not self._grads.distributed:
            h = self.ddp_handler
            if self._fsdp is not None:
                f = self._fsdp
                strategy = FullShardStrategy(self._grads, h, wrap_policy=f.wrap_policy, wrap_classes=f.wrap_classes,
                                             min_num_params=f.min_num_params, param_dtype=f.param_dtype,
                                             reshard_after_forward=f.reshard_after_forward,
                                             activation_checkpointing=f.activation_checkpointing,
                                             device=self.device,
                                             sharded_weights=f.state_dict_type == "SHARDED_STATE_DICT",
                                             # FSDP2 reduces the gradients a backward produced and
                                             # takes no find_unused_parameters flag: neither do we
                                             ignore_unused=True)
            elif self._zero_stage == 3:
                strategy = self._zero3_strategy(h)
            elif self._zero_stage in (1, 2):
                kind = Zero1Strategy if self._zero_stage == 1 else Zero2Strategy
                strategy = kind(self._grads, h, fp32_masters=self._compute_dtype is not None,
                                ignore_unused=self.sharding.ignore_unused_parameters)
            else:
                strategy = DDPStrategy(self._grads, h)
            self._grads.configure(strategy, h.bucket_cap_mb if h is not None else None)
        # the strategy's part (DDP: rank 0's weights to every replica, the per-forward
        # collectives), then flat gradient buffers for the trainable parameters
        try:
            self._grads.prepare_model(model, trainable=not evaluation_mode)
        except BaseException:
            # refused (a meta model under DDP, a structure that differs across processes): not
            # prepared, so preparing it again once fixed does the work instead of returning early
            self._models.remove(model)
            self._eval_only.discard(id(model))
            raise
        if self.native_amp and "_original_forward" not in model.__dict__:
            # in the instance's own dict: torch.compile's wrapper (a model compiled before
            # prepare()) would pass a new attribute on to the module inside it
            model.__dict__["_original_forward"] = model.forward
            kw = self.autocast_handler.to_kwargs() if self.autocast_handler is not None else None
            fwd = model.forward
            if hasattr(fwd, "__func__"):
                wrapped = AutocastForward(fwd.__func__, self.mixed_precision, self.device.type, kw)
                model.forward = MethodType(convert_outputs_to_fp32(wrapped, model), model)
            else:
                model.forward = convert_outputs_to_fp32(
                    AutocastForward(fwd, self.mixed_precision, self.device.type, kw), model)
        if made is not None:
            return given
        # last, as accelerate: the compiled region runs the wrapped forward; the model stays
        # registered uncompiled (_registered maps the compiled wrapper back to it). In place under
        # the DeepSpeed settings and for FSDP's regional compilation, as accelerate compiles there
        plugin = self.state.dynamo_plugin
        in_place = self._zero_stage is not None or (self._fsdp is not None and plugin.use_regional_compilation)
        if compiles(model, plugin) or is_compiled_module(model):  # (compiled by the user before prepare())
            self._grads.strategy.before_compile(model)
        return compile_prepared(model, plugin, in_place=in_place)

    def _registered(self, model):
        """The prepared model `model` stands for: itself, or the one inside torch.compile's
        wrapper when prepare() compiled it (the dynamo plugin)."""
        if any(m is model for m in self._models):
            return model
        inner = prepared_inner(model)
        return inner if inner is not None and any(m is inner for m in self._models) else model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if isinstance(optimizer, AcceleratedOptimizer):
            # prepared before: registered again if free_memory() dropped it (accelerate does,
            # for its find_executable_batch_size loop; transformers' Trainer re-prepares its
            # optimizer that way), so save_state includes it; under ZeRO-1/2, whose free_memory()
            # forgot the rebuilt optimizer, the strategy refuses it by name
            if all(opt is not optimizer for opt in self._optimizers):
                self._grads.strategy.prepare_optimizer(optimizer.optimizer)
                self._optimizers.append(optimizer)
            return optimizer
        if device_placement is None:
            device_placement = self.device_placement
        for opt in self._optimizers:
            if opt.optimizer is optimizer:
                return opt
        refuse_lomo(optimizer)
        self._grads.strategy.prepare_optimizer(optimizer)  # a sharding strategy rebuilds it in place
        clip = self._engine_clip if self.sharding is not None else None
        wrapped = AcceleratedOptimizer(optimizer, device_placement=device_placement, scaler=self.scaler,
                                       grads=self._grads, engine_clip=clip,
                                       unscale_in_place=self._compute_dtype is None)
        self._optimizers.append(wrapped)
        return wrapped

    def prepare_scheduler(self, scheduler, *, _engine=False):
        """`_engine`: built from the DeepSpeed configuration by this prepare() call, so the
        engine's, stepped once per optimizer step (AcceleratedScheduler.once_per_step)."""
        if isinstance(scheduler, AcceleratedScheduler):
            if all(s is not scheduler for s in self._schedulers):  # dropped by free_memory(): as accelerate
                self._schedulers.append(scheduler)
            return scheduler
        optimizer = self._optimizers
        for opt in self._optimizers:
            if getattr(scheduler, "optimizer", None) is opt.optimizer:
                optimizer = opt
                break
        wrapped = AcceleratedScheduler(scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
                                       split_batches=self.split_batches,
                                       once_per_step=_engine)
        self._schedulers.append(wrapped)
        return wrapped

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if isinstance(data_loader, (DataLoaderShard, DataLoaderDispatcher)):
            if all(d is not data_loader for d in self._dataloaders):  # dropped by free_memory(): as accelerate
                self._dataloaders.append(data_loader)
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        cfg = self.dataloader_config
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=self.num_processes, process_index=self.process_index,
            split_batches=cfg.split_batches, put_on_device=device_placement, rng_types=list(self.rng_types),
            dispatch_batches=cfg.dispatch_batches, even_batches=cfg.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=cfg.use_seedable_sampler,
            data_seed=cfg.data_seed, non_blocking=cfg.non_blocking and bool(data_loader.pin_memory),
            use_stateful_dataloader=cfg.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        return skip_first_batches(dataloader, num_batches=num_batches)

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables, even_batches=None):
        """Training on data loaders that give the processes different numbers of batches.

        `even_batches`, when given, overrides the Accelerator's for the prepared map-style
        data loaders inside the block (iterable ones warn, as in accelerate). With uneven
        batches, torch `Joinable`s among `joinables` (a DistributedDataParallel model, a
        ZeroRedundancyOptimizer) go through torch's Join, which shadows their collectives on
        the processes that ran out of data. Unlike accelerate, this works on several CPU (gloo)
        processes too; accelerate only does it on GPUs and warns elsewhere."""
        from torch.distributed.algorithms import Join, Joinable

        if not (self.use_distributed and self.distributed_type in (DistributedType.MULTI_GPU,
                                                                    DistributedType.MULTI_CPU)):
            if self.distributed_type != DistributedType.NO:
                warnings.warn("Joining uneven inputs is only supported for multi-GPU training, as a result "
                              "`join_uneven_inputs` will have no effect.")
            yield
            return
        saved = []
        if even_batches is not None:
            iterable_seen = False
            for dl in self._dataloaders:
                shard = _batch_sampler_shard(dl)
                if shard is None:
                    iterable_seen = True
                    continue
                saved.append((shard, shard.even_batches))
                shard.even_batches = even_batches
            if iterable_seen:
                warnings.warn("Overriding even_batches is only supported for map-style datasets, yet some "
                              "dataloaders given were iterable")
        else:
            even_batches = self.even_batches
        try:
            torch_joinables = []
            for j in joinables:
                if any(self._registered(j) is m for m in self._models):
                    # a prepared model: the reducer's Joinable shadows its collectives
                    torch_joinables.append(self._grads.start_join(self._registered(j)))
                elif isinstance(j, Joinable):
                    torch_joinables.append(j)
            if torch_joinables and not even_batches:
                with Join(torch_joinables, enable=True, throw_on_early_termination=False):
                    yield
            else:
                yield
        finally:
            self._grads.end_join()
            for shard, value in saved:
                shard.even_batches = value

    # ---- the step -----------------------------------------------------------------------
    def backward(self, loss, **kwargs):
        """loss / gradient_accumulation_steps (and x the loss scale under fp16), then backward."""
        if self._compute_dtype is not None:
            loss = loss.float()  # as DeepSpeed's engine: a 16-bit loss x 2**16 would overflow fp16
        loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        self._grads.average_pending_unbuffered()  # a raw sync backward's, before this one adds
        try:
            loss.backward(**kwargs)
            self._grads.finish_awaiting()
            self._grads.average_pending_unbuffered()
        except BaseException:
            self._grads.abort_backward()  # a failed backward must not leave buckets half-marked
            raise

    def _do_sync(self):
        if self.gradient_state.sync_with_dataloader and self.gradient_state.end_of_dataloader:
            self.step = 0
            self.gradient_state._set_sync_gradients(True)
        else:
            self.step += 1
            self.gradient_state._set_sync_gradients((self.step % self.gradient_state.num_steps) == 0)

    @contextlib.contextmanager
    def accumulate(self, *models):
        """Counts micro-steps: gradients sync (and optimizer/scheduler really step) every
        gradient_accumulation_steps batches and at the end of the data loader; in between, the
        given models do not communicate (unless GradientAccumulationPlugin(sync_each_batch=True))."""
        self._do_sync()
        self._grads.average_pending_unbuffered()  # a raw sync backward's, before the next one adds
        allow_sync = self.sync_gradients or (self.use_distributed and self.gradient_state.sync_each_batch)
        with contextlib.ExitStack() as stack:
            if not allow_sync:
                for m in models:
                    stack.enter_context(self.no_sync(m))
            yield

    @contextlib.contextmanager
    def no_sync(self, model):
        """Backward inside does not communicate: gradients accumulate locally in the buffers
        until a backward outside reduces the sum (a no-op on one process)."""
        self._grads.average_pending_unbuffered()  # a raw sync backward's, before a local one adds
        key = id(self._registered(model))
        depth = self._grads.no_sync_models
        depth[key] = depth.get(key, 0) + 1
        try:
            yield
        finally:
            depth[key] -= 1
            if not depth[key]:
                del depth[key]

    @contextlib.contextmanager
    def trigger_sync_in_backward(self, model):
        """Backward inside reduces gradients even under no_sync() or on an accumulation step."""
        self._grads.force_sync += 1
        try:
            yield
        finally:
            self._grads.force_sync -= 1

    @contextlib.contextmanager
    def autocast(self, autocast_handler: AutocastKwargs | None = None):
        """Runs the block under the Accelerator's mixed precision."""
        handler = autocast_handler or self.autocast_handler
        kw = handler.to_kwargs() if handler is not None else None
        with autocast_context(self.mixed_precision if self.native_amp else "no", self.device.type, kw):
            yield

    def _zero3_strategy(self, handler):
        """DeepSpeed's ZeRO stage 3 as full sharding, with its settings: units of at least
        stage3_prefetch_bucket_size elements (what DeepSpeed gathers ahead at once; a size-based
        wrap), parameters under stage3_param_persistence_threshold elements kept gathered
        through each forward and backward (in the root unit: DeepSpeed's persistent parameters,
        gathered once per step), the 16-bit model's fp32 masters as the shards (DeepSpeed's
        bf16 policy, as at stages 1 and 2), and between steps each parameter an empty tensor of
        the model's dtype, as DeepSpeed leaves its partitioned parameters. Defaults are
        DeepSpeed's; "auto" is filled from the model by prepare()."""
        s = self.sharding
        if s.stage3_prefetch_bucket_size is None or s.stage3_param_persistence_threshold is None:
            raise ValueError("DeepSpeed ZeRO stage 3: stage3_prefetch_bucket_size / stage3_param_persistence_threshold "
                             "are 'auto', which accelerator.prepare(model, ...) fills from the model's hidden size; "
                             "prepare the model through prepare(), or set integer values")
        return FullShardStrategy(self._grads, handler, wrap_policy="SIZE_BASED_WRAP",
                                 min_num_params=s.stage3_prefetch_bucket_size,
                                 persist_below=s.stage3_param_persistence_threshold,
                                 param_dtype=self._compute_dtype, device=self.device, empty_at_rest=True,
                                 ignore_unused=s.ignore_unused_parameters, sharded_weights=True)

    def gather(self, tensor):
        """Concatenates `tensor` (or each tensor of a nested structure) from all processes along
        dim 0 (0-dim tensors become 1-dim). Shapes must match across processes (pad first)."""
        return ops.gather(tensor)

    def gather_for_metrics(self, input_data, use_gather_object: bool = False):
        """gather(), minus the samples duplicated to fill the last batch (on one process too: its
        last batch cut to the samples that remain, as accelerate does)."""
        try:
            recursively_apply(lambda t: t, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        use_gather_object = use_gather_object or not all_tensors
        data = ops.gather_object(input_data) if use_gather_object else self.gather(input_data)
        gs = self.gradient_state
        # the last batch cut to the samples that remain, on any number of processes, as accelerate
        # does: across processes it drops the padding duplicates; on one process too, where a
        # caller that padded its input to the nominal batch size (transformers' evaluation loop
        # repeats each batch's loss eval_batch_size times) relies on it
        if gs.end_of_dataloader and gs.remainder > 0:
            if use_gather_object:
                return data[: gs.remainder]
            return recursively_apply(lambda t: t[: gs.remainder] if t.dim() > 0 else t, data)
        return data

    def reduce(self, tensor, reduction: str = "sum", scale: float = 1.0):
        """Sum, mean or max across processes ('none': a copy). `scale` is accepted for
        accelerate compatibility; like accelerate off XLA, it is not applied."""
        return ops.reduce(tensor, reduction)

    def pad_across_processes(self, tensor, dim: int = 0, pad_index=0, pad_first: bool = False):
        """Pads to the largest size along `dim` across processes."""
        return ops.pad_across_processes(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first)

    # ---- models and memory ---------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        """The model as the user built it (utils.extract_model_from_parallel, as accelerate's):
        out of DDP / DataParallel / FSDP containers (accelerate_c wraps nothing, a user's script
        may), without the fp32-output/autocast forward unless keep_fp32_wrapper, without
        torch.compile's wrapper unless keep_torch_compile."""
        return extract_model_from_parallel(model, keep_fp32_wrapper, keep_torch_compile)

    # ---- checkpoints (accelerate_c/checkpointing.py; layout in docs/checkpoints.md) ----------
    def save(self, obj, f, safe_serialization: bool = False):
        """torch.save (or, with safe_serialization, a safetensors file for a dict of tensors)
        once per machine; paths are written atomically."""
        return checkpointing.save(self, obj, f, safe_serialization=safe_serialization)

    def save_model(self, model, save_directory, max_shard_size="10GB", safe_serialization: bool = True):
        """The unwrapped model's weights in the Hugging Face layout (model.safetensors or shards +
        index), written by the main process, atomically."""
        return checkpointing.save_model(self, model, save_directory, max_shard_size=max_shard_size,
                                        safe_serialization=safe_serialization)

    def full_optimizer_state_dict(self, optimizer, timeout_s: float = 60.0) -> dict:
        """The whole optimizer state in torch's layout (what the unsharded optimizer's
        state_dict() gives; loadable into a plain torch optimizer over the model's parameters).
        Under ZeRO `optimizer.state_dict()` is this process's shard, without a collective, as
        DeepSpeed's; this gathers every process's: a collective every process must call (one
        that calls it alone gets an error naming the missing processes after `timeout_s`).
        Without sharding it is `optimizer.state_dict()`."""
        opt = getattr(optimizer, "optimizer", optimizer)
        strategy = self._grads.strategy
        if not strategy.sharded_state:
            return opt.state_dict()
        return strategy.full_optimizer_state_dict(opt, timeout_s)

    def get_state_dict(self, model, unwrap: bool = True, *, keep: bool | None = None):
        """The model's full state dict (a collective under full sharding, which gathers it to the
        main process and gives {} elsewhere, as accelerate's FSDP2 path; None under DeepSpeed
        stage 3, as DeepSpeed's consolidated 16-bit state dict; `keep`, an accelerate_c addition:
        whether this process needs it, e.g. every node's writer under save_on_each_node)."""
        if self._zero_stage == 3:
            # DeepSpeed stage 3, as accelerate: the 16-bit weights, gathered to the main process
            # (None on the others), only when the configuration asks for them on save
            if not self.sharding.stage3_gather_16bit_weights_on_model_save:
                raise ValueError("get_state_dict / save_model under DeepSpeed ZeRO stage 3 gather the 16-bit weights "
                                 "only when zero_optimization.stage3_gather_16bit_weights_on_model_save is true "
                                 "(DeepSpeedPlugin(zero3_save_16bit_model=True)); save_state saves everything "
                                 "without it, and `accelerate-c merge-weights` turns that into full weights")
            sd = checkpointing.get_state_dict(self, model, self._grads.strategy, unwrap=unwrap, keep=keep)
            if not (self.is_main_process if keep is None else keep):
                return None  # DeepSpeed's consolidated 16-bit state dict is None off the main process
            dtype, cast = self._compute_dtype, {}
            for k, v in sd.items():
                if dtype is not None and v.is_floating_point():
                    if id(v) not in cast:  # a tied weight stays one tensor under its names, as DeepSpeed keeps it
                        cast[id(v)] = v.to(dtype)
                    sd[k] = cast[id(v)]
            return sd
        if self._fsdp is not None:
            # the FSDP2 path of accelerate (torch's get_model_state_dict, which drops a compiled
            # wrapper's `_orig_mod.`): the keys of the model inside the wrapper, whether
            # prepare() or the user compiled it
            sd = checkpointing.get_state_dict(self, self._registered(model), self._grads.strategy, unwrap=unwrap,
                                              keep=keep)
            return plain_keys(sd)
        return checkpointing.get_state_dict(self, model, self._grads.strategy, unwrap=unwrap, keep=keep)

    def register_for_checkpointing(self, *objects):
        """Objects with state_dict/load_state_dict that save_state/load_state also keep."""
        return checkpointing.register_for_checkpointing(self, *objects)

    def register_save_state_pre_hook(self, hook):
        """hook(models, weights, output_dir) before save_state writes; returns a handle with .remove()."""
        return checkpointing.register_save_state_pre_hook(self, hook)

    def register_load_state_pre_hook(self, hook):
        """hook(models, input_dir) before load_state reads; returns a handle with .remove()."""
        return checkpointing.register_load_state_pre_hook(self, hook)

    def save_state(self, output_dir=None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Saves models, optimizers, schedulers, scaler, RNG states, data loader positions and
        registered objects; the directory appears complete or not at all."""
        self._grads.strategy.refuse_checkpoint("save_state")
        return checkpointing.save_state(self, output_dir, safe_serialization=safe_serialization,
                                        **save_model_func_kwargs)

    def load_state(self, input_dir=None, load_kwargs=None, allow_pickle: bool = False, **load_model_func_kwargs):
        """Loads what save_state (or accelerate's save_state) wrote; input_dir=None with automatic
        checkpoint naming takes the newest complete checkpoint."""
        self._grads.strategy.refuse_checkpoint("load_state")
        return checkpointing.load_state(self, input_dir, load_kwargs=load_kwargs, allow_pickle=allow_pickle,
                                        **load_model_func_kwargs)

    def free_memory(self, *objects):
        """Drops the Accelerator's references to prepared objects (gradient buffers included)
        and empties caches; returns `objects` as Nones, for `a, b = accelerator.free_memory(a, b)`."""
        self._grads.clear()
        self._models, self._optimizers, self._schedulers, self._dataloaders = [], [], [], []
        self._eval_only = set()
        self._custom_objects = []
        self.step = 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None for _ in objects]

    def clear(self, *objects):
        return self.free_memory(*objects)

    def __repr__(self):
        return (f"Accelerator(device={self.device}, mixed_precision={self.mixed_precision!r}, "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, "
                f"num_processes={self.num_processes})")


def create_accelerator(args) -> Accelerator:
    """An Accelerator configured from TrainingArguments (or a dict / JSON / YAML path of its
    fields), as transformers' Trainer builds its own."""
    return Accelerator.from_training_args(args)
