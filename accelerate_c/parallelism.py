"""The Accelerator's names for the parallelism accelerate_c does not build (tensor, context,
pipeline and sequence parallelism, big-model device maps), with accelerate 1.15's values for a
run without them. transformers' Trainer calls these on every run (`maybe_context_parallel`
around each step, `parallelism_config` to choose its code paths, `deepspeed_ulysses_dl_adapter`
on its data loader), so they must exist and mean what accelerate's mean when nothing is
configured. The Accelerator refuses the arguments that would turn these features on
(plugins.py)."""
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

    # the ranks within each parallel dimension: accelerate raises without a ParallelismConfig
    # (pipeline and context parallelism: always, as accelerate 1.15 builds neither here)
    @property
    def tensor_parallel_rank(self) -> int:
        raise RuntimeError("Tensor parallelism is not configured. Set `parallelism_config` first.")

    @property
    def data_parallel_rank(self) -> int:
        raise RuntimeError("Data parallelism is not configured. Set `parallelism_config` first.")

    @property
    def data_parallel_shard_rank(self) -> int:
        raise RuntimeError("Shard-based data parallelism is not configured. Set `parallelism_config` first.")

    @property
    def pipeline_parallel_rank(self) -> int:
        raise NotImplementedError("Pipeline parallelism is currently not supported in Accelerate.")

    @property
    def context_parallel_rank(self) -> int:
        raise NotImplementedError("Context parallelism is currently not supported in Accelerate.")

    def verify_device_map(self, model) -> bool:
        """Whether the model was dispatched over several devices by big-model loading (a module
        with an hf_device_map of more than one entry), as accelerate's check."""
        return any(len(getattr(m, "hf_device_map", None) or ()) > 1 for m in model.modules())

    def maybe_context_parallel(self, buffers=None, buffer_seq_dims=None, no_restore_buffers=None):
        """A context manager that does nothing: context parallelism needs a ParallelismConfig
        with cp_size > 1, and accelerate's does nothing (and raises nothing) without one."""
        return contextlib.nullcontext()

    def deepspeed_ulysses_dl_adapter(self, dl, model):
        """The data loader as it is: the Ulysses adapter applies only with sequence parallelism
        (sp_size > 1), which needs a ParallelismConfig."""
        return dl
