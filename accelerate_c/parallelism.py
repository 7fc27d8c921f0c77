"""The Accelerator's names for the parallelism accelerate_c does not build (FSDP, tensor,
context and sequence parallelism), with accelerate 1.15's values for a run without them.
transformers' Trainer calls these on every run (`maybe_context_parallel` around each step,
`parallelism_config` to choose its code paths, `deepspeed_ulysses_dl_adapter` on its data
loader), so they must exist and mean what accelerate's mean when nothing is configured.
The Accelerator refuses the arguments that would turn these features on (plugins.py)."""
from __future__ import annotations

import contextlib


class ParallelismNames:
    """Mixed into the Accelerator: read-only views of `self.state`."""

    @property
    def parallelism_config(self):
        """None: no ParallelismConfig (accelerate_c refuses one at construction)."""
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self):
        """None: no device mesh without a ParallelismConfig."""
        return self.state.device_mesh

    @property
    def is_fsdp2(self) -> bool:
        return self.state.is_fsdp2

    @property
    def is_composable_parallelism_enabled(self) -> bool:
        return self.is_fsdp2

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes the model: without sharded parallelism, as in
        accelerate, the local main process."""
        return self.state.is_local_main_process

    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """A context manager that does nothing: context parallelism needs a ParallelismConfig
        with cp_size > 1, and accelerate's does nothing (and raises nothing) without one."""
        return contextlib.nullcontext()

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        """The data loader as it is: the Ulysses adapter applies only with sequence parallelism
        (sp_size > 1), which needs a ParallelismConfig."""
        return dl
