"""How accelerate_c._C takes tensors in: the versioned DLPack path (torch >= 2.x honours
max_version), the legacy path, raw capsules, views with offsets and odd strides, producers
that refuse writes or export copies, and the Buffer type that keeps a consumed tensor alive."""
import ctypes
import gc
import math
import weakref

import numpy as np
import pytest
import torch

from accelerate_c import _C

from conftest import (
    DTYPE_IDS,
    DTYPE_NAMES,
    DTYPES,
    assert_bitwise,
    assert_stats,
    finite_data,
    int_view,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)

_GetName = ctypes.pythonapi.PyCapsule_GetName
_GetName.restype = ctypes.c_char_p
_GetName.argtypes = [ctypes.py_object]
_CapsuleNew = ctypes.pythonapi.PyCapsule_New
_CapsuleNew.restype = ctypes.py_object
_CapsuleNew.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_FOREIGN_NAME = ctypes.create_string_buffer(b"not_a_dltensor")  # must outlive the capsule
_FOREIGN_TARGET = ctypes.c_double(0.0)


def capsule_name(cap):
    return _GetName(cap).decode()


class LegacyProducer:
    """A producer from before DLPack 1.0: __dlpack__ takes no keyword arguments."""

    def __init__(self, t):
        self.t = t
        self.calls = 0

    def __dlpack__(self):
        self.calls += 1
        return self.t.__dlpack__()

    def __dlpack_device__(self):
        return self.t.__dlpack_device__()


class LegacyWithStream(LegacyProducer):
    """Legacy signature with a stream parameter (still no max_version)."""

    def __dlpack__(self, stream=None):
        self.calls += 1
        return self.t.__dlpack__()


class VersionedProducer:
    """Records the max_version it is asked for and hands out a versioned capsule."""

    def __init__(self, t):
        self.t = t
        self.asked = []

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.asked.append(max_version)
        return self.t.__dlpack__(max_version=max_version)


def all_kernels_agree(make_arg, dtype):
    """Runs every kernel through `make_arg(tensor)` and checks against torch, in place."""
    base = finite_data(1000, dtype, seed=31)
    # stats / nonfinite (read)
    t = base.clone()
    assert_stats(_C.stats(make_arg(t)), base)
    assert _C.nonfinite(make_arg(t)) is False
    # scale_ writes into the original tensor
    t = base.clone()
    _C.scale_(make_arg(t), 3.7)
    assert_bitwise(t, (base.float() * 3.7).to(dtype))
    # scale_stats_
    t = base.clone()
    got = _C.scale_stats_(make_arg(t), 0.5)
    ref = (base.float() * 0.5).to(dtype)
    assert_bitwise(t, ref)
    assert_stats(got, ref)
    # cast_ into / out of the argument
    for other in DTYPES:
        dst = torch.zeros(1000, dtype=other)
        _C.cast_(make_arg(dst), make_arg(base))
        assert_bitwise(dst, base.to(other))


@dtype_param
def test_versioned_path_plain_tensor(dtype):
    all_kernels_agree(lambda t: t, dtype)


@dtype_param
def test_versioned_producer_is_asked_for_1_0(dtype):
    t = finite_data(50, dtype, seed=1)
    p = VersionedProducer(t)
    ref = (t.float() * 2.0).to(dtype)
    _C.scale_(p, 2.0)
    assert p.asked == [(1, 0)]
    assert_bitwise(t, ref)
    all_kernels_agree(VersionedProducer, dtype)


@dtype_param
@pytest.mark.parametrize("cls", [LegacyProducer, LegacyWithStream], ids=["noargs", "stream"])
def test_legacy_path(dtype, cls):
    t = finite_data(50, dtype, seed=2)
    p = cls(t)
    ref = (t.float() * 2.0).to(dtype)
    _C.scale_(p, 2.0)
    assert p.calls == 1  # the versioned request failed in the call binding, then one legacy call
    assert_bitwise(t, ref)
    all_kernels_agree(cls, dtype)


@dtype_param
def test_legacy_and_versioned_give_same_results(dtype):
    base = finite_data(70001, dtype, seed=3)
    a, b = base.clone(), base.clone()
    sa = _C.scale_stats_(a, 0.3)
    sb = _C.scale_stats_(LegacyProducer(b), 0.3)
    assert sa == sb
    assert torch.equal(int_view(a), int_view(b))
    assert _C.stats(a) == _C.stats(LegacyProducer(b)) == _C.stats(a.__dlpack__()) == _C.stats(
        b.__dlpack__(max_version=(1, 0)))


