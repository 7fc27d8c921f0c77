"""Which DeepSpeed config keys accelerate_c takes, and the errors for the others.

Three kinds of keys: those that set the run (batch sizes, accumulation, clipping, ZeRO stage,
offload, bucket sizes, fp16/bf16, the optimizer and scheduler blocks); those DeepSpeed accepts
that change no number accelerate_c computes (logging, timers, overlap and layout switches of its
communication), accepted and ignored; and those asking for something accelerate_c has not built
(NVMe offload, ZeRO++, MiCS, MoE, pipeline/tensor parallelism, ...), refused with an error
naming the key path and the file the config came from. A key that is none of these is refused as
unknown, so a typo is not silently ignored.
"""
from __future__ import annotations

import math

from .config_dict import AUTO, where


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed config accelerate_c cannot read: a wrong value or an unknown key."""


class DeepSpeedFeatureError(DeepSpeedConfigError, NotImplementedError):
    """A valid DeepSpeed config that asks for a feature accelerate_c has not built."""


# the "auto" values something fills: the Accelerator and its data loader (accelerate's
# _prepare_deepspeed) or TrainingArguments (transformers' Trainer); any other "auto" has nothing
# to take its value from
FILLABLE = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
    "fp16.enabled", "bf16.enabled", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save", "optimizer.params.lr",
    "optimizer.params.weight_decay", "optimizer.params.betas", "optimizer.params.eps",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
})

OPTIMIZERS = ("AdamW", "Adam", "SGD")
SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
STAGES = (0, 1, 2, 3)

# DeepSpeed features, by their top-level key, that accelerate_c has not built
_TOP_FEATURES = {
    "aio": "NVMe offload (asynchronous I/O)", "elasticity": "elastic training", "pipeline": "pipeline parallelism",
    "tensor_parallel": "tensor parallelism (AutoTP)", "sequence_parallel_size": "sequence parallelism",
    "compression_training": "compression training", "curriculum_learning": "curriculum learning",
    "data_efficiency": "data efficiency", "autotuning": "autotuning", "nebula": "Nebula checkpointing",
    "weight_quantization": "weight quantization", "quantize_training": "quantized training",
    "sparse_attention": "sparse attention", "eigenvalue": "eigenvalue computation",
    "progressive_layer_drop": "progressive layer drop", "data_types": "a gradient accumulation dtype",
    "dataloader_drop_last": "DeepSpeed's data loader", "hybrid_engine": "the hybrid engine",
    "compile": "DeepSpeed's compile", "msamp": "fp8 training (MS-AMP)", "fp8": "fp8 training",
    "moe": "mixture of experts (MoE)", "use_data_before_expert_parallelism": "mixture of experts (MoE)",
    "graph_harvesting": "graph harvesting", "seq_parallel_comm_data_type": "sequence parallelism",
    "disable_allgather": "disable_allgather", "zenflow": "ZenFlow",
}
# sections that only switch on monitoring or profiling: accepted while not enabled
_MONITORS = ("flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "amp")


class _Check:
    def __init__(self, source, stage):
        self.source = source
        self.stage = stage

    def bad(self, path, value, why):
        raise DeepSpeedConfigError(f"DeepSpeed config{where(self.source)}: {path}={value!r}: {why}")

    def feature(self, path, value, what, hint=""):
        raise DeepSpeedFeatureError(f"DeepSpeed config{where(self.source)}: {path}={value!r}: {what} is not "
                                    f"supported by accelerate_c{'; ' + hint if hint else ''}")

    def unknown(self, path, value, known):
        raise DeepSpeedConfigError(f"DeepSpeed config{where(self.source)}: unknown key {path!r} (= {value!r}); "
                                   f"accelerate_c takes: {', '.join(sorted(known))}")

    # ---- value kinds
    def auto_ok(self, path, value) -> bool:
        """Whether value is an "auto" that something fills (then nothing else is checked)."""
        if value != AUTO:
            return False
        if path not in FILLABLE:
            self.bad(path, value, "nothing fills 'auto' for this key (neither the Accelerator nor TrainingArguments);"
                                  " set a value")
        return True

    def number(self, path, value, lo=None, hi=None, positive=False, integer=False):
        if self.auto_ok(path, value):
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (isinstance(value, float) and
                                                                              math.isnan(value)):
            self.bad(path, value, f"expected {'an integer' if integer else 'a number'}")
        if integer and not float(value).is_integer():
            self.bad(path, value, "expected a whole number")
        if (lo is not None and value < lo) or (hi is not None and value > hi) or (positive and value <= 0):
            rng = "> 0" if positive else (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}")
            self.bad(path, value, f"out of range; allowed: {rng}")

    def count(self, path, value):
        self.number(path, value, lo=1, integer=True)

    def flag(self, path, value):
        if not self.auto_ok(path, value) and not isinstance(value, bool):
            self.bad(path, value, "expected true or false")

    def only(self, path, value, allowed, what, hint=""):
        """A key accepted at the values that leave a feature off."""
        if value not in allowed:
            self.feature(path, value, what, hint)

    def section(self, path, value):
        if not isinstance(value, dict):
            self.bad(path, value, "expected a mapping")
        return value


def check_config(config: dict, source: str | None = None) -> int:
    """Raises DeepSpeedConfigError / DeepSpeedFeatureError for the first key accelerate_c
    cannot run; returns the ZeRO stage."""
    zero = config.get("zero_optimization")
    c = _Check(source, 0)
    if not isinstance(zero, dict):
        c.bad("zero_optimization", zero, "expected a mapping with the ZeRO stage, e.g. {\"stage\": 2}")
    stage = zero.get("stage", 0)  # DeepSpeed's default
    if isinstance(stage, bool) or stage not in STAGES:
        c.bad("zero_optimization.stage", stage, f"unknown ZeRO stage; allowed: {', '.join(map(str, STAGES))}")
    c.stage = stage = int(stage)
    for key, value in config.items():
        if key in _TOP:
            _TOP[key](c, key, value)
        elif key in _TOP_FEATURES:
            hint = "offload to 'cpu' or 'none'" if key == "aio" else ""
            c.feature(key, value, _TOP_FEATURES[key], hint)
        elif key in _MONITORS:
            if isinstance(value, dict) and value.get("enabled", False) is not False:
                c.feature(f"{key}.enabled", value.get("enabled"), f"DeepSpeed's {key}",
                          "set enabled to false (accelerate_c neither profiles nor logs through DeepSpeed)")
            c.section(key, value)
        else:
            c.unknown(key, value, set(_TOP) | set(_MONITORS))
    return stage


def _noop(c, path, value):
    """Accepted, changes nothing accelerate_c computes (printing, timers, DeepSpeed's own
    bookkeeping, or the model-side activation checkpointing API a script calls itself)."""


def _zero(c, path, section):
    for key, value in section.items():
        p = f"{path}.{key}"
        if key == "stage":
            continue
        if key in ("offload_optimizer", "offload_param"):
            _offload(c, p, c.section(p, value), key)
        elif key in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size") or key.startswith("stage3_") \
                and not isinstance(value, bool):
            # bucket sizes count elements, as in DeepSpeed; the stage-3 sizes only matter at stage 3
            c.number(p, value, lo=1 if key.endswith("bucket_size") else 0, integer=True)
        elif key in _ZERO_NOOP or key.startswith("stage3_"):
            c.flag(p, value)
        elif key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
            c.only(p, value, (False,), "ZeRO++ quantization")
        elif key == "zero_hpz_partition_size":
            c.only(p, value, (0, 1), "ZeRO++ hierarchical partitioning")
        elif key == "mics_shard_size":
            c.only(p, value, (-1, 0), "MiCS sharding")
        elif key == "mics_hierarchical_params_gather":
            c.only(p, value, (False,), "MiCS sharding")
        elif key in ("legacy_stage1", "pipeline_loading_checkpoint"):
            c.only(p, value, (False,), key)
        elif key in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory"):
            c.feature(p, value, "this deprecated spelling",
                      "write zero_optimization.offload_optimizer: {\"device\": \"cpu\"} instead")
        else:
            c.unknown(p, value, {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
                                 "allgather_bucket_size", "sub_group_size", "ignore_unused_parameters", *_ZERO_NOOP,
                                 "stage3_*"})


# switches of DeepSpeed's communication and memory layout: the gradients and updates are the same
_ZERO_NOOP = ("contiguous_gradients", "overlap_comm", "reduce_scatter", "allgather_partitions",
              "round_robin_gradients", "use_multi_rank_bucket_allreduce", "load_from_fp32_weights",
              "elastic_checkpoint", "memory_efficient_linear", "override_module_apply",
              "log_trace_cache_warnings")
# offload settings that only exist for NVMe
_NVME_ONLY = ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline", "pipeline_read",
              "pipeline_write")


def _offload(c, path, section, kind):
    device = section.get("device", "none")
    p = f"{path}.device"
    if device == "nvme":
        c.feature(p, device, "NVMe offload", "use 'cpu' or 'none'")
    if device not in ("none", "cpu"):
        c.bad(p, device, "allowed: 'none', 'cpu' ('nvme' is not supported)")
    if device == "cpu" and kind == "offload_param" and c.stage < 3:
        c.feature(p, device, f"parameter offload at ZeRO stage {c.stage}",
                  "offload_param needs ZeRO stage 3; use offload_optimizer to offload at stages 1 and 2")
    if device == "cpu" and c.stage == 0:
        c.feature(p, device, "offload without ZeRO (stage 0)", "use ZeRO stage 1 or 2")
    for key, value in section.items():
        q = f"{path}.{key}"
        if key == "device":
            continue
        if key == "nvme_path":
            c.only(q, value, (None, "none"), "NVMe offload")
        elif key in _NVME_ONLY:
            c.feature(q, value, "NVMe offload", f"{key} only applies to NVMe offload; remove it")
        elif key == "pin_memory":
            c.flag(q, value)  # host memory kind: the same numbers either way
        elif key == "ratio":
            c.only(q, value, (1, 1.0), "partial optimizer offload (ratio < 1)")
        else:
            c.unknown(q, value, {"device", "nvme_path", "pin_memory", "ratio"})


def _fp16(c, path, section):
    for key, value in section.items():
        p = f"{path}.{key}"
        if key in ("enabled", "auto_cast", "consecutive_hysteresis"):
            c.flag(p, value)
        elif key == "loss_scale":
            c.number(p, value, lo=0)  # 0: dynamic scaling
        elif key == "initial_scale_power":
            c.number(p, value, lo=0, hi=126, integer=True)
        elif key in ("loss_scale_window", "hysteresis"):
            c.count(p, value)
        elif key == "min_loss_scale":
            c.number(p, value, positive=True)
        elif key == "fp16_master_weights_and_grads":
            c.only(p, value, (False,), "fp16 master weights and gradients")
        else:
            c.unknown(p, value, {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                                 "hysteresis", "consecutive_hysteresis", "min_loss_scale"})


def _bf16(c, path, section):
    for key, value in section.items():
        if key == "enabled":
            c.flag(f"{path}.enabled", value)
        else:
            c.unknown(f"{path}.{key}", value, {"enabled"})


def _optimizer(c, path, section):
    kind = section.get("type")
    canonical = {o.lower(): o for o in OPTIMIZERS}.get(str(kind).lower())
    if canonical is None:
        c.feature(f"{path}.type", kind, f"the {kind} optimizer" if isinstance(kind, str) else "an optimizer block "
                  "without a type", f"supported types: {', '.join(OPTIMIZERS)}; or remove the block and pass your own "
                  "torch optimizer to prepare()")
    for key, value in section.items():
        if key == "legacy_fusion":
            c.only(f"{path}.{key}", value, (False,), "legacy fusion")
        elif key not in ("type", "params"):
            c.unknown(f"{path}.{key}", value, {"type", "params"})
    params = c.section(f"{path}.params", section.get("params", {}))
    adam = canonical in ("Adam", "AdamW")
    for key, value in params.items():
        p = f"{path}.params.{key}"
        if key in ("lr", "weight_decay") or (key == "momentum" and not adam) or (key == "dampening" and not adam):
            c.number(p, value, lo=0)
        elif adam and key == "eps":
            c.number(p, value, positive=True)
        elif adam and key == "betas":
            if not c.auto_ok(p, value):
                if not (isinstance(value, (list, tuple)) and len(value) == 2):
                    c.bad(p, value, "expected two numbers [beta1, beta2]")
                for i, b in enumerate(value):
                    c.number(f"{p}[{i}]", b, lo=0, hi=1)
        elif (adam and key in ("adam_w_mode", "torch_adam")) or (not adam and key == "nesterov"):
            c.flag(p, value)
        elif adam and key == "bias_correction":
            c.only(p, value, (True,), "Adam without bias correction")
        elif adam and key == "amsgrad":
            c.only(p, value, (False,), "AMSGrad (DeepSpeed's Adam does not have it either)")
        elif key == "max_grad_norm":
            c.bad(p, value, "not an optimizer parameter (DeepSpeed refuses it too); set the top-level "
                            "gradient_clipping instead")
        else:
            known = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction",
                     "amsgrad") if adam else ("lr", "momentum", "dampening", "weight_decay", "nesterov")
            c.unknown(p, value, set(known))
    if not adam and params.get("nesterov") is True and not (
            params.get("momentum", 0) not in (0, AUTO) and params.get("dampening", 0) == 0):
        c.bad(f"{path}.params.nesterov", True, "Nesterov momentum needs momentum > 0 and dampening 0")


_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                      "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}


def _scheduler(c, path, section):
    kind = section.get("type")
    if kind not in SCHEDULERS:
        c.feature(f"{path}.type", kind, f"the {kind} schedule" if isinstance(kind, str) else "a scheduler block "
                  "without a type", f"supported types: {', '.join(SCHEDULERS)}; or remove the block and pass your "
                  "own torch scheduler to prepare()")
    for key, value in section.items():
        if key not in ("type", "params"):
            c.unknown(f"{path}.{key}", value, {"type", "params"})
    params = c.section(f"{path}.params", section.get("params", {}))
    for key, value in params.items():
        p = f"{path}.params.{key}"
        if key in ("warmup_min_lr", "warmup_max_lr") and key in _SCHEDULER_PARAMS[kind]:
            for i, v in enumerate(value if isinstance(value, (list, tuple)) else [value]):  # one per param group
                c.number(p if not isinstance(value, (list, tuple)) else f"{p}[{i}]", v, lo=0)
        elif key in ("warmup_min_ratio", "cos_min_ratio") and key in _SCHEDULER_PARAMS[kind]:
            c.number(p, value, lo=0, hi=1)
        elif key == "warmup_num_steps":
            c.number(p, value, lo=0, integer=True)
        elif key == "total_num_steps" and key in _SCHEDULER_PARAMS[kind]:
            c.count(p, value)
        elif key == "warmup_type":
            if value not in ("log", "linear"):
                c.bad(p, value, "allowed: 'log', 'linear'")
        elif key == "last_batch_iteration":
            c.only(p, value, (-1,), "starting a schedule part-way (resume through load_state instead)")
        else:
            c.unknown(p, value, set(_SCHEDULER_PARAMS[kind]))
    if "total_num_steps" in _SCHEDULER_PARAMS[kind] and "total_num_steps" not in params:
        c.bad(f"{path}.params.total_num_steps", None, f"{kind} needs total_num_steps (a number, or \"auto\" with a "
                                                      "DummyScheduler(total_num_steps=...))")


def _steps_per_print(c, path, value):
    # accelerate writes float("inf") here to silence DeepSpeed
    c.number(path, value, lo=0)


def _clipping(c, path, value):
    c.number(path, value, lo=0)


def _bfloat16(c, path, value):
    c.bad(path, value, "DeepSpeed's older name for the bf16 section; rename it to \"bf16\"")


def _checkpoint(c, path, section):
    for key, value in c.section(path, section).items():
        if key == "tag_validation":
            if value not in ("Ignore", "Warn", "Fail", "IGNORE", "WARN", "FAIL", "ignore", "warn", "fail"):
                c.bad(f"{path}.{key}", value, "allowed: 'Ignore', 'Warn', 'Fail'")
        elif key == "use_node_local_storage":
            c.flag(f"{path}.{key}", value)  # where checkpoints go, not what they hold
        elif key in ("load_universal", "parallel_write"):
            c.only(f"{path}.{key}", value, (False, None, {}), f"DeepSpeed's checkpoint {key}")
        else:
            c.unknown(f"{path}.{key}", value, {"tag_validation", "use_node_local_storage"})


def _off(value_off, what):
    def check(c, path, value):
        c.only(path, value, value_off, what)
    return check


_TOP = {
    "train_batch_size": _Check.count, "train_micro_batch_size_per_gpu": _Check.count,
    "gradient_accumulation_steps": _Check.count, "gradient_clipping": _clipping,
    "zero_optimization": lambda c, p, v: _zero(c, p, v),
    "fp16": lambda c, p, v: _fp16(c, p, c.section(p, v)), "bf16": lambda c, p, v: _bf16(c, p, c.section(p, v)),
    "bfloat16": _bfloat16,
    "optimizer": lambda c, p, v: _optimizer(c, p, c.section(p, v)),
    "scheduler": lambda c, p, v: _scheduler(c, p, c.section(p, v)),
    "steps_per_print": _steps_per_print, "wall_clock_breakdown": _Check.flag, "memory_breakdown": _Check.flag,
    "dump_state": _Check.flag, "zero_allow_untested_optimizer": _Check.flag,
    "zero_force_ds_cpu_optimizer": _Check.flag, "activation_checkpointing": _noop, "checkpoint": _checkpoint,
    "prescale_gradients": _off((False,), "prescaled gradients"),
    "gradient_predivide_factor": _off((1, 1.0), "a gradient predivide factor"),
    "sparse_gradients": _off((False,), "sparse gradients"),
    "communication_data_type": _off((None,), "a communication dtype other than the gradients'"),
}
