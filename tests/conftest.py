"""Shared fixtures and helpers for the tests of the extension module accelerate_c._C.

Every helper compares against plain PyTorch computed on the same data; nothing here decides
what a kernel "should" return by itself.
"""
import math

import pytest
import torch

from accelerate_c import _C

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

CHUNK = 1 << 16  # elements per pool task in csrc/core/kernels.c (AC_CHUNK)
# Sizes chosen to hit: empty, pure tail, one vector, vector + tail, chunk edges, multi-chunk.
SIZES = [0, 1, 7, 8, 9, 1000, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5, (1 << 20) + 3]

# Relative tolerance for sums of squares: the core accumulates in double in chunk order,
# torch sums doubles pairwise; for <= 2**20 terms both are within ~1e-10 of the exact value.
SUMSQ_RTOL = 1e-9


STARTUP_ISA = _C.kernel_isa()  # before any test changes it


def _available_isas():
    orig = _C.kernel_isa()
    out = ["scalar"]
    try:
        _C.set_kernel_isa("avx2")
        out.append("avx2")
    except _C.CoreError:
        pass
    finally:
        _C.set_kernel_isa(orig)
    return out


AVAILABLE_ISAS = _available_isas()


@pytest.fixture
def restore_core_state():
    """Whatever a test does to the global ISA / thread count is undone afterwards."""
    isa, threads = _C.kernel_isa(), _C.get_num_threads()
    yield
    _C.set_kernel_isa(isa)
    _C.set_num_threads(threads)


