"""The keys of an accelerate config file (accelerate 1.15's ClusterConfig), as a table.

Each key says which YAML types it takes, its allowed values or range, its default, and which of
its values accelerate_c can run today (`supported`). The loader (utils/config.py) validates a file
against this table; the launcher refuses any value outside `supported` with "not supported yet".
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .dataclasses import DistributedType, DynamoBackend, PrecisionType

ANY = object()  # `supported`: every valid value is supported

DISTRIBUTED_TYPES = tuple(d.value for d in DistributedType)  # the enum the Accelerator reports
# DEEPSPEED launches (its configuration is read and checked); ZeRO itself is docs/sharding.md's
SUPPORTED_DISTRIBUTED_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP")
# features that are on the roadmap vs. hardware accelerate_c does not target
PLANNED_DISTRIBUTED_TYPES = ("MEGATRON_LM",)
COMPUTE_ENVIRONMENTS = ("LOCAL_MACHINE", "AMAZON_SAGEMAKER")
# the values the Accelerator and the launcher take (PrecisionType), in accelerate's menu order
MIXED_PRECISIONS = ("no", "fp16", "bf16", "fp8")
assert set(MIXED_PRECISIONS) == set(PrecisionType.list()), "config_schema and PrecisionType disagree"
DYNAMO_BACKENDS = tuple(DynamoBackend.list())
DYNAMO_MODES = ("default", "reduce-overhead", "max-autotune")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")  # torchrun's registered rendezvous backends
FSDP_SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
FSDP_AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
FSDP_BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
FSDP_STATE_DICT_TYPES = ("FULL_STATE_DICT", "LOCAL_STATE_DICT", "SHARDED_STATE_DICT")
DEEPSPEED_LAUNCHERS = ("pdsh", "standard", "openmpi", "mvapich", "mpich", "nossh", "slurm")
OFFLOAD_DEVICES = ("none", "cpu", "nvme")

_GPU_IDS = re.compile(r"^(all|\d+(\s*,\s*\d+)*)$")


@dataclass(frozen=True)
class Key:
    """One config key. `types`: names among bool/int/float/str/strlist/dict. `choices` restricts
    strings (or ints when given as ints); `lo`/`hi` bound numbers; `pattern` checks strings;
    `nullable`: YAML null is allowed (accelerate types it Optional). `supported`: the values
    accelerate_c runs today (ANY: all of them); `feature`: named in the "not supported" error."""

    name: str
    types: tuple
    default: object = None
    choices: tuple | None = None
    lo: float | None = None
    hi: float | None = None
    pattern: object = None
    nullable: bool = False
    supported: object = ANY
    feature: str = ""
    sub: dict | None = None  # for dicts: the schema of their keys; sub_prefix: accelerate adds it
    sub_prefix: str = ""
    hint: str = ""  # replaces the generated description of the allowed values

    def describe(self) -> str:
        """The allowed values, for error messages."""
        if self.hint:
            return self.hint
        parts = []
        if self.choices is not None:
            parts.append("one of " + ", ".join(repr(c) for c in self.choices))
        elif "dict" in self.types:
            parts.append("a mapping" + (f" with keys among {sorted(self.sub)}" if self.sub else ""))
        else:
            names = {"boollist": "a list of true/false", "bool": "true/false", "int": "an integer", "float": "a number", "str": "a string",
                     "strlist": "a list of strings"}
            parts.append(" or ".join(names[t] for t in self.types))
            if self.lo is not None and self.hi is not None:
                parts.append(f"in [{_num(self.lo)}, {_num(self.hi)}]")
            elif self.lo is not None:
                parts.append(f">= {_num(self.lo)}")
        if self.pattern is not None:
            parts.append(f"matching {self.pattern}")
        if self.nullable:
            parts.append("or null")
        return " ".join(parts)


def _num(x):
    return int(x) if float(x).is_integer() else x


def _keys(*keys) -> dict:
    return {k.name: k for k in keys}


B, I, F, S, L = ("bool",), ("int",), ("float",), ("str",), ("strlist",)

FSDP_KEYS = _keys(
    Key("fsdp_version", ("int", "str"), 1, choices=(1, 2, "1", "2")),
    Key("fsdp_offload_params", B, False),
    Key("fsdp_cpu_offload", B, False),  # spelling used in accelerate's FSDP2 docs examples
    Key("fsdp_min_num_params", I, 100_000_000, lo=0),
    Key("fsdp_sharding_strategy", ("str", "int"), "FULL_SHARD", choices=FSDP_SHARDING_STRATEGIES + (1, 2, 3, 4, 5),
        supported=("FULL_SHARD", "SHARD_GRAD_OP", 1, 2), feature="this FSDP sharding strategy"),
    Key("fsdp_reshard_after_forward", ("bool", "str"), True, choices=(True, False) + FSDP_SHARDING_STRATEGIES),
    Key("fsdp_auto_wrap_policy", S, None, choices=FSDP_AUTO_WRAP_POLICIES, nullable=True),
    Key("fsdp_transformer_layer_cls_to_wrap", ("str", "strlist"), None, nullable=True),
    Key("fsdp_backward_prefetch", S, None, choices=FSDP_BACKWARD_PREFETCH, nullable=True),
    Key("fsdp_backward_prefetch_policy", S, None, choices=FSDP_BACKWARD_PREFETCH, nullable=True),  # older name
    Key("fsdp_state_dict_type", S, None, choices=FSDP_STATE_DICT_TYPES, nullable=True),
    Key("fsdp_forward_prefetch", B, False),
    Key("fsdp_use_orig_params", B, True),
    Key("fsdp_cpu_ram_efficient_loading", B, True),
    Key("fsdp_sync_module_states", B, True),
    Key("fsdp_activation_checkpointing", B, False),
    Key("fsdp_activation_checkpointing_offload", B, False),
    Key("fsdp_ignored_modules", S, None, nullable=True),
)

# `supported` holds upper-cased strings (utils.config.unsupported compares them so)
DEEPSPEED_KEYS = _keys(
    Key("deepspeed_config_file", S, None, nullable=True),
    Key("zero_stage", I, 2, lo=0, hi=3),
    Key("offload_optimizer_device", S, "none", choices=OFFLOAD_DEVICES, supported=("NONE", "CPU"),
        feature="NVMe offload"),
    # cpu needs zero_stage 3 (the launcher checks the pair), as offload_param in a DeepSpeed JSON
    Key("offload_param_device", S, "none", choices=OFFLOAD_DEVICES, supported=("NONE", "CPU"),
        feature="NVMe offload"),
    Key("offload_optimizer_nvme_path", S, None, nullable=True, supported=(None, "NONE"), feature="NVMe offload"),
    Key("offload_param_nvme_path", S, None, nullable=True, supported=(None, "NONE"), feature="NVMe offload"),
    Key("gradient_accumulation_steps", ("int", "str"), 1, lo=1, pattern="auto"),
    Key("gradient_clipping", ("float", "str"), None, lo=0, pattern="auto", nullable=True),
    Key("zero3_init_flag", B, False),
    Key("zero3_save_16bit_model", B, False),
    Key("deepspeed_hostfile", S, None, nullable=True),
    Key("deepspeed_exclusion_filter", S, None, nullable=True),
    Key("deepspeed_inclusion_filter", S, None, nullable=True),
    Key("deepspeed_multinode_launcher", S, None, choices=DEEPSPEED_LAUNCHERS, nullable=True),
    Key("deepspeed_moe_layer_cls_names", S, None, nullable=True, supported=(None,),
        feature="DeepSpeed mixture of experts (MoE)"),
)

_MEGATRON_INT = ("tp_degree", "pp_degree", "num_micro_batches", "decoder_last_pipeline_num_layers",
                 "recompute_num_layers", "expert_model_parallel_size", "context_parallel_size",
                 "expert_tensor_parallel_size")
_MEGATRON_BOOL = ("sequence_parallelism", "recompute_activations", "use_distributed_optimizer", "use_custom_fsdp",
                  "no_load_optim", "eod_mask_loss", "overlap_cpu_optimizer_d2h_h2d", "no_save_optim",
                  "optimizer_cpu_offload", "use_precision_aware_optimizer", "attention_softmax_in_fp32",
                  "calculate_per_token_loss", "use_rotary_position_embeddings")
MEGATRON_KEYS = _keys(
    *(Key("megatron_lm_" + n, I, None, lo=1, nullable=True) for n in _MEGATRON_INT),
    *(Key("megatron_lm_" + n, B, None, nullable=True) for n in _MEGATRON_BOOL),
    *(Key("megatron_lm_" + n, F, None, lo=0, nullable=True)
      for n in ("gradient_clipping", "attention_dropout", "hidden_dropout")),
    *(Key("megatron_lm_" + n, S, None, nullable=True)
      for n in ("recompute_granularity", "recompute_method", "attention_backend")),
)

FP8_KEYS = _keys(
    Key("fp8_backend", S, None, choices=("AO", "TE", "MSAMP"), nullable=True),
    Key("fp8_use_autocast_during_eval", B, False),
    Key("fp8_margin", I, 0, lo=0),
    Key("fp8_interval", I, 1, lo=1),
    Key("fp8_format", S, "HYBRID", choices=("HYBRID", "E4M3", "E5M2")),
    Key("fp8_amax_history_length", I, 1024, lo=1),
    Key("fp8_amax_history_len", I, 1024, lo=1),
    Key("fp8_amax_compute_algorithm", S, "most_recent", choices=("max", "most_recent")),
    Key("fp8_amax_compute_algo", S, "most_recent", choices=("max", "most_recent")),
    Key("fp8_override_linear_precision", ("boollist",), None, nullable=True),
    Key("fp8_optimization_level", S, "O2", choices=("O1", "O2")),
    Key("fp8_opt_level", S, "O2", choices=("O1", "O2")),
    Key("fp8_enable_fsdp_float8_all_gather", B, True),
    Key("fp8_pad_inner_dim", B, True),
)

PARALLELISM_KEYS = _keys(
    *(Key("parallelism_config_" + n, I, 1, lo=1)
      for n in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")),
    Key("parallelism_config_cp_backend", S, "torch", choices=("torch",)),
    Key("parallelism_config_cp_comm_strategy", S, "allgather", choices=("allgather", "alltoall")),
    Key("parallelism_config_sp_backend", S, "deepspeed", choices=("deepspeed",)),
    Key("parallelism_config_sp_seq_length", ("str", "int"), None, nullable=True),
    Key("parallelism_config_sp_seq_length_is_variable", B, True),
    Key("parallelism_config_sp_attn_implementation", S, "sdpa"),
)

MPIRUN_KEYS = _keys(Key("mpirun_hostfile", S, None, nullable=True), Key("mpirun_ccl", I, None, lo=0, nullable=True))

DYNAMO_KEYS = _keys(
    Key("dynamo_backend", S, "NO", choices=DYNAMO_BACKENDS),
    Key("dynamo_mode", S, "default", choices=DYNAMO_MODES),
    Key("dynamo_use_fullgraph", B, False),
    Key("dynamo_use_dynamic", B, False),
    Key("dynamo_use_regional_compilation", B, False),
)

_NO_FEATURE = ({},)  # a dict key is supported only while empty

CLUSTER_KEYS = _keys(
    Key("compute_environment", S, "LOCAL_MACHINE", choices=COMPUTE_ENVIRONMENTS, supported=("LOCAL_MACHINE",),
        feature="Amazon SageMaker"),
    Key("distributed_type", S, None, choices=DISTRIBUTED_TYPES, supported=SUPPORTED_DISTRIBUTED_TYPES,
        feature="this distributed_type"),
    Key("mixed_precision", S, None, choices=MIXED_PRECISIONS, nullable=True, supported=(None, "no", "fp16", "bf16"),
        feature="fp8 mixed precision"),
    Key("use_cpu", B, False),
    Key("debug", B, False, supported=(False,), feature="debug mode (checking distributed operations)"),
    Key("num_processes", I, -1, lo=-1, hint="an integer >= 1 (the total over all machines), or -1 (pass "
        "--num_processes at launch)"),
    Key("machine_rank", I, 0, lo=0),
    Key("num_machines", I, 1, lo=1),
    Key("gpu_ids", ("str", "int"), None, pattern=_GPU_IDS.pattern, nullable=True,
        hint="'all' or a comma-separated list of GPU ids such as '0,1' (or null)"),
    Key("main_process_ip", S, None, nullable=True),
    Key("main_process_port", I, None, lo=0, hi=65535, nullable=True),
    Key("rdzv_backend", S, "static", choices=RDZV_BACKENDS, nullable=True),
    Key("same_network", B, False, nullable=True),
    Key("main_training_function", S, "main", supported=("main",), feature="main_training_function (TPU launcher)"),
    Key("enable_cpu_affinity", B, False, supported=(False,), feature="CPU affinity (NUMA)"),
    Key("fp8_config", ("dict",), None, nullable=True, sub=FP8_KEYS, sub_prefix="fp8_", supported=_NO_FEATURE,
        feature="fp8 training"),
    Key("deepspeed_config", ("dict",), None, nullable=True, sub=DEEPSPEED_KEYS),
    Key("fsdp_config", ("dict",), None, nullable=True, sub=FSDP_KEYS, sub_prefix="fsdp_"),
    Key("parallelism_config", ("dict",), None, nullable=True, sub=PARALLELISM_KEYS, supported=_NO_FEATURE,
        feature="parallelism_config (N-d parallelism)"),
    Key("megatron_lm_config", ("dict",), None, nullable=True, sub=MEGATRON_KEYS, supported=_NO_FEATURE,
        feature="Megatron-LM"),
    Key("mpirun_config", ("dict",), None, nullable=True, sub=MPIRUN_KEYS, supported=_NO_FEATURE,
        feature="launching with mpirun"),
    Key("downcast_bf16", ("bool", "str"), False, choices=(False, True, "no", "yes"), supported=(False, "no"),
        feature="downcast_bf16 (TPU)"),
    Key("tpu_name", S, None, nullable=True, supported=(None,), feature="TPU pods"),
    Key("tpu_zone", S, None, nullable=True, supported=(None,), feature="TPU pods"),
    Key("tpu_use_cluster", B, False, supported=(False,), feature="TPU pods"),
    Key("tpu_use_sudo", B, False, supported=(False,), feature="TPU pods"),
    Key("command_file", S, None, nullable=True, supported=(None,), feature="TPU pod start-up commands"),
    Key("commands", L, None, nullable=True, supported=(None, []), feature="TPU pod start-up commands"),
    Key("tpu_vm", L, None, nullable=True, supported=(None, []), feature="TPU pods"),
    Key("tpu_env", L, None, nullable=True, supported=(None, []), feature="TPU pods"),
    Key("dynamo_config", ("dict",), None, nullable=True, sub=DYNAMO_KEYS, sub_prefix="dynamo_"),
)
