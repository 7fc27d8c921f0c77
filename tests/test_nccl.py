"""NCCL called from C (csrc/core/comm_nccl.c, csrc/python/comm_py.c, the Reducer's C launch),
on this GPU-less machine: the loader's errors, and every call through a stand-in libnccl
(tests/c/fake_nccl.c: one rank, host memory, counts its calls). The real NCCL path runs in
benchmarks/gpu_check.sh on a GPU machine. Each case runs in a fresh interpreter, because the
first successful load of NCCL stays for the life of a process."""
import os
import subprocess
import sys
import textwrap

import pytest
from timeouts import wait_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def fake_nccl(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl") / "libfake_nccl.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", os.path.join(ROOT, "tests", "c", "fake_nccl.c"), "-o", str(out)],
                   check=True)
    return str(out)


# prepended to every case: expect() fails when the call raises nothing
EXPECT = """
def expect(exc, text, fn):
    try:
        fn()
    except exc as e:
        assert text in str(e), (text, str(e))
        return
    raise AssertionError(f"no {exc} containing {text!r} was raised")
"""


def run(code, **env):
    res = subprocess.run([sys.executable, "-c", EXPECT + textwrap.dedent(code)], capture_output=True, text=True, timeout=wait_s(120),
                         env={**os.environ, **env})
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def test_missing_nccl_is_a_clear_error():
    out = run("""
        from accelerate_c import _C, nccl
        try:
            _C.nccl_load("/nonexistent/libnccl.so.2")
        except _C.CoreError as e:
            print("explicit:", e, e.code)
        try:
            nccl.load()  # the process, libnccl.so.2, pip's nvidia-nccl: none here
        except RuntimeError as e:
            print("search:", e)
        """)
    assert "explicit: " in out and "NCCL could not be loaded from /nonexistent/libnccl.so.2" in out
    assert "AC_ERR_UNSUPPORTED" in out
    assert "search: accelerate_c needs NCCL for GPU gradient all-reduce" in out


def test_communicator_calls_reach_nccl(fake_nccl):
    out = run(f"""
        import ctypes, torch
        from accelerate_c import _C
        assert _C.nccl_load({fake_nccl!r}) == {fake_nccl!r}
        fake = ctypes.CDLL({fake_nccl!r})
        fake.fake_nccl_last_stream.restype = ctypes.c_void_p
        assert _C.nccl_version() == 29999
        uid = _C.nccl_unique_id()
        assert isinstance(uid, bytes) and len(uid) == 128
        expect(_C.CoreError, "ncclCommInitRank failed: NCCL error 4 (invalid argument (fake))",
               lambda: _C.NcclComm(uid, 2, 0))
        expect(ValueError, "128 bytes", lambda: _C.NcclComm(b"short", 1, 0))
        c = _C.NcclComm(uid, 1, 0)
        assert (c.size, c.rank) == (1, 0)
        t = torch.arange(6.0)
        ref = t.clone()
        c.all_reduce(t, op="sum", stream=0x99)
        assert fake.fake_nccl_all_reduce_calls() == 1 and fake.fake_nccl_last_stream() == 0x99
        assert torch.equal(t, ref)  # one rank: the sum is the input
        c.broadcast(t, root=0)
        out = torch.zeros(6)
        c.all_gather(t, out)
        assert torch.equal(out, ref)
        c.reduce_scatter(t.bfloat16(), torch.zeros(6, dtype=torch.bfloat16), op="avg")
        for bad, msg in [(lambda: c.all_gather(t, torch.zeros(5)), "expected 6"),
                         (lambda: c.all_reduce(t, op="mean"), "op must be one of"),
                         (lambda: c.broadcast(t, root=3), "root 3 of 1 ranks"),
                         (lambda: c.all_reduce(torch.zeros(3, dtype=torch.int32)), "dtype")]:
            expect((ValueError, TypeError, _C.CoreError), msg, bad)
        # send and recv on two devices (a capsule claiming CUDA device 1): refused before NCCL runs
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
        from test_dlpack import HandMade
        calls = fake.fake_nccl_other_calls()
        for s_, r_, msg in [(t, HandMade(torch.zeros(6), (6,), device_type=2, device_id=1).capsule,
                             "all_gather: recv is on cuda:1 but send is on cpu"),
                            (HandMade(t.clone(), (6,), device_type=2, device_id=0).capsule, torch.zeros(6),
                             "reduce_scatter: recv is on cpu but send is on cuda:0")]:
            fn = c.all_gather if "all_gather" in msg else c.reduce_scatter
            expect(ValueError, msg, lambda: fn(s_, r_))
        assert fake.fake_nccl_other_calls() == calls  # neither reached NCCL
        c.close()
        c.close()
        expect(ValueError, "closed", lambda: c.all_reduce(t))
        print("comm ok")
        """)
    assert "comm ok" in out


