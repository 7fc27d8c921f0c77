"""Process-wide state: which device, how many processes, mixed precision, accumulation.

Like accelerate, the states are shared singletons (every `AcceleratorState()` sees the same
values), so library code can ask for them without a handle on the Accelerator. Unlike
accelerate, constructing a new Accelerator re-initialises them instead of refusing with
"restart your runtime": notebooks and test suites build several in one process.
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from contextlib import contextmanager

import torch

from . import collectives
from .utils.dataclasses import DistributedType, GradientAccumulationPlugin, parse_flag_from_env


def _env_int(key: str, default: int) -> int:
    raw = os.environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not an integer") from None


_AT_EXIT: list = []


def _let_gloo_workers_finish():
    """At exit of a process that used a gloo group with accelerate_c: a gloo worker thread destroys a
    finished work a moment after waking its waiter; if that releases a tensor whose Python
    object only C++ still holds (torch's own temporaries, e.g. inside all_gather_object), the
    worker needs the GIL, and once the interpreter is finalizing CPython ends the thread inside a
    noexcept destructor: std::terminate after a finished run. Our own collectives keep their
    tensors referenced (collectives.py); for torch's, the workers get a moment, with the
    GIL released, to finish while the interpreter is still alive."""
    # also after destroy_process_group(): the works of a destroyed group may still be finishing
    time.sleep(0.2)


class PartialState:
    """Device and process layout, without any training configuration."""

    _shared: dict = {}

    def __init__(self, cpu: bool = False, **kwargs):
        """kwargs: `backend` and `timeout` for torch.distributed.init_process_group (from
        InitProcessGroupKwargs), used when torchrun's WORLD_SIZE says several processes;
        `cpu_comm` (CpuCommKwargs): how CPU collectives travel (collectives.select_cpu_comm)."""
        self.__dict__ = self._shared
        if self.initialized:
            return
        cpu = cpu or parse_flag_from_env("ACCELERATE_USE_CPU")
        world = _env_int("WORLD_SIZE", 1)
        use_cuda = not cpu and torch.cuda.is_available()
        self.fork_launched = False
        if world > 1:
            import torch.distributed as dist

            self.num_processes = world
            self.process_index = _env_int("RANK", 0)
            self.local_process_index = _env_int("LOCAL_RANK", self.process_index)
            # NCCL needs GPUs; on CPU the default "nccl" of InitProcessGroupKwargs means gloo
            backend = kwargs.get("backend") if use_cuda else "gloo"
            self.backend = backend or ("nccl" if use_cuda else "gloo")
            self.distributed_type = DistributedType.MULTI_GPU if use_cuda else DistributedType.MULTI_CPU
            if use_cuda:
                self.device = torch.device("cuda", self.local_process_index)
                torch.cuda.set_device(self.device)
            else:
                self.device = torch.device("cpu")
            if not dist.is_initialized():
                init = {"backend": self.backend}
                if kwargs.get("timeout") is not None:
                    init["timeout"] = kwargs["timeout"]
                if kwargs.get("init_method") is not None:
                    init["init_method"] = kwargs["init_method"]
                dist.init_process_group(**init)
            if _let_gloo_workers_finish not in _AT_EXIT and dist.get_backend() == "gloo":
                # once, however often a group is made, and whoever made it (a script that
                # initialised its own group runs our collectives on it all the same)
                _AT_EXIT.append(_let_gloo_workers_finish)
                atexit.register(_let_gloo_workers_finish)
            if not use_cuda:  # shared memory or gloo for the CPU collectives (a collective: every rank is here)
                t = kwargs.get("timeout")
                collectives.select_cpu_comm(kwargs.get("cpu_comm"), t.total_seconds() if t is not None else None)
        else:
            self.num_processes = 1
            self.process_index = 0
            self.local_process_index = 0
            self.backend = None
            self.distributed_type = DistributedType.NO
            if use_cuda:
                self.device = torch.device("cuda", _env_int("LOCAL_RANK", 0))
                torch.cuda.set_device(self.device)
            else:
                self.device = torch.device("cpu")
        self.use_cpu = self.device.type == "cpu"
        # accelerate's debug mode; accelerate_c checks collective shapes whatever its value
        self.debug = parse_flag_from_env("ACCELERATE_DEBUG_MODE")

    _known_attrs = ("backend", "debug", "device", "distributed_type", "fork_launched", "local_process_index",
                    "num_processes", "process_index", "use_cpu")

    def __getattr__(self, name: str):
        # only reached when the shared state lacks `name`: say why, as accelerate does
        cls = type(self).__name__
        if name in self._known_attrs:
            raise AttributeError(f"`{cls}` object has no attribute `{name}`. This happens if "
                                 f"`{cls}._reset_state()` was called and an `Accelerator` or `PartialState` was "
                                 "not reinitialized.")
        raise AttributeError(f"'{cls}' object has no attribute '{name}'")

    @property
    def initialized(self) -> bool:
        return "device" in self._shared

    @classmethod
    def exists(cls) -> bool:
        """Whether an Accelerator or PartialState has set the shared state up (asked without
        constructing one, which would set it up)."""
        return "device" in cls._shared

    @classmethod
    def _reset_state(cls):
        cls._shared.clear()

    @property
    def use_distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    def destroy_process_group(self, group=None):
        """Destroys the (default) process group, if one was initialised."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group(group)

    def wait_for_everyone(self):
        """Barrier across processes (nothing to wait for on one process)."""
        if self.use_distributed:
            collectives.barrier()

    @contextmanager
    def _goes_first(self, is_main: bool):
        if not is_main:
            self.wait_for_everyone()
        yield
        if is_main:
            self.wait_for_everyone()

    @contextmanager
    def main_process_first(self):
        with self._goes_first(self.is_main_process):
            yield

    @contextmanager
    def local_main_process_first(self):
        with self._goes_first(self.is_local_main_process):
            yield

    @contextmanager
    def split_between_processes(self, inputs, apply_padding: bool = False):
        """Yields this process's contiguous share of a list/tuple/str/tensor, or of each value of
        a dict (the whole input on one process). Earlier ranks get one more item when the length
        does not divide; apply_padding repeats the last item so every rank gets as many."""
        if self.num_processes == 1:
            yield inputs
            return
        yield _split(inputs, self.num_processes, self.process_index, apply_padding)

    def print(self, *args, **kwargs):
        if self.is_local_main_process:
            print(*args, **kwargs)

    def _run_if(self, cond, function):
        def wrapper(*args, **kwargs):
            if cond():
                return function(*args, **kwargs)
            return None

        wrapper.__wrapped__ = function
        wrapper.__name__ = getattr(function, "__name__", "wrapper")
        wrapper.__doc__ = getattr(function, "__doc__", None)
        return wrapper

    def on_main_process(self, function):
        return self._run_if(lambda: self.is_main_process, function)

    def on_local_main_process(self, function):
        return self._run_if(lambda: self.is_local_main_process, function)

    def on_last_process(self, function):
        return self._run_if(lambda: self.is_last_process, function)

    def on_process(self, function=None, process_index: int | None = None):
        if function is None:
            return lambda f: self.on_process(f, process_index=process_index)
        return self._run_if(lambda: self.process_index == process_index, function)

    def on_local_process(self, function=None, local_process_index: int | None = None):
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index=local_process_index)
        return self._run_if(lambda: self.local_process_index == local_process_index, function)

    def __repr__(self):
        return (f"Distributed environment: {self.distributed_type}\nNum processes: {self.num_processes}\n"
                f"Process index: {self.process_index}\nLocal process index: {self.local_process_index}\n"
                f"Device: {self.device}\n")