@dtype_param
def test_raw_legacy_capsule_is_consumed_once(dtype):
    t = finite_data(40, dtype, seed=4)
    ref = (t.float() * 4.0).to(dtype)
    cap = t.__dlpack__()
    assert capsule_name(cap) == "dltensor"
    _C.scale_(cap, 4.0)
    assert_bitwise(t, ref)
    assert capsule_name(cap) == "used_dltensor"
    for call in (lambda: _C.scale_(cap, 4.0), lambda: _C.stats(cap), lambda: _C.Buffer(cap)):
        with pytest.raises(ValueError, match="already consumed"):
            call()
    assert_bitwise(t, ref)  # the failed calls did not write


@dtype_param
def test_raw_versioned_capsule(dtype):
    t = finite_data(40, dtype, seed=5)
    cap = t.__dlpack__(max_version=(1, 0))
    assert capsule_name(cap) == "dltensor_versioned"
    assert_stats(_C.stats(cap), t)
    assert capsule_name(cap) == "used_dltensor_versioned"
    with pytest.raises(ValueError, match="already consumed"):
        _C.stats(cap)
    ref = (t.float() * -2.0).to(dtype)
    cap = t.__dlpack__(max_version=(1, 0))
    _C.scale_(cap, -2.0)
    assert_bitwise(t, ref)
    dst = torch.zeros(40, dtype=torch.float32)
    _C.cast_(dst.__dlpack__(max_version=(1, 0)), t.__dlpack__())
    assert_bitwise(dst, t.float())


def test_rejected_capsule_stays_usable():
    base = torch.arange(10, dtype=torch.float32)
    bad = base[::2].__dlpack__()  # non-contiguous
    with pytest.raises(ValueError, match="contiguous"):
        _C.stats(bad)
    assert capsule_name(bad) == "dltensor"  # not consumed
    wrong = torch.zeros(4, dtype=torch.int64).__dlpack__(max_version=(1, 0))
    with pytest.raises(TypeError, match="int64"):
        _C.scale_(wrong, 1.0)
    assert capsule_name(wrong) == "dltensor_versioned"
    del bad, wrong
    gc.collect()  # their own destructors free them (would crash / leak if we had taken them)
    ok = base.__dlpack__()
    assert _C.stats(ok) == (float(sum(i * i for i in range(10))), 9.0, False)


def test_foreign_capsule_rejected():
    cap = _CapsuleNew(ctypes.addressof(_FOREIGN_TARGET), ctypes.addressof(_FOREIGN_NAME), None)
    with pytest.raises(TypeError, match="not_a_dltensor"):
        _C.stats(cap)
    with pytest.raises(TypeError, match="not a DLPack tensor"):
        _C.scale_(cap, 1.0)


def test_producer_returning_non_capsule():
    class Bad:
        def __dlpack__(self, **kw):
            return 42

    with pytest.raises(TypeError, match="not a capsule"):
        _C.stats(Bad())


def test_producer_raising_buffer_error():
    class Refuses:
        def __dlpack__(self, **kw):
            raise BufferError("nope, not exporting")

    with pytest.raises(TypeError, match="nope, not exporting"):
        _C.stats(Refuses())


# ---------------------------------------------------------------------------------------------
# shapes, strides, offsets


@dtype_param
def test_size_one_dims_with_odd_strides(dtype):
    for make in (
        lambda: finite_data(5, dtype, 6).reshape(5, 1)[:, :],
        lambda: finite_data(5, dtype, 6).reshape(1, 5),
        lambda: finite_data(15, dtype, 6).reshape(3, 5)[1:2],  # (1, 5), stride (5, 1), offset 5
        lambda: torch.as_strided(finite_data(40, dtype, 6), (5, 1), (1, 7)),
        lambda: torch.as_strided(finite_data(40, dtype, 6), (1, 5, 1), (123, 1, 9)),
    ):
        t = make()
        assert t.is_contiguous()
        assert_stats(_C.stats(t), t)
        ref = (t.float() * 1.5).to(dtype)
        _C.scale_(t, 1.5)
        assert_bitwise(t, ref)