def test_reducer_launches_buckets_from_the_hooks_in_c(fake_nccl):
    """The hooks of a Reducer with an NcclComm attached launch each bucket with NCCL as soon as it
    is complete, in bucket order, without calling the Python launch function."""
    out = run(f"""
        import ctypes, torch
        from accelerate_c import _C
        _C.nccl_load({fake_nccl!r})
        fake = ctypes.CDLL({fake_nccl!r})
        fake.fake_nccl_last_stream.restype = ctypes.c_void_p
        fake.fake_nccl_last_count.restype = ctypes.c_size_t
        fake.fake_nccl_last_send.restype = ctypes.c_void_p
        c = _C.NcclComm(_C.nccl_unique_id(), 1, 0)
        python_launches = []
        sizes = [10, 300, 20]  # three buckets: 80 B >= 64, 1200 B >= 1024, the rest
        r = _C.Reducer(sizes, [2, 1, 0], 4, 64, 1024, 32, on_first=lambda: None,
                       launch=lambda a, b: python_launches.append((a, b)), slow=lambda i, p: True)
        flat = torch.zeros(r.total())
        r.attach_nccl(c, _C.Buffer(flat), 0x77, use_events=False)
        r.set_compute_stream(0x55)
        r.launching = True
        offsets, buckets = r.layout()
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        hooks = []
        for i, (o, p) in enumerate(zip(offsets, params)):
            p.grad = flat[o:o + p.numel()]
            hooks.append(r.hook(i, p.grad))
        counts = []
        for i in (1, 2, 0):  # param 1 first: its bucket (1) must wait for bucket 0 (param 2)
            hooks[i](params[i])
            counts.append(fake.fake_nccl_all_reduce_calls())
        assert counts == [0, 2, 3], counts
        assert fake.fake_nccl_last_stream() == 0x77
        # the last bucket, by hand: gradient 0 (10 elements padded to 32) after 32 + 320 elements
        assert fake.fake_nccl_last_count() == 32
        assert fake.fake_nccl_last_send() == flat.data_ptr() + 352 * 4
        assert python_launches == []
        # defer (join_uneven_inputs on a model with several groups): complete buckets wait for
        # the glue's nccl_launch at the end of backward
        r.reset()
        r.defer = True
        for i in (1, 2, 0):
            hooks[i](params[i])
        assert fake.fake_nccl_all_reduce_calls() == 3, fake.fake_nccl_all_reduce_calls()
        r.nccl_launch(0, r.count())
        assert fake.fake_nccl_all_reduce_calls() == 6
        assert fake.fake_nccl_last_send() == flat.data_ptr() + 352 * 4  # still in bucket order
        r.defer = False
        r.nccl_wait()
        expect(TypeError, "Buffer", lambda: r.attach_nccl(c, torch.zeros(3), 0))
        expect(ValueError, "lays out", lambda: r.attach_nccl(c, _C.Buffer(torch.zeros(3)), 0, use_events=False))
        # events need the CUDA runtime, and this machine has no GPU (or no CUDA build)
        expect(_C.CoreError, "CUDA" if _C.has_cuda else "without CUDA", lambda: r.attach_nccl(c, _C.Buffer(flat), 0))
        print("reducer ok")
        """)
    assert "reducer ok" in out
