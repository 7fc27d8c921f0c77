"""Reference and memory leaks of accelerate_c._C: many successful and failing calls must not grow
the process (RSS), the input tensor's Python refcount, the number of gc-tracked objects, or
keep the tensor's C++ side alive after the last Python reference goes (checked with a weakref:
torch keeps a tensor's Python object alive while a DLPack export still holds the tensor)."""
import gc
import sys
import weakref

import psutil
import pytest
import torch

from accelerate_c import _C

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")

MiB = 1 << 20
# A leaked DLManagedTensor (+ its ATen reference, shape and strides) is >= 100 bytes, so 10**5
# leaked calls would add >= 10 MiB; 8 MiB leaves room for allocator noise.
RSS_BOUND = 8 * MiB
# Buffers / failing calls run 10**4 times: a leak of a few hundred bytes each is ~2+ MiB.
RSS_BOUND_SMALL = 2 * MiB
# gc-tracked objects may wobble by a few (pytest, caches), never by one per call.
GC_SLACK = 200

_proc = psutil.Process()


def _rss():
    gc.collect()
    return _proc.memory_info().rss


def check_no_leak(fn, calls, tensors, bound):
    """Runs fn `calls` times after a warm-up; asserts RSS growth < bound, unchanged refcounts
    of `tensors`, and a flat count of gc-tracked objects."""
    for _ in range(min(2000, calls)):
        fn()
    gc.collect()
    refs = [sys.getrefcount(t) for t in tensors]
    objs = len(gc.get_objects())
    r0 = _rss()
    for _ in range(calls):
        fn()
    r1 = _rss()
    grown = r1 - r0
    assert grown < bound, f"RSS grew by {grown / MiB:.2f} MiB over {calls} calls (bound {bound / MiB} MiB)"
    assert [sys.getrefcount(t) for t in tensors] == refs, "refcount of an input changed"
    assert abs(len(gc.get_objects()) - objs) < GC_SLACK, (
        f"gc-tracked objects went from {objs} to {len(gc.get_objects())}")


def assert_freed(make_and_use):
    """The tensor made and used inside is freed once its last Python reference goes: no
    DLPack owner was leaked by the calls."""
    t = make_and_use()
    w = weakref.ref(t)
    del t
    gc.collect()
    assert w() is None, "the tensor is still alive: a DLPack owner was leaked"


@pytest.fixture(autouse=True)
def _two_threads():
    old = _C.get_num_threads()
    _C.set_num_threads(2)
    yield
    _C.set_num_threads(old)


def test_stats_scale_cast_do_not_leak():
    t = torch.randn(64)
    h = torch.zeros(64, dtype=torch.float16)
    b = torch.zeros(64, dtype=torch.bfloat16)
    check_no_leak(lambda: _C.stats(t), 10**5, [t], RSS_BOUND)
    check_no_leak(lambda: _C.scale_(t, 1.0), 10**5, [t], RSS_BOUND)
    check_no_leak(lambda: _C.cast_(h, t), 10**5, [t, h], RSS_BOUND)
    check_no_leak(lambda: (_C.scale_stats_(b, 1.0), _C.nonfinite(h)), 2 * 10**4, [b, h], RSS_BOUND_SMALL)
    # the results are still right after all that
    assert torch.equal(h, t.half())
    assert _C.stats(t)[1] == t.abs().max().item()

    def use():
        x = torch.randn(64)
        y = torch.zeros(64, dtype=torch.bfloat16)
        for _ in range(100):
            _C.stats(x)
            _C.scale_(x, 1.0)
            _C.scale_stats_(x, 1.0)
            _C.nonfinite(x)
            _C.cast_(y, x)
            _C.cast_(x, y)
        return x

    assert_freed(use)


def test_multichunk_calls_do_not_leak():
    # more than one chunk: the pool path, and > 256 chunks would use heap partials
    t = torch.randn(3 * 65536 + 5)
    check_no_leak(lambda: _C.stats(t), 2000, [t], RSS_BOUND_SMALL)
    big = torch.zeros(256 * 65536 + 1, dtype=torch.bfloat16)
    check_no_leak(lambda: _C.stats(big), 20, [big], RSS_BOUND_SMALL)


def test_buffers_do_not_leak():
    t = torch.randn(64)

    def make():
        buf = _C.Buffer(t)
        _C.scale_(buf, 1.0)
        return buf.numel

    check_no_leak(make, 10**4, [t], RSS_BOUND_SMALL)
    bufs = [_C.Buffer(t) for _ in range(100)]
    assert all(b.data_ptr == t.data_ptr() for b in bufs)
    del bufs

    def use():
        x = torch.randn(64)
        for _ in range(1000):
            _C.stats(_C.Buffer(x))
        held = _C.Buffer(x)  # freed with the test frame below
        del held
        return x

    assert_freed(use)


