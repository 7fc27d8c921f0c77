"""The machine probes users import from accelerate.utils (`is_bf16_available`,
`is_cuda_available`, `is_datasets_available`, ...): every `is_*_available` accelerate 1.15
exports, with its arguments and the same answer on the same machine (tests/test_probes.py
asks both side by side). Imports nothing of accelerate_c.

Every probe answers True or False (accelerate's package probes answer None for a package
that is not there: the same truth value). A package counts as available when it can be imported and pip knows it (its distribution's
metadata is found), as accelerate decides: a stray directory of that name is not a package.
Device probes never initialise a device: CUDA is asked through NVML.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from contextlib import contextmanager
from functools import lru_cache

import torch
from packaging import version


def _installed(module: str, *distributions: str) -> bool:
    """`module` is importable and one of `distributions` (default: the module's name) is installed."""
    if importlib.util.find_spec(module) is None:
        return False
    for dist in distributions or (module,):
        try:
            importlib.metadata.metadata(dist)
            return True
        except importlib.metadata.PackageNotFoundError:
            continue
    return False


def _version_at_least(dist: str, minimum: str) -> bool:
    return version.parse(importlib.metadata.version(dist)) >= version.parse(minimum)


def _torch_at_least(v: str) -> bool:
    return version.parse(version.parse(torch.__version__).base_version) >= version.parse(v)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "y", "on", "t")


@contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


# ---- packages -----------------------------------------------------------------------------------
def is_datasets_available():
    return _installed("datasets")


def is_torchdata_available():
    return _installed("torchdata")


def is_torchdata_stateful_dataloader_available():
    """torchdata with StatefulDataLoader (0.8.0 or newer)."""
    return _installed("torchdata") and _version_at_least("torchdata", "0.8.0")


def is_transformers_available():
    return _installed("transformers")


def is_deepspeed_available():
    return _installed("deepspeed")


def is_peft_available():
    return _installed("peft")


def is_timm_available():
    return _installed("timm")


def is_torchvision_available():
    return _installed("torchvision")


def is_pandas_available():
    return _installed("pandas")


def is_matplotlib_available():
    return _installed("matplotlib")


def is_pytest_available():
    return _installed("pytest")


def is_boto3_available():
    return _installed("boto3")


def is_sagemaker_available():
    return _installed("sagemaker")


def is_wandb_available():
    return _installed("wandb")


def is_comet_ml_available():
    return _installed("comet_ml")


def is_clearml_available():
    return _installed("clearml")


def is_dvclive_available():
    return _installed("dvclive")


def is_swanlab_available():
    return _installed("swanlab")


def is_tensorboard_available():
    return _installed("tensorboard") or _installed("tensorboardX")


def is_trackio_available():
    return sys.version_info >= (3, 10) and _installed("trackio")


def is_mlflow_available():
    return _installed("mlflow", "mlflow", "mlflow-skinny")


def is_aim_available():
    """aim, before its 4.0 (the API accelerate's tracker uses)."""
    return _installed("aim") and not _version_at_least("aim", "4.0.0")


def is_rich_available():
    """rich installed, and asked for with ACCELERATE_ENABLE_RICH."""
    return _installed("rich") and _env_flag("ACCELERATE_ENABLE_RICH")


def is_import_timer_available():
    return _installed("import_timer")


def is_pynvml_available():
    return _installed("pynvml", "pynvml", "nvidia-ml-py")


def is_amdsmi_available():
    return _installed("amdsmi")


def is_msamp_available():
    return _installed("msamp", "ms-amp")


def is_schedulefree_available():
    return _installed("schedulefree")


def is_lomo_available():
    return _installed("lomo_optim")


def is_torchao_available():
    return _installed("torchao") and _version_at_least("torchao", "0.6.1")


def is_bnb_available(min_version=None):
    if not _installed("bitsandbytes"):
        return False
    return min_version is None or _version_at_least("bitsandbytes", min_version)


def is_4bit_bnb_available():
    return is_bnb_available("0.39.0")


def is_8bit_bnb_available():
    return is_bnb_available("0.37.2")


def is_bitsandbytes_multi_backend_available():
    if not is_bnb_available():
        return False
    import bitsandbytes  # noqa: PLC0415 (optional package)

    return "multi_backend" in getattr(bitsandbytes, "features", set())


def is_transformer_engine_available():
    if is_hpu_available():
        return _installed("intel_transformer_engine", "intel-transformer-engine")
    return _installed("transformer_engine", "transformer-engine")


def is_transformer_engine_mxfp8_available():
    if not _installed("transformer_engine", "transformer-engine"):
        return False
    from transformer_engine.pytorch.fp8 import check_mxfp8_support  # noqa: PLC0415 (optional package)

    return bool(check_mxfp8_support()[0])


def is_triton_available():
    if is_xpu_available():
        return _installed("triton", "triton-xpu")
    return _installed("triton")


def is_megatron_lm_available():
    """Megatron-LM (megatron-core 0.8 or newer with its training package), when asked for with
    ACCELERATE_USE_MEGATRON_LM."""
    if not _env_flag("ACCELERATE_USE_MEGATRON_LM") or importlib.util.find_spec("megatron") is None:
        return False
    try:
        if not _version_at_least("megatron-core", "0.8.0"):
            return False
    except Exception:  # noqa: BLE001 - an unreadable version counts as absent
        return False
    return importlib.util.find_spec(".training", "megatron") is not None


