"""Configuration objects with accelerate 1.15's names, fields and defaults.

A user's `from accelerate.utils import X` becomes `from accelerate_c.utils import X`.
"""
from __future__ import annotations

import copy
import enum
import os
from dataclasses import dataclass, field
from datetime import timedelta


class _ContainsValues(enum.EnumMeta):
    """`"bf16" in PrecisionType`: whether a value (or member) names a member."""

    def __contains__(cls, item):
        try:
            cls(item)
        except ValueError:
            return False
        return True


class _ValueEnum(enum.Enum, metaclass=_ContainsValues):
    """accelerate's plain "value" enums: str() and format() give the value, `in` takes values;
    not a str, so a member is not equal to its value (RNGType, DDPCommunicationHookType)."""

    def __str__(self):
        return self.value

    @classmethod
    def list(cls):
        return [str(m) for m in cls]


class _ValueStrEnum(str, _ValueEnum):
    """accelerate's str + value enums (PrecisionType, DynamoBackend): also a str, equal to and
    hashed as its value."""


class DistributedType(str, enum.Enum):
    """accelerate 1.15's members, all of them, so code comparing against any of them runs;
    accelerate_c itself only ever reports NO, MULTI_CPU and MULTI_GPU. As accelerate's, a str
    equal to its value whose str() is the member's name ('DistributedType.NO')."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"


class PrecisionType(_ValueStrEnum):
    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


class DynamoBackend(_ValueStrEnum):
    """torch.compile backends by accelerate's names; accelerate_c runs only NO."""

    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"


class LoggerType(_ValueEnum):
    """Experiment trackers by accelerate's names (accelerate_c.tracking), plus JSONL, accelerate_c's
    own JSON-lines tracker that needs no package."""

    ALL = "all"
    AIM = "aim"
    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    COMETML = "comet_ml"
    MLFLOW = "mlflow"
    CLEARML = "clearml"
    DVCLIVE = "dvclive"
    SWANLAB = "swanlab"
    JSONL = "jsonl"


class RNGType(_ValueEnum):
    """accelerate's members; synchronize_rng_state handles torch, cuda and generator."""

    TORCH = "torch"
    CUDA = "cuda"
    MLU = "mlu"
    SDAA = "sdaa"
    MUSA = "musa"
    NPU = "npu"
    XLA = "xla"
    XPU = "xpu"
    HPU = "hpu"
    NEURON = "neuron"
    GENERATOR = "generator"


