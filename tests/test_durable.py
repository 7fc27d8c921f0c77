"""Durable writes (accelerate_c.durable, csrc/core/durable.c): concurrent writers of one target,
and the order of fsyncs and renames as the system sees it.

The order is observed from outside the code under test: an LD_PRELOAD shim (tests/shim/
fsync_log.c, built here with the system C compiler) logs every fsync/fdatasync/rename of a
subprocess with the paths involved, and the checker below replays that log against the POSIX
rule for a crash-safe publish: a file's data is fsynced before the rename that publishes it,
and the directory holding the new name is fsynced after that rename (and before the directory
itself is renamed anywhere).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

from accelerate_c import safetensors_io
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM_SRC = os.path.join(HERE, "shim", "fsync_log.c")
ENV = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))


# ---- concurrency ------------------------------------------------------------------------------------
def _chunked_writer(payload: bytes):
    def write(f):
        for i in range(0, len(payload), 4096):  # many small writes: a wide window for a clash
            f.write(payload[i:i + 4096])
    return write


@pytest.mark.parametrize("api", ["write_durable", "save_file"])
def test_threads_writing_one_target_each_publish_a_whole_file(tmp_path, api):
    """Eight threads publish eight different contents to one path, 25 times each: every write
    succeeds, the file is always exactly one thread's content, and no temporary file is left."""
    import torch

    target = tmp_path / ("state.bin" if api == "write_durable" else "t.safetensors")
    payloads = [bytes([65 + i]) * (64 << 10) for i in range(8)]
    tensors = [{"x": torch.full((4096,), float(i))} for i in range(8)]
    errors = []
    start = threading.Barrier(8)

    def worker(i):
        start.wait()
        try:
            for _ in range(25):
                if api == "write_durable":
                    safetensors_io.write_durable(target, _chunked_writer(payloads[i]))
                else:
                    safetensors_io.save_file(tensors[i], target)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    if api == "write_durable":
        assert target.read_bytes() in payloads
    else:
        got = safetensors_io.load_file(target)["x"]
        assert any(torch.equal(got, t["x"]) for t in tensors)
    assert os.listdir(tmp_path) == [target.name]


def test_a_failing_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.json"
    safetensors_io.write_durable(target, lambda f: f.write(b"old"))

    def fail(f):
        f.write(b"half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        safetensors_io.write_durable(target, fail)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_missing_directory_is_named(tmp_path):
    from accelerate_c import CoreError
    from accelerate_c.durable import write_bytes_durable

    with pytest.raises(CoreError, match=r"nope/f\.json: cannot create the temporary file"):
        write_bytes_durable(tmp_path / "nope" / "f.json", b"x")


# ---- fsync order, observed with an LD_PRELOAD shim ----------------------------------------------------
@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    cc = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) to build the fsync-logging LD_PRELOAD shim")
    out = str(tmp_path_factory.mktemp("shim") / "fsync_log.so")
    res = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o", out, SHIM_SRC, "-ldl"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return out


def run_logged(shim, tmp_path, code):
    log = tmp_path / "fsync.log"
    env = dict(ENV, LD_PRELOAD=shim, FSYNC_LOG=str(log))
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         cwd=str(tmp_path), timeout=wait_s(300))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert log.exists(), "the shim logged nothing: LD_PRELOAD did not take effect"
    return [line.split("\t") for line in log.read_text().splitlines()]


def replay(events, root):
    """Replays the log: returns ({path: its data was fsynced}, {directory: has unsynced entries})
    for paths under ``root``. A rename carries the state of what it moves (a directory's dirty
    entries move with it) and makes both parent directories dirty; an fsync of a path makes its
    data (a file) or its entries (a directory) durable. Raises AssertionError for a rename of
    something whose data was never fsynced, or of a directory with unsynced entries."""
    root = os.path.realpath(root)
    synced, dirty = {}, set()
    for ev in events:
        if ev[0] == "fsync":
            p = os.path.realpath(ev[1])
            synced[p] = True
            dirty.discard(p)
        elif ev[0] == "rename":
            src, dst = os.path.realpath(ev[1]), os.path.realpath(ev[2])
            if not src.startswith(root):
                continue
            assert synced.get(src), f"{src} renamed to {dst} before its data was fsynced"
            assert src not in dirty, f"directory {src} renamed to {dst} with entries not fsynced"
            prefix = src + os.sep
            for p in [p for p in synced if p.startswith(prefix)]:
                synced[dst + p[len(src):]] = synced.pop(p)
            for d in [d for d in dirty if d.startswith(prefix)]:
                dirty.discard(d)
                dirty.add(dst + d[len(src):])
            synced.pop(src, None)
            synced[dst] = True
            dirty.add(os.path.dirname(src))
            dirty.add(os.path.dirname(dst))
    return synced, dirty