# ---- torch features -----------------------------------------------------------------------------
def is_weights_only_available():
    """torch.load(weights_only=True) with an allow-list (torch 2.4)."""
    return _torch_at_least("2.4.0")


def is_pippy_available():
    return _torch_at_least("2.4.0")


def is_xccl_available():
    if not _torch_at_least("2.7.0"):
        return False
    return torch.distributed.distributed_c10d.is_xccl_available()


# ---- devices --------------------------------------------------------------------------------------
def is_cuda_available():
    """CUDA devices, asked through NVML so that CUDA is not initialised in this process."""
    with _env("PYTORCH_NVML_BASED_CUDA_CHECK", "1"):
        return torch.cuda.is_available()


def is_rocm_available():
    return torch.version.hip is not None and torch.cuda.is_available()


def is_mps_available(min_version="1.12"):
    return _torch_at_least(min_version) and torch.backends.mps.is_available() and torch.backends.mps.is_built()


@lru_cache
def is_torch_xla_available(check_is_tpu=False, check_is_gpu=False):
    """torch_xla importable (and USE_TORCH_XLA not turned off); check_is_tpu / check_is_gpu: its
    device is a TPU / a GPU."""
    if check_is_tpu and check_is_gpu:
        raise ValueError("is_torch_xla_available: check_is_tpu and check_is_gpu cannot both be true")
    if os.environ.get("USE_TORCH_XLA", "true").strip().lower() in ("0", "false", "no", "n", "off", "f"):
        return False
    try:
        import torch_xla.core.xla_model  # noqa: F401, PLC0415 (optional package)
        import torch_xla.runtime as xr  # noqa: PLC0415
    except ImportError:
        return False
    if check_is_gpu:
        return xr.device_type() in ("GPU", "CUDA")
    if check_is_tpu:
        return xr.device_type() == "TPU"
    return True


def _extension_device(module: str, attr: str, check_device: bool, env=None) -> bool:
    """A device type that a torch extension package adds (`torch.<attr>`)."""
    if importlib.util.find_spec(module) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - an extension that fails to import means no device
        return False
    backend = getattr(torch, attr, None)
    if check_device:
        try:
            backend.device_count()
            return backend.is_available()
        except (RuntimeError, AttributeError):
            return False
    if env is not None:
        with _env(env, "1"):
            return backend is not None and backend.is_available()
    return backend is not None and backend.is_available()


@lru_cache
def is_npu_available(check_device=False):
    return _extension_device("torch_npu", "npu", check_device)


@lru_cache
def is_mlu_available(check_device=False):
    return _extension_device("torch_mlu", "mlu", False, env="PYTORCH_CNDEV_BASED_MLU_CHECK")


@lru_cache
def is_musa_available(check_device=False):
    return _extension_device("torch_musa", "musa", check_device)


@lru_cache
def is_sdaa_available(check_device=False):
    return _extension_device("torch_sdaa", "sdaa", check_device)


@lru_cache
def is_neuron_available(check_device=False):
    return _extension_device("torch_neuronx", "neuron", check_device)


@lru_cache
def is_hpu_available(init_hccl=False):
    if importlib.util.find_spec("habana_frameworks") is None or \
            importlib.util.find_spec("habana_frameworks.torch") is None:
        return False
    importlib.import_module("habana_frameworks.torch")
    if init_hccl:
        importlib.import_module("habana_frameworks.torch.distributed.hccl")
    return hasattr(torch, "hpu") and torch.hpu.is_available()


@lru_cache
def is_xpu_available(check_device=False):
    """Intel GPUs through stock torch (2.7 or newer)."""
    if not _torch_at_least("2.7.0"):
        return False
    if check_device:
        try:
            torch.xpu.device_count()
            return torch.xpu.is_available()
        except RuntimeError:
            return False
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def _is_gaudi1() -> bool:
    if not is_hpu_available():
        return False
    import habana_frameworks.torch.utils.experimental as htexp  # noqa: PLC0415 (optional package)

    return htexp._get_device_type() == htexp.synDeviceType.synDeviceGaudi


def is_bf16_available(ignore_tpu=False):
    """bfloat16 on this machine's accelerator (on a CPU: yes)."""
    if is_torch_xla_available(check_is_tpu=True):
        return not ignore_tpu
    if is_cuda_available():
        return torch.cuda.is_bf16_supported()
    if is_mlu_available():
        return torch.mlu.is_bf16_supported()
    if is_xpu_available():
        return torch.xpu.is_bf16_supported()
    if is_mps_available():
        return torch.backends.mps.is_macos_or_newer(14, 0)
    return True


def is_fp16_available():
    """float16 everywhere but on Gaudi 1."""
    return not _is_gaudi1()


def is_fp8_available():
    return is_msamp_available() or is_transformer_engine_available() or is_torchao_available()


__all__ = sorted(n for n in dir() if n.startswith("is_") and n.endswith("_available"))
