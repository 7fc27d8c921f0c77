"""How the C safetensors writer writes: atomically (a failed export, a write failing midway, a
read-only or missing directory leave the old file and no temporary one) and through O_DIRECT
(ACCELERATE_C_DIRECT_IO: the same bytes as the package, the off / auto / forced choice, bad
values, failures, per-thread mode, the GIL released)."""
import mmap
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import safetensors.torch as st_pkg

from accelerate_c import CoreError, _C
from accelerate_c.safetensors_io import load_file, read_metadata, save_file

from safetensors_helpers import DIRECT_ENV, as_bytes, random_tensor, sorted_listdir
from timeouts import wait_s


# ---- atomic writes -------------------------------------------------------------------------------

class _BadExport:
    def __dlpack__(self, *a, **k):
        raise RuntimeError("export failed on purpose")


def test_failed_export_leaves_old_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    # the producer's error, under the name of the tensor that failed (the kernels' DLPack rule)
    with pytest.raises(TypeError, match="'b': cannot export the tensor through DLPack: export failed on purpose"):
        _C.st_save(str(path), ["a", "b"], [torch.zeros(4), _BadExport()], None, 0)
    assert path.read_bytes() == before
    assert sorted_listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.parametrize("direct_io,mode", [("0", "buffered"), ("1", "direct"), ("auto", "direct")])
def test_failed_write_midway_leaves_old_file_and_no_temp(tmp_path, direct_io, mode):
    """A file-size limit makes pwrite fail with EFBIG in the middle of the data region (in a
    child process, so the limit does not touch pytest); through the page cache and with O_DIRECT
    (which "auto" picks for this 16 MiB file)."""
    if mode == "direct":
        _need_o_direct(tmp_path)
    path = tmp_path / "x.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from accelerate_c import CoreError, _C
        from accelerate_c.safetensors_io import save_file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_file({{"big": torch.ones(4 << 20)}}, {str(path)!r}, threads=4)
        except CoreError as e:
            print("ERR", e.code, e)
        print("MODE", _C.st_last_write_mode())
    """)
    env = dict(os.environ, ACCELERATE_C_DIRECT_IO=direct_io)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=wait_s(120), env=env)
    assert "ERR AC_ERR_IO" in out.stdout, out.stdout + out.stderr
    assert "writing tensor 'big'" in out.stdout and "File too large" in out.stdout
    assert f"MODE {mode}" in out.stdout, out.stdout
    assert path.read_bytes() == before
    assert sorted_listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
            save_file({"a": torch.zeros(2)}, d / "x.safetensors")
        assert ei.value.code == "AC_ERR_IO"
        assert sorted_listdir(d) == []
    finally:
        d.chmod(0o755)


def test_missing_directory(tmp_path):
    with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
        save_file({"a": torch.zeros(2)}, tmp_path / "no" / "x.safetensors")
    assert ei.value.code == "AC_ERR_IO"


# ---- the O_DIRECT write path (ACCELERATE_C_DIRECT_IO) -------------------------------------------

DIRECT_MIN = 4 << 20  # ST_DIRECT_MIN_BYTES in csrc/core/st_write.c: "auto" goes direct from here


def _need_o_direct(directory):
    """Skips the test if the file system of `directory` refuses O_DIRECT (tmpfs before Linux 6.6,
    some FUSE file systems); our writer would then fall back to buffered writes."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        pytest.skip("this platform has no O_DIRECT")
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
    except OSError as e:
        if os.path.exists(probe):
            os.unlink(probe)
        pytest.skip(f"the file system of {directory} refuses O_DIRECT: {e}")
    try:
        os.write(fd, mmap.mmap(-1, 4096))  # an anonymous map is page-aligned
    except OSError as e:
        pytest.skip(f"the file system of {directory} refuses O_DIRECT writes: {e}")
    finally:
        os.close(fd)
        os.unlink(probe)


