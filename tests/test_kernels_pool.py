"""The thread pool behind accelerate_c._C's kernels: results independent of the thread count,
the heap path for many chunks, concurrent Python callers, fork safety, GIL release, and the
OpenMP / pthread backends giving the same bits."""
import math
import os
import select
import signal
import sys
import threading
import time

import pytest
import torch

import accelerate_c
from accelerate_c import _C

from conftest import (
    CHUNK,
    DTYPES,
    assert_bitwise,
    assert_stats,
    dtype_param,
    finite_data,
    int_view,
    ref_stats,
    scale_ref,
    wide_data,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")


# ---------------------------------------------------------------------------------------------
# determinism, large buffers, concurrency


@pytest.mark.parametrize("n", [3 * CHUNK + 5, (1 << 20) + 3])
@dtype_param
def test_results_independent_of_thread_count(isa, dtype, n):
    base = wide_data(n, dtype, seed=700 + n) if dtype is torch.float32 else finite_data(n, dtype, 700 + n)
    results = []
    for k in (1, 2, 3, 8):
        _C.set_num_threads(k)
        t = base.clone()
        results.append((_C.stats(base), _C.scale_stats_(t, 3.7), t))
    s0, ss0, t0 = results[0]
    assert_stats(s0, base)
    for s, ss, t in results[1:]:
        assert s == s0 and ss == ss0  # bit-identical doubles
        assert torch.equal(int_view(t), int_view(t0))


def test_heap_partials_path(isa):
    """More than 256 chunks (16 Mi elements): partial results live on the heap."""
    _C.set_num_threads(2)
    n = 256 * CHUNK + 70000
    t = finite_data(2 * CHUNK + 7, torch.bfloat16, seed=9).repeat(129)[:n].clone()
    t[-1] = math.inf
    assert_stats(_C.stats(t), t)
    ref = scale_ref(t, 0.5)
    got = _C.scale_stats_(t, 0.5)
    assert_bitwise(t, ref)
    assert_stats(got, ref)


def test_concurrent_python_threads(isa):
    """Several Python threads calling the kernels at once (serialised in the pool) all get
    their own correct results."""
    _C.set_num_threads(2)
    datas = [finite_data(3 * CHUNK + 5 + i, DTYPES[i % 3], seed=800 + i) for i in range(6)]
    refs = [ref_stats(d) for d in datas]
    scaled_refs = [scale_ref(d, 0.25) for d in datas]
    errors = []

    def work(i):
        try:
            for _ in range(5):
                got = _C.stats(datas[i])
                if not (abs(got[0] - refs[i][0]) <= 1e-9 * refs[i][0] and got[1:] == refs[i][1:]):
                    errors.append((i, got, refs[i]))
            t = datas[i].clone()
            _C.scale_(t, 0.25)
            if not torch.equal(int_view(t), int_view(scaled_refs[i])):
                errors.append((i, "scale_"))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    ths = [threading.Thread(target=work, args=(i,)) for i in range(len(datas))]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert not any(th.is_alive() for th in ths), "kernel call hung"
    assert errors == []


# ---------------------------------------------------------------------------------------------
# fork safety and GIL release


def _wait_child(pid, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"forked child {pid} did not finish within {timeout}s (pool hung after fork?)")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pool_works_in_forked_child(isa):
    _C.set_num_threads(2)
    n = (1 << 20) + 3  # 17 chunks
    t = finite_data(n, torch.float32, seed=21)
    expect = ref_stats(t)
    s1 = _C.stats(t)  # starts the pool's worker in the parent
    assert_stats(s1, t)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only our kernels, no pytest machinery
        code = 1
        try:
            os.close(r)
            got = _C.stats(t)
            got2 = _C.stats(t)
            ok = (abs(got[0] - expect[0]) <= 1e-9 * expect[0] and got[1] == expect[1] and got[2] is False
                  and got == got2 and _C.get_num_threads() == 2)
            os.write(w, repr(got).encode())
            code = 0 if ok else 1
        finally:
            os._exit(code)
    os.close(w)
    status = _wait_child(pid, 30)
    ready, _, _ = select.select([r], [], [], 1)
    msg = os.read(r, 4096).decode() if ready else ""
    os.close(r)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}, got {msg}, expected {expect}"
    assert _C.stats(t) == s1  # parent's pool still fine


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_runs_kernels():
    """Forking while a pool job may be in flight: the child's pool must start clean. Both
    sides use a Buffer, so nothing but our kernels runs around the fork."""
    _C.set_num_threads(2)
    t = finite_data(4 * CHUNK, torch.float32, seed=22)
    buf = _C.Buffer(t)
    expect = ref_stats(t)
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            _C.stats(buf)

    th = threading.Thread(target=spin)
    th.start()
    try:
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    got = _C.stats(buf)
                    code = 0 if (abs(got[0] - expect[0]) <= 1e-9 * expect[0] and got[1:] == expect[1:]) else 1
                finally:
                    os._exit(code)
            status = _wait_child(pid, 30)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        stop.set()
        th.join(30)
    assert not th.is_alive()