def _is_hf_dataset(obj) -> bool:
    """A Hugging Face datasets.Dataset (checked without importing datasets)."""
    ds = sys.modules.get("datasets")
    cls = getattr(ds, "Dataset", None) if ds is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _split(inputs, n: int, rank: int, pad: bool):
    if _is_hf_dataset(inputs):  # rows by index, as accelerate does (slicing one gives a dict of columns)
        per, extra = divmod(len(inputs), n)
        start = rank * per + min(rank, extra)
        idx = list(range(start, start + per + (1 if rank < extra else 0)))
        if pad and len(inputs):
            idx += [len(inputs) - 1] * (per + (1 if extra else 0) - len(idx))
        return inputs.select(idx)
    if isinstance(inputs, dict):
        lengths = {len(v) for v in inputs.values()}
        if len(lengths) > 1:
            raise ValueError(f"split_between_processes: dict values have different lengths {sorted(lengths)}")
        return {k: _split(v, n, rank, pad) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, n)
    start = rank * per + min(rank, extra)
    end = start + per + (1 if rank < extra else 0)
    part = inputs[start:end]
    if pad and extra and rank >= extra and length:
        # slicing keeps the type (list, tuple, str), so + appends the last item
        part = torch.cat([part, inputs[-1:]]) if torch.is_tensor(inputs) else part + inputs[-1:]
    return part