@dtype_param
def test_view_with_storage_offset(dtype):
    big = finite_data(100, dtype, seed=7)
    before = big.clone()
    view = big[10:20]
    assert view.storage_offset() == 10
    assert_stats(_C.stats(view), before[10:20])
    _C.scale_(view, 2.0)
    expect = before.clone()
    expect[10:20] = (before[10:20].float() * 2.0).to(dtype)
    assert_bitwise(big, expect)  # only 10..19 changed
    # scale_stats_ on a 2-D row block
    big2 = finite_data(60, dtype, seed=8).reshape(6, 10)
    b2 = big2.clone()
    got = _C.scale_stats_(big2[2:4], 0.25)
    exp2 = b2.clone()
    exp2[2:4] = (b2[2:4].float() * 0.25).to(dtype)
    assert_bitwise(big2, exp2)
    assert_stats(got, exp2[2:4])
    # cast_ into the middle of a bigger destination, from the middle of a bigger source
    for other in DTYPES:
        dst = torch.full((30,), 9.0, dtype=other)
        _C.cast_(dst[5:15], before[40:50])
        exp = torch.full((30,), 9.0, dtype=other)
        exp[5:15] = before[40:50].to(other)
        assert_bitwise(dst, exp)


# ---------------------------------------------------------------------------------------------
# producers that forbid in-place writes (numpy: read-only arrays, explicit copies)


def test_numpy_arrays():
    a = np.linspace(-3, 3, 101, dtype=np.float32)
    ta = torch.from_numpy(a.copy())
    assert_stats(_C.stats(a), ta)
    _C.scale_(a, 0.5)
    assert_bitwise(torch.from_numpy(a), (ta * 0.5))
    h = np.linspace(-3, 3, 33, dtype=np.float16)
    assert_stats(_C.stats(h), torch.from_numpy(h.copy()))
    with pytest.raises(TypeError, match="float64"):
        _C.stats(np.zeros(3))
    r = np.arange(8, dtype=np.float32)
    for bad in (r[::-1], r[::2], r.reshape(2, 4).T):
        with pytest.raises(ValueError, match="contiguous"):
            _C.scale_(bad, 2.0)
    assert np.array_equal(r, np.arange(8, dtype=np.float32))


def test_read_only_memory_is_not_written():
    a = np.arange(9, dtype=np.float32)
    a.flags.writeable = False
    assert _C.stats(a) == (float(sum(i * i for i in range(9))), 8.0, False)
    for call in (lambda: _C.scale_(a, 2.0), lambda: _C.scale_stats_(a, 2.0),
                 lambda: _C.cast_(a, np.zeros(9, dtype=np.float16)), lambda: _C.Buffer(a)):
        with pytest.raises(ValueError, match="read-only"):
            call()
    assert np.array_equal(a, np.arange(9, dtype=np.float32))
    # as a cast source, read-only is fine
    dst = torch.zeros(9, dtype=torch.bfloat16)
    _C.cast_(dst, a)
    assert_bitwise(dst, torch.arange(9, dtype=torch.float32).bfloat16())
    # a rejected read-only capsule is not consumed
    cap = a.__dlpack__(max_version=(1, 0))
    with pytest.raises(ValueError, match="read-only"):
        _C.scale_(cap, 2.0)
    assert capsule_name(cap) == "dltensor_versioned"
    assert _C.stats(cap)[1] == 8.0


