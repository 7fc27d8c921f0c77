"""accelerate.utils' public names that accelerate_c provides."""
from .dataclasses import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    InitProcessGroupKwargs,
    KwargsHandler,
    PrecisionType,
    ProjectConfiguration,
    RNGType,
)
from .operations import convert_outputs_to_fp32, convert_to_fp32, pad_tensor, recursively_apply, send_to_device
from .random import set_seed
