"""What an Accelerator says about its processes and settings, and the per-process helpers it
passes on to its state (accelerate's Accelerator properties and `on_main_process` & co.): a
mixin of Accelerator, kept apart so accelerator.py holds what prepares and steps."""
from __future__ import annotations

import torch

from .utils import operations as ops
from .utils.dataclasses import DistributedType


_MULTI_DEVICE = (DistributedType.MULTI_GPU, DistributedType.MULTI_MLU, DistributedType.MULTI_SDAA,
                 DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU, DistributedType.MULTI_XPU,
                 DistributedType.MULTI_HPU, DistributedType.MULTI_NEURON)


class ProcessFacade:
    """Reads self.state, self.gradient_state, self.dataloader_config, self.project_configuration,
    self._optimizers and self.flag_tensor, which Accelerator.__init__ sets."""

    # ---- properties ---------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def distributed_type(self) -> DistributedType:
        return self.state.distributed_type

    @property
    def num_processes(self) -> int:
        return self.state.num_processes

    @property
    def process_index(self) -> int:
        return self.state.process_index

    @property
    def local_process_index(self) -> int:
        return self.state.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.state.is_main_process

    @property
    def is_local_main_process(self) -> bool:
        return self.state.is_local_main_process

    @property
    def is_last_process(self) -> bool:
        return self.state.is_last_process

    @property
    def use_distributed(self) -> bool:
        return self.state.use_distributed

    @property
    def mixed_precision(self) -> str:
        return self.state.mixed_precision

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool):
        self.gradient_state.sync_gradients = value

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int):
        self.gradient_state.plugin_kwargs["num_steps"] = steps
        self.gradient_state._num_steps = steps

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @even_batches.setter
    def even_batches(self, value: bool):
        # read by the data loaders prepared afterwards, as accelerate's
        self.dataloader_config.even_batches = value

    @property
    def dispatch_batches(self):
        return self.dataloader_config.dispatch_batches

    @property
    def use_stateful_dataloader(self) -> bool:
        return getattr(self.dataloader_config, "use_stateful_dataloader", False)

    @property
    def multi_device(self) -> bool:
        """Whether several accelerator devices train together (accelerate's meaning: MULTI_GPU
        and its siblings; CPU processes, DeepSpeed and FSDP runs are not "multi device")."""
        return self.use_distributed and self.distributed_type in _MULTI_DEVICE

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def project_dir(self):
        return self.project_configuration.project_dir

    @property
    def logging_dir(self):
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def __deepcopy__(self, memo):
        # one Accelerator per process: objects holding it (a Trainer's callbacks, a deep-copied
        # config) share it, as accelerate's
        return self

    # ---- prepare --------------------------------------------------------------------------
    def wait_for_everyone(self):
        self.state.wait_for_everyone()

    def print(self, *args, **kwargs):
        self.state.print(*args, **kwargs)

    def set_trigger(self):
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """True on every process if any process called set_trigger() since the last check."""
        if self.flag_tensor is None:
            self.flag_tensor = torch.tensor(0, device=self.device)
        fired = bool(ops.reduce(self.flag_tensor, "sum").item() >= 1)
        if fired:
            self.flag_tensor = torch.tensor(0, device=self.device)
        return fired

    def main_process_first(self):
        return self.state.main_process_first()

    def local_main_process_first(self):
        return self.state.local_main_process_first()

    def split_between_processes(self, inputs, apply_padding: bool = False):
        return self.state.split_between_processes(inputs, apply_padding=apply_padding)

    def on_main_process(self, function):
        return self.state.on_main_process(function)

    def on_local_main_process(self, function):
        return self.state.on_local_main_process(function)

    def on_last_process(self, function):
        return self.state.on_last_process(function)

    def on_process(self, function=None, process_index=None):
        return self.state.on_process(function, process_index=process_index)

    def on_local_process(self, function=None, local_process_index=None):
        return self.state.on_local_process(function, local_process_index=local_process_index)