def test_copied_export_rejected_for_writes():
    a = np.ones(5, dtype=np.float32)
    cap = a.__dlpack__(max_version=(1, 0), copy=True)
    with pytest.raises(ValueError, match="copy"):
        _C.scale_(cap, 3.0)
    assert capsule_name(cap) == "dltensor_versioned"
    assert _C.stats(cap) == (5.0, 1.0, False)  # reading a copy is fine
    assert np.array_equal(a, np.ones(5, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# Buffer


@dtype_param
def test_buffer_attributes(dtype):
    t = finite_data(24, dtype, seed=9).reshape(2, 3, 4)
    b = _C.Buffer(t)
    assert b.numel == 24
    assert b.nbytes == 24 * t.element_size()
    assert b.dtype == DTYPE_NAMES[dtype]
    assert b.device == (1, 0)  # kDLCPU, device 0
    assert b.data_ptr == t.data_ptr()
    v = t.reshape(-1)[5:17]
    bv = _C.Buffer(v)
    assert bv.data_ptr == v.data_ptr() == t.data_ptr() + 5 * t.element_size()
    assert bv.numel == 12
    assert _C.Buffer(tensor=t).numel == 24
    with pytest.raises(AttributeError):
        b.numel = 3
    e = _C.Buffer(torch.empty(0, dtype=dtype))
    assert e.numel == 0 and e.nbytes == 0 and _C.stats(e) == (0.0, 0.0, False)


@dtype_param
def test_buffer_kernels_write_into_tensor(dtype):
    base = finite_data(70000, dtype, seed=10)
    t = base.clone()
    b = _C.Buffer(t)
    assert_stats(_C.stats(b), base)
    assert _C.nonfinite(b) is False
    _C.scale_(b, 3.7)
    ref = (base.float() * 3.7).to(dtype)
    assert_bitwise(t, ref)
    got = _C.scale_stats_(b, 0.5)
    ref2 = (ref.float() * 0.5).to(dtype)
    assert_bitwise(t, ref2)
    assert_stats(got, ref2)
    t[123] = math.inf  # writes through the tensor are seen by the Buffer
    assert _C.nonfinite(b) is True
    for other in DTYPES:
        dst = torch.zeros(70000, dtype=other)
        bd = _C.Buffer(dst)
        _C.cast_(bd, b)
        assert_bitwise(dst, t.to(other))
        dst2 = torch.zeros(70000, dtype=other)
        _C.cast_(dst2, b)  # mixed Buffer / tensor
        assert_bitwise(dst2, t.to(other))
        _C.cast_(bd, t)
        assert_bitwise(dst, t.to(other))
    with pytest.raises(ValueError, match="elements"):
        _C.cast_(_C.Buffer(torch.zeros(3)), b)


@dtype_param
def test_buffer_keeps_memory_alive(dtype):
    t = finite_data(4096, dtype, seed=11)
    expect = t.clone()
    w = weakref.ref(t)
    b = _C.Buffer(t)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert w() is not None  # the Buffer's DLPack owner still holds the tensor
    # churn the allocator: a freed block would likely be reused and overwritten here
    junk = [torch.full((4096,), 7.0, dtype=dtype) for _ in range(8)]
    assert b.data_ptr == ptr
    assert_stats(_C.stats(b), expect)
    _C.scale_(b, 2.0)
    assert_stats(_C.stats(b), (expect.float() * 2.0).to(dtype))
    dst = torch.empty(4096, dtype=dtype)
    _C.cast_(dst, b)
    assert_bitwise(dst, (expect.float() * 2.0).to(dtype))
    del b, junk
    gc.collect()
    assert w() is None  # released when the Buffer goes


def test_buffer_rejects_bad_input():
    t = torch.ones(4)
    b = _C.Buffer(t)
    with pytest.raises(TypeError, match="already a Buffer"):
        _C.Buffer(b)
    with pytest.raises(TypeError, match="expected a tensor"):
        _C.Buffer([1.0, 2.0])
    with pytest.raises(TypeError, match="int64"):
        _C.Buffer(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="float64"):
        _C.Buffer(torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        _C.Buffer(torch.zeros(8)[::2])
    with pytest.raises(TypeError, match="detach"):
        _C.Buffer(torch.zeros(3, requires_grad=True))
    with pytest.raises(TypeError):
        _C.Buffer()
    with pytest.raises(TypeError):
        _C.Buffer(t, t)
    with pytest.raises(TypeError, match="CUDA"):
        _C.cuda_stats_(b, torch.zeros(3), 0)  # a CPU Buffer is refused by the CUDA kernels
    assert _C.stats(b) == (4.0, 1.0, False)


def test_buffer_from_capsules():
    t = torch.arange(6, dtype=torch.float32)
    cap = t.__dlpack__()
    b = _C.Buffer(cap)
    assert capsule_name(cap) == "used_dltensor"
    assert b.data_ptr == t.data_ptr()
    _C.scale_(b, 2.0)
    assert torch.equal(t, torch.arange(6, dtype=torch.float32) * 2)
    vcap = t.__dlpack__(max_version=(1, 0))
    bv = _C.Buffer(vcap)
    assert capsule_name(vcap) == "used_dltensor_versioned"
    assert _C.stats(bv) == (4.0 * 55, 10.0, False)
    bl = _C.Buffer(LegacyProducer(t))
    assert bl.data_ptr == t.data_ptr()


# ---------------------------------------------------------------------------------------------
# hand-made capsules (ctypes): what torch never exports (byte_offset != 0, NULL strides, other
# device types, newer major versions, flags) and the deleter contract


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
        ("deleter", _DELETER), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor),
    ]


_DT_CODES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16)}


