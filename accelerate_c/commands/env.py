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
    try:
        import psutil

        info["System RAM"] = f"{psutil.virtual_memory().total / 2**30:.2f} GiB"
    except ImportError:
        pass
    return info


def config_lines(config_file=None) -> list:
    """The config in effect (--config_file, else the default file if it exists): its path, then
    its keys as the file holds them, or why it cannot be used."""
    from ..utils.config import ConfigError, config_in_effect, load_config_from_file

    path = config_in_effect(config_file)
    if path is None:
        return ["- accelerate_c config: none (no --config_file, and no default file at "
                f"{default_config_path()})"]
    try:
        config = load_config_from_file(path)
    except ConfigError as e:
        return [f"- accelerate_c config: {path}", f"\tinvalid: {e}"]
    lines = [f"- accelerate_c config: {path}"]
    lines += [f"\t- {key}: {value}" for key, value in config.raw.items()]
    lines += [f"\tnot supported yet at launch: {p}" for p in config.unsupported()]
    return lines


def default_config_path() -> str:
    from ..utils.config import default_config_file

    return default_config_file()


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
