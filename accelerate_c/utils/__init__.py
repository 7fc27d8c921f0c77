"""accelerate.utils' public names that accelerate_c provides."""
from .dataclasses import (
    AutocastKwargs,
    CpuCommKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    HostMallocKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    LoggerType,
    PrecisionType,
    ProfileKwargs,
    ProjectConfiguration,
    RNGType,
    TorchDynamoPlugin,
)
from ..deepspeed_config import DeepSpeedPlugin, DummyOptim, DummyScheduler, HfDeepSpeedConfig
from .operations import (
    broadcast,
    DistributedOperationException,
    broadcast_object_list,
    convert_outputs_to_fp32,
    copy_tensor_to_devices,
    convert_to_fp32,
    gather,
    gather_object,
    pad_across_processes,
    pad_tensor,
    recursively_apply,
    reduce,
    send_to_device,
)
from .imports import *  # noqa: F403 - the is_*_available machine probes (imports.__all__)
from .random import set_seed, synchronize_rng_state, synchronize_rng_states
from .memory import clear_device_cache, find_executable_batch_size, release_memory, should_reduce_batch_size
from .other import (
    compile_regions,
    extract_model_from_parallel,
    has_compiled_regions,
    has_repeated_blocks,
    is_compiled_module,
    is_repeated_blocks,
)
from ..fsdp_plugin import FullyShardedDataParallelPlugin