class HandMade:
    """A DLPack capsule over `storage` (a torch tensor kept alive here) built field by field.
    `.deleted` counts deleter calls; the capsule has no destructor, so only a consumer that
    took ownership ever calls the deleter."""

    def __init__(self, storage, shape, byte_offset=0, strides=None, versioned=False, major=1, flags=0,
                 device_type=1, code_bits=None, lanes=1, device_id=0):
        self.storage = storage
        self.deleted = 0
        self._shape = (ctypes.c_int64 * max(1, len(shape)))(*shape)
        self._strides = (ctypes.c_int64 * len(strides))(*strides) if strides is not None else None
        code, bits = code_bits or _DT_CODES[storage.dtype]

        def deleter(_ptr):
            self.deleted += 1

        self._deleter = _DELETER(deleter)
        m = _DLManagedTensorVersioned() if versioned else _DLManagedTensor()
        dl = m.dl_tensor
        dl.data = storage.data_ptr()
        dl.device = _DLDevice(device_type, device_id)
        dl.ndim = len(shape)
        dl.dtype = _DLDataType(code, bits, lanes)
        dl.shape = ctypes.cast(self._shape, ctypes.POINTER(ctypes.c_int64))
        if self._strides is not None:
            dl.strides = ctypes.cast(self._strides, ctypes.POINTER(ctypes.c_int64))
        dl.byte_offset = byte_offset
        m.deleter = self._deleter
        if versioned:
            m.major, m.minor, m.flags = major, 0, flags
        self._m = m
        self._name = ctypes.create_string_buffer(b"dltensor_versioned" if versioned else b"dltensor")
        self.capsule = _CapsuleNew(ctypes.addressof(m), ctypes.addressof(self._name), None)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@dtype_param
def test_hand_made_capsule_byte_offset(dtype, versioned):
    big = finite_data(40, dtype, seed=12)
    before = big.clone()
    es = big.element_size()
    # elements 10..19 as a 2x5 block, strides NULL (compact row-major)
    hm = HandMade(big, (2, 5), byte_offset=10 * es, versioned=versioned)
    _C.scale_(hm.capsule, 2.0)
    assert hm.deleted == 1  # ownership taken and released exactly once
    assert capsule_name(hm.capsule) == ("used_dltensor_versioned" if versioned else "used_dltensor")
    expect = before.clone()
    expect[10:20] = (before[10:20].float() * 2.0).to(dtype)
    assert_bitwise(big, expect)
    # explicit compact strides, stats read the right window
    hm2 = HandMade(big, (5, 2), byte_offset=20 * es, strides=(2, 1), versioned=versioned)
    assert_stats(_C.stats(hm2.capsule), big[20:30])
    assert hm2.deleted == 1
    # a Buffer holds the owner until it goes
    hm3 = HandMade(big, (4,), byte_offset=36 * es, versioned=versioned)
    b = _C.Buffer(hm3.capsule)
    assert b.data_ptr == big.data_ptr() + 36 * es and b.numel == 4
    assert hm3.deleted == 0
    del b
    gc.collect()
    assert hm3.deleted == 1


def test_hand_made_capsule_zero_dim_and_pinned_host():
    t = torch.tensor([5.0, -7.0])
    hm = HandMade(t, (), byte_offset=4)  # a 0-d tensor: one element, shape unused
    assert _C.stats(hm.capsule) == (49.0, 7.0, False)
    hm = HandMade(t, (2,), device_type=3)  # kDLCUDAHost: CPU-addressable pinned memory
    assert _C.stats(hm.capsule) == (74.0, 7.0, False)