def assert_published_durably(events, root, paths):
    synced, dirty = replay(events, root)
    for p in paths:
        p = os.path.realpath(p)
        assert os.path.isfile(p), p
        assert synced.get(p), f"{p}: no fsync of its data reached it before it was published"
        d = os.path.dirname(p)
        while d.startswith(os.path.realpath(root)):
            assert d not in dirty, f"{p}: the directory {d} was not fsynced after the rename that published it"
            d = os.path.dirname(d)


def test_write_durable_fsyncs_the_file_then_renames_then_fsyncs_the_directory(shim, tmp_path):
    events = run_logged(shim, tmp_path, f"""
        from accelerate_c.safetensors_io import write_durable
        write_durable({str(tmp_path / "a.bin")!r}, lambda f: f.write(b"payload"))
    """)
    path = os.path.realpath(tmp_path / "a.bin")
    # only what happened under tmp_path: the child interpreter may write .pyc files of its own
    root = os.path.realpath(tmp_path)
    events = [e for e in events if all(os.path.realpath(x).startswith(root) for x in e[1:])]
    names = [(e[0], os.path.basename(e[-1])) for e in events]
    assert [n[0] for n in names] == ["fsync", "rename", "fsync"], events
    assert names[1][1] == "a.bin" and events[0][1] == events[1][1]  # the temp file is what was fsynced
    assert os.path.realpath(events[2][1]) == os.path.dirname(path)
    assert_published_durably(events, tmp_path, [path])


def test_save_state_save_and_save_model_publish_every_file_durably(shim, tmp_path):
    events = run_logged(shim, tmp_path, f"""
        import torch
        from torch import nn
        from accelerate_c import Accelerator
        acc = Accelerator(cpu=True, mixed_precision="fp16")
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        model, opt, sched = acc.prepare(model, opt, sched)
        acc.backward(model(torch.randn(4, 8)).sum())
        opt.step(); sched.step(); opt.zero_grad()
        acc.save_state({str(tmp_path)!r} + "/ck")
        acc.save_state({str(tmp_path)!r} + "/pk", safe_serialization=False)
        acc.save({{"a": 1}}, {str(tmp_path)!r} + "/obj.pt")
        acc.save_model(model, {str(tmp_path)!r} + "/m", max_shard_size=600)
        acc.save_model(model, {str(tmp_path)!r} + "/mb", max_shard_size=600, safe_serialization=False)
    """)
    files = [os.path.join(d, f) for sub in ("ck", "pk", "m", "mb") for d, _, fs in os.walk(tmp_path / sub) for f in fs]
    files.append(str(tmp_path / "obj.pt"))
    assert len(files) > 15 and any(f.endswith("model-00002-of-00002.safetensors") for f in files), files
    assert any(f.endswith("pytorch_model-00001-of-00002.bin") for f in files), files
    assert_published_durably(events, tmp_path, files)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".")]


def test_publish_with_a_bad_path_closes_the_descriptor_and_removes_the_temporary(tmp_path):
    """durable_publish owns the descriptor it is given: a path it cannot even convert (a NUL in
    it) still closes the file and removes the temporary, as its contract says."""
    from accelerate_c import _C

    fd, tmp = _C.durable_open(str(tmp_path / "x.bin"))
    with pytest.raises(ValueError):
        _C.durable_publish(str(tmp_path / "x\0.bin"), tmp, fd)
    assert not os.path.exists(tmp)
    with pytest.raises(OSError):
        os.fstat(fd)