def test_raw_capsules_do_not_leak():
    t = torch.randn(64)

    def legacy():
        _C.stats(t.__dlpack__())

    def versioned():
        _C.scale_(t.__dlpack__(max_version=(1, 0)), 1.0)

    check_no_leak(legacy, 10**4, [t], RSS_BOUND_SMALL)
    check_no_leak(versioned, 10**4, [t], RSS_BOUND_SMALL)

    def use():
        x = torch.randn(64)
        for _ in range(500):
            _C.stats(x.__dlpack__())
            _C.stats(x.__dlpack__(max_version=(1, 0)))
            c = x.__dlpack__()
            _C.stats(c)
            try:
                _C.stats(c)  # already consumed
            except ValueError:
                pass
        return x

    assert_freed(use)


def test_failing_calls_do_not_leak():
    wrong = torch.zeros(64, dtype=torch.int64)
    strided = torch.zeros(128)[::2]
    grad = torch.zeros(64, requires_grad=True)
    ok = torch.zeros(64)
    short = torch.zeros(63, dtype=torch.float16)

    def fail(call, exc):
        def run():
            try:
                call()
            except exc:
                return
            raise AssertionError("expected an exception")
        return run

    check_no_leak(fail(lambda: _C.stats(wrong), TypeError), 10**4, [wrong], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.scale_(strided, 2.0), ValueError), 10**4, [strided], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.scale_(grad, 2.0), TypeError), 5000, [grad], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.cast_(short, ok), ValueError), 10**4, [short, ok], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.cast_(ok, wrong), TypeError), 10**4, [ok, wrong], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.Buffer(wrong), TypeError), 10**4, [wrong], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.stats([1.0]), TypeError), 10**4, [], RSS_BOUND_SMALL)
    check_no_leak(fail(lambda: _C.set_kernel_isa("bogus"), _C.CoreError), 10**4, [], RSS_BOUND_SMALL)

    def use_wrong():
        x = torch.zeros(64, dtype=torch.float64)
        for _ in range(500):
            for call in (lambda: _C.stats(x), lambda: _C.Buffer(x), lambda: _C.cast_(ok, x)):
                try:
                    call()
                except TypeError:
                    pass
        return x

    assert_freed(use_wrong)

    def use_mismatch():
        # dst taken, then src rejected: both views must be released
        x = torch.zeros(63)
        for _ in range(500):
            try:
                _C.cast_(x, ok)
            except ValueError:
                pass
            try:
                _C.cast_(ok, x)
            except ValueError:
                pass
            try:
                _C.cast_(x, wrong)
            except TypeError:
                pass
        return x

    assert_freed(use_mismatch)


def test_reducer_and_hooks_do_not_leak():
    """Reducer (the C bucket plan) and its GradHooks: building, calling (hot path, slow path,
    launch callback, the measuring hooks and sums()), the double-mark error, and the reference cycle through the glue's bound
    methods (collected by gc through tp_traverse)."""
    flat = torch.zeros(400)
    buf = _C.Buffer(flat)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 5)]

    class Glue:
        def __init__(self):
            self.r = _C.Reducer([10, 300, 5], [2, 1, 0], 4, 64, 1024, 32, on_first=self.first,
                                launch=self.launch, slow=self.slow)  # a cycle: glue -> r -> glue

        def first(self):
            pass

        def launch(self, a, b):
            pass

        def slow(self, i, p):
            return True

    def once():
        g = Glue()
        g.r.set_buffer(buf)
        offs, _ = g.r.layout()
        views = [flat[o:o + p.numel()] for o, p in zip(offs, params)]
        hooks = [g.r.hook(i, v) for i, v in enumerate(views)]
        g.r.launching = True
        for i, p in enumerate(params):
            p.grad = views[i] if i != 1 else torch.zeros(300)  # param 1 takes the slow path
            hooks[i](p)
        try:
            hooks[0](params[0])  # marked twice in one backward
        except _C.CoreError:
            pass
        g.r.reset()
        g.r.launching = False  # one process: the hooks measure each gradient for clip
        g.r.measure = True
        for i, p in enumerate(params):
            p.grad = views[i] if i != 1 else torch.zeros(300)
            hooks[i](p)
        # the slow path here leaves param 1's gradient apart from its view: not measured
        assert g.r.measured == 2 and g.r.sums(flat._version) is None
        g.r.reset()

    check_no_leak(once, 3000, [flat], RSS_BOUND_SMALL)

    def make_and_use():  # the buffer and the views die with the reducer, its hooks and the glue
        t = torch.zeros(400)
        g = Glue()
        g.r.set_buffer(_C.Buffer(t))
        h = g.r.hook(0, t[:10])
        params[0].grad = t[:10]
        g.r.launching = True
        h(params[0])
        params[0].grad = None
        return t

    assert_freed(make_and_use)