@pytest.fixture(scope="module")
def torch_single_thread():
    """torch computes the references with one intra-op thread: on a small, busy machine its
    OpenMP team otherwise spends most of the time waiting for CPUs (results are unaffected)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(params=["scalar", "avx2"])
def isa(request):
    """Runs the test with the named kernel instruction set, restoring the original after."""
    if request.param not in AVAILABLE_ISAS:
        pytest.skip(f"{request.param} kernels are not available on this CPU/build")
    orig = _C.kernel_isa()
    _C.set_kernel_isa(request.param)
    assert _C.kernel_isa() == request.param
    yield request.param
    _C.set_kernel_isa(orig)


@pytest.fixture(params=[1, 2], ids=["t1", "t2"])
def threads(request):
    """Runs the test with 1 or 2 pool threads, restoring the original count after."""
    orig = _C.get_num_threads()
    _C.set_num_threads(request.param)
    assert _C.get_num_threads() == request.param
    yield request.param
    _C.set_num_threads(orig)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def finite_data(n, dtype, seed):
    """Finite random values over a wide dynamic range, representable in `dtype` without
    overflow (|x| < ~1300), including values that become subnormal when scaled down."""
    g = gen(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 9, (n,), generator=g).float())
    return x.to(dtype)


def wide_data(n, dtype, seed):
    """Random values from ~1e-12 to ~1e9: some overflow fp16, some are fp16 subnormals."""
    g = gen(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 30, (n,), generator=g).float())
    return x.to(dtype)


def int_view(t):
    """Bit pattern view of a float tensor (int32 for fp32, int16 for 16-bit dtypes)."""
    return t.view(torch.int32) if t.element_size() == 4 else t.view(torch.int16)


def assert_bitwise(got, ref):
    """Same dtype, same shape, same NaN positions, and identical bits everywhere else (NaN
    payloads may legitimately differ between torch's vector and scalar conversions)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    gn, rn = torch.isnan(got), torch.isnan(ref)
    assert torch.equal(gn, rn), f"NaN positions differ at {torch.nonzero(gn != rn)[:5].flatten().tolist()}"
    gi, ri = int_view(got)[~gn], int_view(ref)[~rn]
    if not torch.equal(gi, ri):
        bad = torch.nonzero(gi != ri).flatten()[:5]
        pytest.fail(
            f"{int(torch.count_nonzero(gi != ri))} elements differ; first bits got="
            f"{[hex(v & 0xFFFFFFFF) for v in gi[bad].tolist()]} ref="
            f"{[hex(v & 0xFFFFFFFF) for v in ri[bad].tolist()]}"
        )


def ref_stats(t):
    """(sumsq, maxabs, nonfinite) computed by torch: sumsq in double, maxabs in fp32 with NaN
    ignored (0 when there is nothing but NaN, as for an empty buffer), nonfinite any NaN/Inf."""
    if t.numel() == 0:
        return 0.0, 0.0, False
    d = t.double().reshape(-1)
    sumsq = d.pow(2).sum().item()
    a = t.float().abs().reshape(-1)
    a = a[~torch.isnan(a)]
    maxabs = a.max().item() if a.numel() else 0.0
    return sumsq, maxabs, bool(not torch.isfinite(t).all())


def assert_sumsq(got, ref, rtol=SUMSQ_RTOL):
    if math.isnan(ref):
        assert math.isnan(got), f"sumsq {got} != NaN"
    elif math.isinf(ref):
        assert got == ref, f"sumsq {got} != {ref}"
    else:
        assert abs(got - ref) <= rtol * abs(ref), f"sumsq {got!r} vs torch {ref!r} (rel {rtol})"


def assert_stats(got, t):
    """`got` from a kernel vs torch's statistics of tensor `t`."""
    assert isinstance(got, tuple) and len(got) == 3
    sumsq, maxabs, nonfinite = got
    assert isinstance(sumsq, float) and isinstance(maxabs, float) and isinstance(nonfinite, bool)
    rs, rm, rn = ref_stats(t)
    assert_sumsq(sumsq, rs)
    assert maxabs == rm, f"maxabs {maxabs!r} vs torch {rm!r}"
    assert nonfinite == rn, f"nonfinite {nonfinite} vs torch {rn}"


# ---- marks and values shared by the kernel test modules (test_kernels_*.py) ----------------

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
size_param = pytest.mark.parametrize("n", SIZES)

# 1e4 overflows fp16 for |x| > 6.55; 0.0 and -1.5 check sign handling; 1/65536 makes fp16
# subnormals; 3.7 and 1e-3 are inexact so every element needs rounding.
FACTORS = [0.5, 1.0 / 65536, 3.7, 1e-3, -1.5, 1e4, 0.0]


def scale_ref(t, factor):
    """torch's in-place multiply for 16-bit types: fp32 math, round to nearest even."""
    return (t.float() * factor).to(t.dtype)


def special_values_f32():
    """fp32 values at the edges that conversions and scaling must get exactly right."""
    vals = [
        0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1.0, -1.0,
        # fp32 subnormals / extremes
        2.0**-149, -(2.0**-149), 1e-40, -1e-39, 2.0**-126, 3.4028234663852886e38, -3.4028234663852886e38,
        # fp16 overflow boundary: 65504 is max, [65504, 65520) rounds down, >= 65520 is inf
        65504.0, 65505.0, 65519.0, 65520.0 - 2.0**-8, 65520.0, -65520.0, 65536.0, 1e5, -65504.0,
        # fp16 subnormals and their rounding ties
        2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-25 + 2.0**-40, 2.0**-26, -(2.0**-25),
        2.0**-14, 2.0**-14 - 2.0**-24, 2.0**-14 - 2.0**-25, 5.96e-8, 1e-8,
        # fp16 normal ties (ulp 2**-10 at 1, 2 at 2048)
        1 + 2.0**-11, 1 + 3 * 2.0**-11, 2049.0, 2051.0, -2051.0,
        # bf16 ties (ulp 2**-7 at 1, 2 at 256) and the bf16 overflow edge
        1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-20, 257.0, 259.0, -259.0,
        3.3895313892515355e38, 3.3961e38, 1e-39, 9.2e-41,
    ]
    t = torch.tensor(vals, dtype=torch.float32)
    # signalling NaNs (quiet bit clear) of both signs
    snan = torch.tensor([0x7F800001, -0x007FFFFF, 0x7FA00000], dtype=torch.int32).view(torch.float32)
    return torch.cat([t, snan])


def tiled_specials(dtype, r):
    """The special values (converted by torch) laid out as a 160-element vector body followed
    by a 7-element scalar tail. Round r rotates the body by r (so over rounds 0..7 each value
    sits in every vector lane) and puts values 7r..7r+6 in the tail (so over all rounds every
    value also goes through the scalar tail)."""
    s = special_values_f32().to(dtype)
    body = torch.roll(s.repeat(160 // s.numel() + 1)[:160], r)
    tail = s[(torch.arange(7) + 7 * r) % s.numel()]
    return torch.cat([body, tail])


SPECIAL_ROUNDS = range(max(8, -(-special_values_f32().numel() // 7)))