class AcceleratorState(PartialState):
    """PartialState plus the training configuration (mixed precision)."""

    _shared: dict = PartialState._shared
    _known_attrs = PartialState._known_attrs + ("mixed_precision",)

    def __init__(self, mixed_precision: str | None = None, cpu: bool = False, _from_accelerator: bool = False,
                 **kwargs):
        self.__dict__ = self._shared
        if _from_accelerator:
            self._reset_state()
        PartialState.__init__(self, cpu=cpu, **kwargs)
        if "mixed_precision" not in self._shared or _from_accelerator:
            self.mixed_precision = "no" if mixed_precision is None else str(mixed_precision)

    @classmethod
    def _reset_state(cls, reset_partial_state: bool = True):
        cls._shared.clear()

    # accelerate's names for the parallelism plugins (transformers' Trainer reads them to pick
    # its code paths). accelerate_c builds no FSDP, tensor/context parallelism or Megatron-LM:
    # those are None, as in accelerate for a run without them.
    torch_tp_plugin = None
    megatron_lm_plugin = None
    parallelism_config = None
    device_mesh = None

    @property
    def fsdp_plugin(self):
        """The FullyShardedDataParallelPlugin under FSDP (full sharding), else None."""
        if self._shared.get("distributed_type") != DistributedType.FSDP:
            return None
        return self._shared.get("fsdp_plugin")

    @property
    def is_fsdp2(self) -> bool:
        return self.fsdp_plugin is not None and bool(self._shared.get("is_fsdp2"))

    def set_fsdp_plugin(self, plugin, is_fsdp2: bool):
        """Records the FSDP plugin the Accelerator runs under (fsdp_plugin reads it)."""
        self._shared["fsdp_plugin"] = plugin
        self._shared["is_fsdp2"] = is_fsdp2

    @property
    def deepspeed_plugin(self):
        """The active DeepSpeedPlugin under DeepSpeed (ZeRO), else None (accelerate's rule)."""
        if self._shared.get("distributed_type") != DistributedType.DEEPSPEED:
            return None
        return self._shared.get("active_deepspeed_plugin")

    def set_deepspeed_plugin(self, plugin):
        """Records the DeepSpeedPlugin the Accelerator runs under (deepspeed_plugin reads it)."""
        self._shared["active_deepspeed_plugin"] = plugin


class GradientState:
    """Whether this step synchronises gradients, and where the active data loader stands."""

    _shared: dict = {}

    def __init__(self, gradient_accumulation_plugin: GradientAccumulationPlugin | None = None):
        self.__dict__ = self._shared
        if not self._shared or gradient_accumulation_plugin is not None:
            plugin = gradient_accumulation_plugin or GradientAccumulationPlugin(num_steps=1)
            self.sync_gradients = True
            self.active_dataloader = None
            self.dataloader_references = [None]
            self.plugin_kwargs = plugin.to_kwargs()
            self.plugin_kwargs.setdefault("num_steps", plugin.num_steps or 1)
            self._num_steps = plugin.num_steps or 1
            # accelerate reads this from to_kwargs(), which drops defaults: in effect it is
            # False unless... never True. Matching it keeps scheduler step counts identical.
            self._adjust_scheduler = self.plugin_kwargs.get("adjust_scheduler", False)
            self._sync_with_dataloader = plugin.sync_with_dataloader
            self._sync_each_batch = plugin.sync_each_batch

    @classmethod
    def _reset_state(cls):
        cls._shared.clear()

    @property
    def num_steps(self) -> int:
        return self._num_steps

    @property
    def adjust_scheduler(self) -> bool:
        return self._adjust_scheduler

    @property
    def sync_with_dataloader(self) -> bool:
        return self._sync_with_dataloader

    @property
    def sync_each_batch(self) -> bool:
        return self._sync_each_batch

    @property
    def initialized(self) -> bool:
        return bool(self._shared)

    @property
    def end_of_dataloader(self) -> bool:
        return bool(self.active_dataloader is not None and self.active_dataloader.end_of_dataloader)

    @property
    def remainder(self) -> int:
        return -1 if self.active_dataloader is None else self.active_dataloader.remainder

    @property
    def in_dataloader(self) -> bool:
        return self.active_dataloader is not None

    def _set_sync_gradients(self, sync_gradients: bool):
        self.sync_gradients = sync_gradients

    def _add_dataloader(self, dataloader):
        self.active_dataloader = dataloader
        self.dataloader_references.append(dataloader)

    def _remove_dataloader(self, dataloader):
        if dataloader in self.dataloader_references:
            self.dataloader_references.remove(dataloader)
        self.active_dataloader = self.dataloader_references[-1]

    def __repr__(self):
        return (f"Sync Gradients: {self.sync_gradients}\nAt end of current dataloader: {self.end_of_dataloader}\n"
                f"Extra samples added: {self.remainder}\nGradient accumulation plugin: {self.plugin_kwargs}\n")