def _checkpoint_like(gen):
    """Tensors that cross the 8 MiB chunk boundaries at odd offsets, of several dtypes, with
    zero-size ones and a scalar, in a file whose size is not a multiple of 4096."""
    return {
        "embed.weight": torch.randn(3 << 20, generator=gen),  # 12 MiB: crosses a chunk boundary
        "head.weight": torch.randn(1000, 1001, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(9 << 20, generator=gen) > 0.5,  # 9 MiB of bool: crosses the next one
        "odd": random_tensor(torch.uint8, (4097,), gen),
        "norm.bias": torch.randn(17, generator=gen).double(),
        "empty": torch.zeros(0, 3),
        "step": torch.tensor(7, dtype=torch.int64),
        "f8": random_tensor(torch.float8_e4m3fn, (333,), gen),
    }


def test_direct_io_forced_writes_the_same_bytes(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    gen = torch.Generator().manual_seed(11)
    tensors = _checkpoint_like(gen)
    meta = {"format": "pt"}
    path = tmp_path / "d.safetensors"
    monkeypatch.setenv(DIRECT_ENV, "1")
    for threads in (0, 1, 3):
        save_file(tensors, path, metadata=meta, threads=threads)
        assert _C.st_last_write_mode() == "direct"
        # the reference: the safetensors package's bytes for the same tensors
        assert path.read_bytes() == st_pkg.save(tensors, metadata=meta), threads
    assert os.path.getsize(path) % 4096 != 0  # the padding of the last chunk was cut off
    for loaded in (st_pkg.load_file(str(path)), load_file(path)):
        assert set(loaded) == set(tensors)
        for k, t in tensors.items():
            assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape
            assert torch.equal(as_bytes(loaded[k]), as_bytes(t)), k
    assert read_metadata(path) == meta
    # a file smaller than one 4096-byte block, and one with no tensors at all
    for small in ({"x": torch.arange(5)}, {}):
        save_file(small, path)
        assert _C.st_last_write_mode() == "direct"
        assert path.read_bytes() == st_pkg.save(small)
    assert sorted_listdir(tmp_path) == ["d.safetensors"]


def test_direct_io_off_and_auto(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    gen = torch.Generator().manual_seed(12)
    big = {"w": torch.randn((DIRECT_MIN // 4) + 1, generator=gen)}  # just above the threshold
    small = {"w": torch.randn(1000, generator=gen)}
    path = tmp_path / "x.safetensors"
    cases = [("0", big, "buffered"), ("0", small, "buffered"), ("auto", big, "direct"), ("auto", small, "buffered"),
             (None, big, "direct"), (None, small, "buffered"), ("", big, "direct"), ("1", small, "direct")]
    for value, tensors, mode in cases:
        if value is None:
            monkeypatch.delenv(DIRECT_ENV, raising=False)
        else:
            monkeypatch.setenv(DIRECT_ENV, value)
        save_file(tensors, path)
        assert _C.st_last_write_mode() == mode, (value, len(tensors["w"]))
        assert path.read_bytes() == st_pkg.save(tensors)
    assert sorted_listdir(tmp_path) == ["x.safetensors"]


def test_direct_io_bad_value(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    for value in ("yes", "2", "true", " 1"):
        monkeypatch.setenv(DIRECT_ENV, value)
        with pytest.raises(CoreError, match=f"invalid value '{value}' of the environment variable {DIRECT_ENV}") as ei:
            save_file({"a": torch.zeros(2)}, path)
        assert ei.value.code == "AC_ERR_INVALID_ARG"
        assert "x.safetensors" in str(ei.value) and "use auto" in str(ei.value)
        assert _C.st_last_write_mode() == "none"
    assert sorted_listdir(tmp_path) == []


def test_direct_io_failures_leave_nothing(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "1")
    with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
        save_file({"a": torch.zeros(2)}, tmp_path / "no" / "x.safetensors")
    assert ei.value.code == "AC_ERR_IO"
    assert _C.st_last_write_mode() == "none"
    # a target that is a directory: the data is written (directly) to the temp file, the rename fails
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CoreError, match="renaming .*d.safetensors.*tmp into place failed") as ei:
        save_file({"a": torch.zeros(DIRECT_MIN)}, tmp_path / "d.safetensors")
    assert ei.value.code == "AC_ERR_IO"
    assert _C.st_last_write_mode() == "direct"
    assert sorted_listdir(tmp_path) == ["d.safetensors"] and sorted_listdir(tmp_path / "d.safetensors") == []


def test_direct_io_mode_is_per_thread(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "auto")
    save_file({"w": torch.zeros(DIRECT_MIN)}, tmp_path / "a.safetensors")
    seen = []

    def other():
        seen.append(_C.st_last_write_mode())
        save_file({"w": torch.zeros(10)}, tmp_path / "b.safetensors")
        seen.append(_C.st_last_write_mode())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == ["none", "buffered"]
    assert _C.st_last_write_mode() == "direct"


def test_direct_io_releases_the_gil(tmp_path, monkeypatch):
    """The main thread keeps running Python while another thread's direct save is in the C writer."""
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "1")
    # 256 MiB: a save of ~100 ms even on a 2.5 GB/s disk, so the main thread has many 1 ms
    # sleeps to take while the writer runs; with the GIL held it would take at most the one or
    # two before the writer enters C
    tensors = {"w": torch.zeros(256 << 20, dtype=torch.uint8)}
    started, ticks = threading.Event(), []

    def save():
        started.set()
        save_file(tensors, tmp_path / "g.safetensors", threads=1)

    t = threading.Thread(target=save)
    t.start()
    started.wait()
    while t.is_alive():
        ticks.append(1)
        time.sleep(0.001)
    t.join()
    assert len(ticks) > 3
    assert (tmp_path / "g.safetensors").stat().st_size > 256 << 20