def test_gil_released_during_kernels():
    _C.set_num_threads(2)
    n = 1 << 24
    t = torch.ones(n)
    h = torch.empty(n, dtype=torch.float16)
    counter = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            counter[0] += 1

    kernels = {
        "scale_": lambda: _C.scale_(t, 1.0),
        "stats": lambda: _C.stats(t),
        "nonfinite": lambda: _C.nonfinite(t),
        "scale_stats_": lambda: _C.scale_stats_(t, 1.0),
        "cast_": lambda: _C.cast_(h, t),
    }
    progress = dict.fromkeys(kernels, 0)
    old = sys.getswitchinterval()
    # a long switch interval: the spinning thread can only run while the main thread is in a
    # kernel call if that call released the GIL
    sys.setswitchinterval(0.05)
    th = threading.Thread(target=spin)
    th.start()
    try:
        time.sleep(0.02)  # let the thread start
        # up to 30 rounds, until each kernel saw progress once: on a loaded machine the spinning
        # thread may not be scheduled during a short call; a call holding the GIL never lets it
        # run a bytecode, however many rounds (a C call is not preempted at the switch interval)
        for _ in range(30):
            for name, call in kernels.items():
                c0 = counter[0]
                call()
                progress[name] += counter[0] - c0
            if all(p > 0 for p in progress.values()):
                break
    finally:
        stop.set()
        th.join(10)
        sys.setswitchinterval(old)
    stuck = [name for name, p in progress.items() if p <= 0]
    assert not stuck, f"no Python bytecode ran in another thread during {stuck}: GIL not released"
    assert _C.stats(t) == (float(n), 1.0, False)
    assert torch.equal(h, torch.ones(n, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# pool backends


def test_pool_backend_borrows_torchs_openmp_and_results_do_not_depend_on_it():
    """With torch imported, libgomp is loaded and the kernels run on torch's OpenMP team
    (no second set of threads fighting torch's spinning workers); the pthread workers give
    bit-identical results, since work is split into the same fixed chunks."""
    assert _C.pool_backend() == "openmp"
    data = finite_data(3 * CHUNK + 77, torch.float32, seed=11)
    results = {}
    try:
        for backend in ("openmp", "pthread"):
            _C.set_pool_backend(backend)
            assert _C.pool_backend() == backend
            t = data.clone()
            results[backend] = (_C.stats(t), _C.sumsq(t), _C.scale_stats_(t, 0.37), t)
    finally:
        _C.set_pool_backend("auto")
    a, b = results["openmp"], results["pthread"]
    assert a[:3] == b[:3]
    assert_bitwise(a[3], b[3])
    with pytest.raises(accelerate_c.CoreError, match="unknown pool backend"):
        _C.set_pool_backend("gpu")