class DDPCommunicationHookType(_ValueEnum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


class KwargsHandler:
    """Mixin for the kwargs dataclasses: `to_kwargs()` returns the fields changed from their defaults."""

    def to_dict(self):
        return copy.deepcopy(self.__dict__)

    def to_kwargs(self):
        default = self._defaults()
        return {k: v for k, v in self.to_dict().items() if default[k] != v}

    def _defaults(self) -> dict:
        return self.__class__().to_dict()


@dataclass
class AutocastKwargs(KwargsHandler):
    """Arguments for `torch.autocast` used under mixed precision."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Dynamic loss-scale settings for fp16 (torch.amp.GradScaler's meaning and defaults)."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Settings of the gradient reducer (torch DDP's names and defaults)."""

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`."""

    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None


@dataclass
class HostMallocKwargs(KwargsHandler):
    """accelerate_c's own (accelerate has no such handler): passed in `kwargs_handlers`, the
    Accelerator applies glibc malloc settings to the whole process (accelerate_c.host_malloc;
    docs/performance.md), or, with enabled=False, leaves them alone whatever
    ACCELERATE_C_MALLOC_TUNING says. Without it, the variable decides (default: untouched)."""

    enabled: bool = True


@dataclass
class CpuCommKwargs(KwargsHandler):
    """accelerate_c's own (accelerate has no such handler): how the collectives of CPU processes
    travel (docs/collectives.md): "shm" (shared memory between the ranks of one host), "gloo",
    or "auto" (shm where every rank is on this host). Wins over ACCELERATE_C_COMM. Decided once
    per process group, when the first Accelerator is made."""

    comm: str = "auto"

    def __post_init__(self):
        if self.comm not in ("shm", "gloo", "auto"):
            raise ValueError(f"CpuCommKwargs(comm={self.comm!r}): use 'shm', 'gloo' or 'auto'")


@dataclass
class ProfileKwargs(KwargsHandler):
    """torch.profiler settings for `Accelerator.profile()` (accelerate's fields and defaults;
    torch.profiler.profile's meaning). `activities` are names ("cpu", "cuda", and "xpu" /
    "mtia" / "hpu" where this torch has that device available); `schedule_option` holds
    torch.profiler.schedule's arguments; `output_trace_dir` makes profile() write a Chrome trace
    per process there, named profile_<process index>.json."""

    activities: list | None = None
    schedule_option: dict | None = None
    on_trace_ready: object = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    @staticmethod
    def _activity_names() -> dict:
        import torch

        kinds = torch.profiler.ProfilerActivity
        names = {"cpu": kinds.CPU, "cuda": kinds.CUDA}
        for name in ("xpu", "mtia", "hpu"):  # offered, as by accelerate, only where the device is there
            device = getattr(torch, name, None)
            if hasattr(kinds, name.upper()) and device is not None and device.is_available():
                names[name] = getattr(kinds, name.upper())
        return names

    def build(self):
        """A torch.profiler.profile made from these settings (not started)."""
        import torch

        activities = None
        if self.activities is not None:
            names = self._activity_names()
            activities = []
            for activity in self.activities:
                if activity not in names:
                    raise ValueError(f"ProfileKwargs(activities=...): invalid profiler activity {activity!r}; "
                                     f"must be one of {list(names)}")
                activities.append(names[activity])
        schedule = None
        if self.schedule_option is not None:
            try:
                schedule = torch.profiler.schedule(**self.schedule_option)
            except TypeError as e:  # a TypeError still, as accelerate's
                raise TypeError(f"ProfileKwargs(schedule_option={self.schedule_option!r}): {e} (keys: wait, "
                                 "warmup, active, repeat, skip_first)") from None
        return torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.on_trace_ready,
                                      record_shapes=self.record_shapes, profile_memory=self.profile_memory,
                                      with_stack=self.with_stack, with_flops=self.with_flops,
                                      with_modules=self.with_modules)


class FP8BackendType(str, enum.Enum):
    """accelerate's FP8 backends (accelerate_c trains in no FP8: `Accelerator.fp8_backend` reads
    ACCELERATE_FP8_BACKEND, as accelerate's does without an FP8 recipe)."""

    NO = "NO"
    TE = "TE"
    MSAMP = "MSAMP"
    AO = "AO"


@dataclass
class GradientAccumulationPlugin(KwargsHandler):
    """How gradient accumulation behaves (accelerate's fields)."""

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


@dataclass
class DataLoaderConfiguration:
    """How `prepare()` wraps data loaders (accelerate's fields and defaults)."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = False
    data_seed: int | None = None
    non_blocking: bool = False
    use_stateful_dataloader: bool = False


@dataclass
class ProjectConfiguration:
    """Where checkpoints and logs go, and how checkpoints are named and pruned."""

    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def set_directories(self, project_dir: str | None = None):
        self.project_dir = project_dir
        if self.logging_dir is None:
            self.logging_dir = project_dir

    def __post_init__(self):
        self.set_directories(self.project_dir)


@dataclass
class TorchDynamoPlugin(KwargsHandler):
    """torch.compile settings, accelerate's fields; unset fields are read from the
    ACCELERATE_DYNAMO_* variables the launcher sets, as accelerate reads them. A backend other
    than NO makes prepare() compile the model (accelerate_c/compilation.py)."""

    backend: DynamoBackend | str | None = None
    mode: str | None = None
    fullgraph: bool | None = None
    dynamic: bool | None = None
    options: dict | None = None
    disable: bool = False
    use_regional_compilation: bool | None = None

    def __post_init__(self):
        if self.backend is None:
            self.backend = os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no")
        name = str(getattr(self.backend, "value", self.backend)).upper()
        if name not in DynamoBackend:
            raise ValueError(f"TorchDynamoPlugin(backend={self.backend!r}): unknown dynamo backend; expected one of "
                             f"{[b.lower() for b in DynamoBackend.list()]}")
        self.backend = DynamoBackend(name)
        if self.mode is None:
            self.mode = os.environ.get("ACCELERATE_DYNAMO_MODE", "default")
        if self.fullgraph is None:
            self.fullgraph = parse_flag_from_env("ACCELERATE_DYNAMO_USE_FULLGRAPH")
        if self.use_regional_compilation is None:
            self.use_regional_compilation = parse_flag_from_env("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION")
        if self.dynamic is None and os.environ.get("ACCELERATE_DYNAMO_USE_DYNAMIC") is not None:
            self.dynamic = parse_flag_from_env("ACCELERATE_DYNAMO_USE_DYNAMIC")

    def to_dict(self):
        out = copy.deepcopy(self.__dict__)
        out["backend"] = self.backend.value.lower()
        return out

    def _defaults(self) -> dict:
        # the fields' defaults as __post_init__ resolves them with no ACCELERATE_DYNAMO_* set
        # (an environment value is a change too), written out rather than obtained by
        # clearing the process's environment around a second construction
        return {"backend": "no", "mode": "default", "fullgraph": False, "dynamic": None, "options": None,
                "disable": False, "use_regional_compilation": False}

    def to_kwargs(self):
        # torch.compile's arguments: regional compilation is the Accelerator's choice, not torch's
        kwargs = super().to_kwargs()
        kwargs.pop("use_regional_compilation", None)
        return kwargs


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    value = os.environ.get(key)
    if value is None or value == "":
        return default
    v = value.strip().lower()
    # accelerate's str_to_bool's words (an empty value means unset here, where accelerate raises)
    if v in ("1", "true", "t", "yes", "y", "on"):
        return True
    if v in ("0", "false", "f", "no", "n", "off"):
        return False
    raise ValueError(f"environment variable {key}={value!r} is not a boolean (use true/false or 1/0)")


def parse_choice_from_env(key: str, default: str = "no") -> str:
    value = os.environ.get(key)
    return default if value is None or value == "" else value