def test_hand_made_capsules_rejected_and_not_consumed():
    t = torch.zeros(16)
    cases = [
        (dict(shape=(4,), versioned=True, major=2), BufferError, "major version"),
        (dict(shape=(4,), device_type=2), TypeError, "CUDA"),
        (dict(shape=(4,), device_type=4), TypeError, "device type 4"),
        (dict(shape=(4,), lanes=4), TypeError, "vector"),
        (dict(shape=(4,), code_bits=(2, 64)), TypeError, "float64"),
        (dict(shape=(4,), code_bits=(0, 32)), TypeError, "int32"),
        (dict(shape=(4, -1)), ValueError, "negative"),
        (dict(shape=(1 << 62, 8)), ValueError, "overflow"),
        (dict(shape=(2, 4), strides=(1, 2)), ValueError, "contiguous"),
        (dict(shape=(4,), versioned=True, flags=1), ValueError, "read-only"),
        (dict(shape=(4,), versioned=True, flags=2), ValueError, "copy"),
    ]
    for kw, exc, msg in cases:
        hm = HandMade(t, **kw)
        name = capsule_name(hm.capsule)
        with pytest.raises(exc, match=msg):
            _C.scale_(hm.capsule, 2.0)
        assert hm.deleted == 0, kw  # a rejected capsule stays with its producer
        assert capsule_name(hm.capsule) == name, kw
    assert torch.equal(t, torch.zeros(16))
    # read-only / copied memory is still fine to read, and is then consumed
    for flags in (1, 2):
        hm = HandMade(t, (4,), versioned=True, flags=flags)
        assert _C.stats(hm.capsule) == (0.0, 0.0, False)
        assert hm.deleted == 1


def test_hand_made_capsule_released_when_other_argument_fails():
    """Regression: the deleter used to run with the ValueError pending (SystemError)."""
    dst_storage = torch.zeros(10, dtype=torch.float16)
    hm = HandMade(dst_storage, (10,))
    with pytest.raises(ValueError, match="elements"):
        _C.cast_(hm.capsule, torch.ones(9))
    assert hm.deleted == 1  # dst was taken, then released on the error path
    hm = HandMade(dst_storage, (10,))
    with pytest.raises(TypeError, match="int64"):
        _C.cast_(hm.capsule, torch.ones(10, dtype=torch.int64))
    assert hm.deleted == 1
    assert torch.equal(dst_storage, torch.zeros(10, dtype=torch.float16))


def test_cuda_kernels_refuse_arguments_on_another_device():
    """Capsules claiming CUDA devices 0 and 1 (their memory is host memory that no CUDA call may
    touch): every CUDA binding compares each tensor argument's device with the tensor's and
    names the one that differs, before any launch."""
    t = torch.zeros(8)
    f32 = torch.zeros(3)

    def cuda(storage, dev, shape=None):
        return HandMade(storage, shape or tuple(storage.shape), device_type=2, device_id=dev).capsule

    cases = [
        ("cuda_stats_", "out", lambda: _C.cuda_stats_(cuda(t, 0), cuda(f32, 1), 0)),
        ("cuda_scale_", "dev_factor", lambda: _C.cuda_scale_(cuda(t, 1), 2.0, cuda(f32, 0, (1,)), 0)),
        ("cuda_unscale_check_", "inv_scale",
         lambda: _C.cuda_unscale_check_(cuda(t, 0), cuda(f32, 1, (1,)), cuda(f32, 0, (1,)), None, 0)),
        ("cuda_unscale_check_", "found_inf",
         lambda: _C.cuda_unscale_check_(cuda(t, 0), cuda(f32, 0, (1,)), cuda(f32, 1, (1,)), None, 0)),
        ("cuda_unscale_check_", "sumsq",
         lambda: _C.cuda_unscale_check_(cuda(t, 0), cuda(f32, 0, (1,)), cuda(f32, 0, (1,)), cuda(f32, 1, (1,)), 0)),
        ("cuda_cast_", "src", lambda: _C.cuda_cast_(cuda(torch.zeros(8, dtype=torch.float16), 0), cuda(t, 1), 0)),
    ]
    for fn, arg, call in cases:
        with pytest.raises(ValueError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith(f"{fn}: {arg} is on cuda:"), msg
        assert "every tensor argument must be on" in msg, msg
    assert torch.equal(t, torch.zeros(8)) and torch.equal(f32, torch.zeros(3))
