"""`accelerate-c env`: versions and capabilities, for bug reports."""
import os
import platform


def collect() -> dict:
    import numpy
    import torch

    import accelerate_c
    from accelerate_c import _C

    info = {
        "accelerate_c version": accelerate_c.__version__,
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "Numpy version": numpy.__version__,
        "PyTorch version": torch.__version__,
        "PyTorch CUDA available": torch.cuda.is_available(),
        "C core built with CUDA": _C.has_cuda,
        "CUDA devices seen by the C core": _C.cuda_device_count(),
        "CPU kernels": f"{_C.kernel_isa()}, {_C.get_num_threads()} threads",
        "CPU cores": os.cpu_count(),
    }
    info.update(gpu_info(torch, _C))
    try:
        import psutil

        info["System RAM"] = f"{psutil.virtual_memory().total / 2**30:.2f} GiB"
    except ImportError:
        pass
    return info


def gpu_info(torch, _C) -> dict:
    """Whether a GPU run can start: the devices torch and the C core see, the CUDA kernels, and
    whether NCCL loads (with the loader's error text when it does not)."""
    info = {}
    try:
        c_count = _C.cuda_device_count()
    except Exception as e:  # noqa: BLE001 - report, never fail `env`
        c_count = f"error: {e}"
    t_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info["PyTorch CUDA devices"] = t_count
    info["PyTorch CUDA version"] = torch.version.cuda
    if t_count:
        info["GPU type"] = torch.cuda.get_device_name(0)
        props = torch.cuda.get_device_properties(0)
        info["GPU memory"] = f"{props.total_memory / 2**30:.2f} GiB"
        info["GPU bf16 supported"] = torch.cuda.is_bf16_supported()
    cuda_ok = bool(t_count) and _C.has_cuda and isinstance(c_count, int) and c_count > 0
    if not t_count:
        why = "no CUDA device visible to torch"
    elif not _C.has_cuda:
        why = "the C core was built without CUDA kernels (nvcc not found or ACCELERATE_C_NO_CUDA set)"
    elif not (isinstance(c_count, int) and c_count > 0):
        why = f"the C core sees no CUDA device ({c_count})"
    else:
        why = ""
    info["CUDA usable by accelerate_c"] = "yes" if cuda_ok else f"no ({why})"
    try:
        from accelerate_c import nccl

        info["NCCL usable"] = f"yes ({nccl.load()})"
    except Exception as e:  # noqa: BLE001 - print the error text as it is
        info["NCCL usable"] = f"no ({e})"
    return info


def config_lines(config_file=None) -> list:
    """The config in effect (--config_file, else the default file if it exists): its path, then
    its keys as the file holds them, or why it cannot be used."""
    from ..utils.config import ConfigError, config_in_effect, default_config_file, load_config_from_file

    path = config_in_effect(config_file)
    if path is None:
        return ["- accelerate_c config: none (no --config_file, and no default file at "
                f"{default_config_file()})"]
    try:
        config = load_config_from_file(path)
    except ConfigError as e:
        return [f"- accelerate_c config: {path}", f"\tinvalid: {e}"]
    lines = [f"- accelerate_c config: {path}"]
    lines += [f"\t- {key}: {value}" for key, value in config.raw.items()]
    lines += [f"\tnot supported yet at launch: {p}" for p in config.unsupported()]
    return lines


def run(args) -> int:
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    for key, value in collect().items():
        print(f"- {key}: {value}")
    print("\n".join(config_lines(args.config_file)))
    return 0


def register(sub) -> None:
    p = sub.add_parser("env", help="Print the environment: versions, CUDA, kernels, the config file in effect.")
    p.add_argument("--config_file", default=None, help="config file to show (default: accelerate's default one)")
    p.set_defaults(func=run)
