"""The build: the module exports only PyInit__C, links no libtorch, and builds CPU-only with
just a C compiler (ACCELERATE_C_NO_CUDA=1)."""
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

import accelerate_c
from accelerate_c import _C
from timeouts import wait_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _exported(so):
    out = subprocess.run(["nm", "-D", "--defined-only", so], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip())


def _needed(so):
    out = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("readelf") is None, reason="binutils missing")
def test_installed_module_exports_only_init_and_links_no_torch():
    so = _C.__file__
    assert _exported(so) == ["PyInit__C"]
    needed = _needed(so)
    assert not [n for n in needed if "torch" in n or "c10" in n or "cudart" in n], needed


def test_cuda_build_reports_no_devices_here():
    # a CUDA-built module must import and answer on a machine without a GPU
    assert isinstance(_C.has_cuda, bool)
    if not os.path.exists("/dev/nvidia0"):
        assert _C.cuda_device_count() == 0


def _source_copy(dst):
    """The repository's tracked files (git ls-files), else its tree without what builds and venvs
    leave, copied to dst."""
    res = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, timeout=wait_s(60))
    if res.returncode == 0 and res.stdout:
        for rel in res.stdout.decode().split("\0"):
            if rel and os.path.isfile(os.path.join(ROOT, rel)):
                os.makedirs(os.path.dirname(os.path.join(dst, rel)), exist_ok=True)
                shutil.copy2(os.path.join(ROOT, rel), os.path.join(dst, rel))
    else:
        shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "*.so",
                                                                  "__pycache__"))
    return str(dst)


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils missing")
def test_cpu_only_wheel_builds_with_a_c_compiler_only(tmp_path):
    env = dict(os.environ, ACCELERATE_C_NO_CUDA="1", PATH="/usr/bin:/bin")  # no nvcc on PATH either
    env.pop("CUDA_HOME", None)
    # built from a copy of the sources: pip builds in the tree it is given, and a CPU-only module
    # left in the repository's build/ could be packaged by a later `pip wheel .` with CUDA
    src = _source_copy(tmp_path / "src")
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp_path), src]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=wait_s(600))
    assert res.returncode == 0, res.stdout + res.stderr
    wheels = glob.glob(str(tmp_path / "accelerate_c-*.whl"))
    assert len(wheels) == 1
    with zipfile.ZipFile(wheels[0]) as z:
        so_names = [n for n in z.namelist() if n.startswith("accelerate_c/_C") and n.endswith(".so")]
        assert len(so_names) == 1
        z.extract(so_names[0], tmp_path)
    so = str(tmp_path / so_names[0])
    assert _exported(so) == ["PyInit__C"]
    # the CPU-only module works on its own: import it from the extracted wheel
    probe = ("import sys; sys.path.insert(0, %r); import importlib.util as u; "
             "s = u.spec_from_file_location('accelerate_c._C', %r); m = u.module_from_spec(s); "
             "s.loader.exec_module(m); print(m.has_cuda, m.cuda_device_count())") % (str(tmp_path), so)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=wait_s(60))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "0"]


def test_console_script_help_and_env():
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    assert exe, "accelerate-c console script not installed"
    res = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=wait_s(60))
    assert res.returncode == 0 and "env" in res.stdout
    res = subprocess.run([exe, "env"], capture_output=True, text=True, timeout=wait_s(120))
    assert res.returncode == 0
    assert f"accelerate_c version: {accelerate_c.__version__}" in res.stdout
    assert "C core built with CUDA" in res.stdout
