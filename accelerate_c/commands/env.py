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


def run(args) -> int:
    print("\nCopy-and-paste the text below in your GitHub issue\n")
    for key, value in collect().items():
        print(f"- {key}: {value}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("env", help="Print the environment: versions, CUDA, kernels.")
    p.set_defaults(func=run)
