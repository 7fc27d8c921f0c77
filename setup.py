"""Build of accelerate_c._C: plain setuptools, one C extension, optional CUDA objects from nvcc.

CUDA is built when nvcc is found (CUDA_HOME/bin, then PATH) and ACCELERATE_C_NO_CUDA is unset.
The CUDA runtime is linked statically with its symbols hidden, so the module needs no libcudart
at import time and still loads (CPU paths only) on machines without a GPU.
ACCELERATE_C_WERROR=1 adds -Werror (CI).
"""
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# -ffp-contract=off: the compiler fuses no multiply-add by itself (GCC's default in ISO mode,
# not clang's): csrc/core/adam.c reproduces torch's roundings, fused exactly where torch's are
C_FLAGS = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fvisibility=hidden", "-pthread", "-ffp-contract=off"]
if os.environ.get("ACCELERATE_C_WERROR") == "1":
    C_FLAGS.append("-Werror")
# Architectures for the kernels: Ampere and Hopper binaries plus PTX for anything newer.
CUDA_ARCHS = os.environ.get("ACCELERATE_C_CUDA_ARCHS", "80;90").split(";")


def find_nvcc():
    if os.environ.get("ACCELERATE_C_NO_CUDA"):
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cudart_static_dir(nvcc):
    """The folder holding libcudart_static.a. nvcc may be a wrapper script, so ask it where its
    toolkit is (`--dryrun` prints TOP=...) rather than trusting its own path."""
    roots = [os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    try:
        dry = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
        for line in (dry.stdout + dry.stderr).splitlines():
            if "TOP=" in line:
                roots.insert(0, os.path.normpath(line.split("TOP=", 1)[1].strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    roots.append("/usr/local/cuda")
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
            if os.path.exists(os.path.join(root, sub, "libcudart_static.a")):
                return os.path.join(root, sub)
    raise RuntimeError(
        f"nvcc found at {nvcc} but not libcudart_static.a next to it; set CUDA_HOME, "
        "or ACCELERATE_C_NO_CUDA=1 for a CPU-only build")


class BuildExt(build_ext):
    def build_extensions(self):
        nvcc = find_nvcc()
        ext = self.extensions[0]
        if nvcc:
            libdir = cudart_static_dir(nvcc)
            objects = self._compile_cuda(nvcc, ext)
            ext.extra_objects = list(ext.extra_objects or []) + objects
            ext.define_macros = list(ext.define_macros or []) + [("AC_WITH_CUDA", "1")]
            ext.library_dirs = list(ext.library_dirs or []) + [libdir]
            ext.extra_link_args = list(ext.extra_link_args or []) + [
                "-Wl,--exclude-libs,ALL",  # keep the static cudart's symbols out of our dynamic table
                "-lcudart_static", "-ldl", "-lrt", "-lpthread", "-lstdc++",
            ]
            print(f"accelerate_c: building with CUDA ({nvcc})")
        else:
            print("accelerate_c: nvcc not found or ACCELERATE_C_NO_CUDA set: CPU-only build")
        super().build_extensions()

    def _compile_cuda(self, nvcc, ext):
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        gencode = []
        for a in CUDA_ARCHS:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        gencode += ["-gencode", f"arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]
        host_flags = "-fPIC,-fvisibility=hidden,-Wall,-Wextra"
        if os.environ.get("ACCELERATE_C_WERROR") == "1":
            host_flags += ",-Werror"
        objects = []
        for src in sorted(glob.glob(os.path.join(HERE, "csrc", "cuda", "*.cu"))):
            obj = os.path.join(out_dir, os.path.basename(src) + ".o")
            cmd = [nvcc, "-O3", "-std=c++17", "-Xcompiler", host_flags, "-DAC_WITH_CUDA=1",
                   "-I", os.path.join(HERE, "csrc", "include"), *gencode, "-c", src, "-o", obj]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objects.append(obj)
        return objects


def sources():
    files = sorted(glob.glob("csrc/core/*.c")) + sorted(glob.glob("csrc/python/*.c"))
    return files


setup(
    ext_modules=[
        Extension(
            "accelerate_c._C",
            sources=sources(),
            include_dirs=["csrc/include"],
            extra_compile_args=C_FLAGS,
            extra_link_args=["-pthread", "-ldl"],
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
