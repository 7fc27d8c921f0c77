"""accelerate_c: Hugging Face accelerate's Accelerator, with a C core."""
from . import _C
from ._C import CoreError
from .accelerator import Accelerator, create_accelerator
from .data_loader import skip_first_batches
from .launchers import debug_launcher, notebook_launcher
from .state import AcceleratorState, GradientState, PartialState
from .trainer import Trainer, TrainerCallback, TrainerControl, TrainerState
from .training_args import TrainingArguments
from .utils import (
    AutocastKwargs,
    DataLoaderConfiguration,
    DDPCommunicationHookType,
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    find_executable_batch_size,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    GradScalerKwargs,
    HostMallocKwargs,
    InitProcessGroupKwargs,
    ProfileKwargs,
    ProjectConfiguration,
    synchronize_rng_states,
)

__version__ = "0.1.0"

__all__ = [
    "Accelerator", "AcceleratorState", "AutocastKwargs", "CoreError", "DataLoaderConfiguration",
    "DDPCommunicationHookType", "DeepSpeedPlugin", "DistributedDataParallelKwargs", "DistributedType",
    "find_executable_batch_size", "FullyShardedDataParallelPlugin", "GradientAccumulationPlugin", "GradientState",
    "GradScalerKwargs", "HostMallocKwargs", "InitProcessGroupKwargs", "PartialState", "ProfileKwargs",
    "ProjectConfiguration", "synchronize_rng_states",
    "skip_first_batches", "debug_launcher", "notebook_launcher",
    "Trainer", "TrainerCallback", "TrainerControl", "TrainerState", "TrainingArguments", "create_accelerator",
    "__version__",
]
