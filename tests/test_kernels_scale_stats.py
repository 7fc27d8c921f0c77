"""scale_, stats, sumsq, nonfinite and scale_stats_ of accelerate_c._C checked bit for bit (or,
for double sums of squares, to a relative 1e-9) against plain PyTorch on the same data, on both
instruction-set paths and with 1 and 2 pool threads: random data, the special values, every
16-bit pattern, unaligned views, NaN / Inf placement, empty buffers and 0-d tensors."""
import math

import pytest
import torch

from accelerate_c import _C

from conftest import (
    AVAILABLE_ISAS,
    CHUNK,
    DTYPES,
    FACTORS,
    SPECIAL_ROUNDS,
    STARTUP_ISA,
    assert_bitwise,
    assert_stats,
    dtype_param,
    finite_data,
    ref_stats,
    scale_ref,
    size_param,
    tiled_specials,
    wide_data,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")


# ---------------------------------------------------------------------------------------------
# scale_ / stats / nonfinite / scale_stats_ vs torch on random data


@size_param
@dtype_param
def test_scale_matches_torch(isa, threads, dtype, n):
    base = finite_data(n, dtype, seed=n)
    for f in FACTORS:
        t = base.clone()
        ref = scale_ref(t, f)
        assert _C.scale_(t, f) is None
        assert_bitwise(t, ref)


@size_param
@dtype_param
def test_stats_matches_torch(isa, threads, dtype, n):
    for data in (finite_data(n, dtype, seed=100 + n), wide_data(n, dtype, seed=200 + n)):
        before = data.clone()
        assert_stats(_C.stats(data), data)
        assert _C.nonfinite(data) is bool(not torch.isfinite(data).all())
        assert_bitwise(data, before)  # read-only kernels do not write


@size_param
@dtype_param
def test_sumsq_matches_torch(isa, threads, dtype, n):
    """The fast norm pass: fp32 block sums, so 1e-6 relative to torch's double sum (torch's own
    fp32 norm is looser); the non-finite flag exact; identical on both ISAs (checked below)."""
    for data in (finite_data(n, dtype, seed=300 + n), wide_data(n, dtype, seed=400 + n)):
        sq, nf = _C.sumsq(data)
        ref = data.double().pow(2).sum().item()
        assert nf is bool(not torch.isfinite(data).all())
        if not nf:
            assert math.isfinite(sq)
            assert abs(sq - ref) <= 1e-6 * ref
    if n:
        data = finite_data(n, dtype, seed=5)
        for where in {0, n // 2, n - 1}:
            for bad in (float("nan"), float("inf"), float("-inf")):
                t = data.clone()
                t[where] = bad
                assert _C.sumsq(t)[1] is True


@pytest.mark.skipif(len(AVAILABLE_ISAS) < 2, reason="needs both instruction sets")
@dtype_param
def test_sumsq_identical_on_both_isas(dtype):
    data = finite_data(300001, dtype, seed=9)
    got = []
    for name in ("scalar", "avx2"):
        _C.set_kernel_isa(name)
        got.append(_C.sumsq(data))
    _C.set_kernel_isa(STARTUP_ISA)
    assert got[0] == got[1]


@size_param
@dtype_param
def test_scale_stats_matches_torch(isa, threads, dtype, n):
    base = finite_data(n, dtype, seed=300 + n)
    for f in FACTORS:
        t = base.clone()
        ref = scale_ref(t, f)
        got = _C.scale_stats_(t, f)
        assert_bitwise(t, ref)
        # statistics of the scaled, rounded values
        assert_stats(got, ref)
        # and the same numbers as a separate stats pass over the result
        assert got == _C.stats(t)


@pytest.mark.parametrize("dtype,big", [(torch.float16, 60000.0), (torch.bfloat16, 3e38), (torch.float32, 3e38)],
                         ids=["f16", "bf16", "f32"])
@pytest.mark.parametrize("n", [1, 9, 17, 1000, CHUNK + 1])
def test_scale_stats_flags_overflow_from_scaling(isa, threads, dtype, big, n):
    base = finite_data(n, dtype, seed=400 + n) * 0  # zeros, plus one big value
    for pos in sorted({0, n // 2, n - 1}):
        t = base.clone()
        t[pos] = big
        assert _C.stats(t)[2] is False  # finite before scaling
        ref = scale_ref(t, 2.0)
        assert torch.isinf(ref[pos])  # torch also overflows
        got = _C.scale_stats_(t, 2.0)
        assert_bitwise(t, ref)
        assert_stats(got, ref)
        assert got[2] is True and got[1] == math.inf and got[0] == math.inf


@dtype_param
def test_scale_special_values(isa, dtype):
    for r in SPECIAL_ROUNDS:
        base = tiled_specials(dtype, r)
        # factors beyond fp32 range are rounded to fp32 first (to inf / 0), as torch does
        for f in FACTORS + [2.0, 65536.0, -0.0, 1e300, -1e-50, math.inf, math.nan]:
            t = base.clone()
            ref = scale_ref(t, f)
            _C.scale_(t, f)
            assert_bitwise(t, ref)
            t2 = base.clone()
            got = _C.scale_stats_(t2, f)
            assert_bitwise(t2, ref)
            assert_stats(got, ref)


@dtype_param
def test_stats_special_values(isa, dtype):
    for r in SPECIAL_ROUNDS:
        t = tiled_specials(dtype, r)
        assert_stats(_C.stats(t), t)
        assert _C.nonfinite(t) is True
        # without the NaNs and infinities
        fin = t[torch.isfinite(t)].contiguous()
        assert_stats(_C.stats(fin), fin)
        assert _C.nonfinite(fin) is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_all_16bit_patterns_scale_and_stats(isa, threads, dtype):
    """Every fp16 / bf16 value (subnormals, infinities, NaNs included) through scale_,
    scale_stats_ and stats, against torch."""
    allp = torch.arange(-32768, 32768, dtype=torch.int16).view(dtype)
    assert_stats(_C.stats(allp), allp)
    fin = allp[torch.isfinite(allp)].contiguous()
    assert_stats(_C.stats(fin), fin)
    for f in (0.5, 3.7, 1.0 / 65536, 2.0, -1.0, 1e-3):
        t = allp.clone()
        ref = scale_ref(t, f)
        _C.scale_(t, f)
        assert_bitwise(t, ref)
        t = fin.clone()
        got = _C.scale_stats_(t, f)
        assert_bitwise(t, scale_ref(fin, f))
        assert_stats(got, t)


@dtype_param
def test_unaligned_views(isa, dtype):
    """Views starting at every element offset within 32 bytes (unaligned vector loads and
    stores), with lengths that leave every tail size; elements outside the view untouched."""
    big = finite_data(400, dtype, seed=13)
    for off in range(17):
        n = 64 + 8 + off % 8  # 64 + 8..15 elements: vector body plus each tail length
        view_ref = big[off:off + n]
        assert_stats(_C.stats(big[off:off + n]), view_ref)
        t = big.clone()
        _C.scale_(t[off:off + n], 3.7)
        expect = big.clone()
        expect[off:off + n] = scale_ref(big[off:off + n], 3.7)
        assert_bitwise(t, expect)
        t = big.clone()
        got = _C.scale_stats_(t[off:off + n], 0.3)
        expect = big.clone()
        expect[off:off + n] = scale_ref(big[off:off + n], 0.3)
        assert_bitwise(t, expect)
        assert_stats(got, expect[off:off + n])
        for dst_dt in DTYPES:
            d = torch.full((200,), 5.0, dtype=dst_dt)
            doff = (off * 3) % 17
            _C.cast_(d[doff:doff + n], big[off:off + n])
            exp = torch.full((200,), 5.0, dtype=dst_dt)
            exp[doff:doff + n] = big[off:off + n].to(dst_dt)
            assert_bitwise(d, exp)


# ---------------------------------------------------------------------------------------------
# NaN / Inf placement


@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 1000, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
@dtype_param
def test_nonfinite_placement(isa, dtype, n):
    _C.set_num_threads(2)
    base = finite_data(n, dtype, seed=500 + n)
    assert _C.nonfinite(base) is False
    positions = {0, n // 2, n - 1}
    positions |= {p for p in (7, 8, CHUNK - 1, CHUNK, 2 * CHUNK + 3) if p < n}
    for pos in sorted(positions):
        for val in (math.nan, math.inf, -math.inf):
            t = base.clone()
            t[pos] = val
            got = _C.stats(t)
            assert_stats(got, t)
            assert got[2] is True
            if math.isnan(val):
                # NaN ignored by maxabs; sumsq propagates it
                assert got[1] == ref_stats(torch.cat([t[:pos], t[pos + 1:]]))[1]
                assert math.isnan(got[0])
            else:
                assert got[1] == math.inf and got[0] == math.inf
            assert _C.nonfinite(t) is True
            t2 = t.clone()
            got2 = _C.scale_stats_(t2, 1.0)
            assert_bitwise(t2, t)
            assert_stats(got2, t)


@pytest.mark.parametrize("n", [1, 3, 8, 9, 17])
@dtype_param
def test_all_nan_maxabs_is_zero(isa, dtype, n):
    t = torch.full((n,), math.nan, dtype=dtype)
    sumsq, maxabs, nonfinite = _C.stats(t)
    assert math.isnan(sumsq) and maxabs == 0.0 and nonfinite is True
    t[n // 2] = -3.0  # one finite value among NaNs is the max
    assert _C.stats(t)[1] == 3.0
    assert_stats(_C.stats(t), t)


@dtype_param
def test_negative_zero_and_signs(isa, dtype):
    t = torch.tensor([-0.0, -5.0, 4.0, -0.0, 0.0, -2.5, 1.0, -6.0, 3.0], dtype=dtype)
    assert _C.stats(t) == (25 + 16 + 6.25 + 1 + 36 + 9, 6.0, False)
    assert_stats(_C.stats(t), t)


# ---------------------------------------------------------------------------------------------
# empty buffers and scalars


@pytest.mark.parametrize("shape", [(0,), (0, 5), (3, 0)])
@dtype_param
def test_empty_buffers(isa, dtype, shape):
    t = torch.empty(shape, dtype=dtype)
    assert _C.stats(t) == (0.0, 0.0, False)
    assert _C.nonfinite(t) is False
    assert _C.scale_(t, 2.0) is None
    assert _C.scale_stats_(t, 2.0) == (0.0, 0.0, False)
    for other in DTYPES:
        assert _C.cast_(torch.empty(shape, dtype=other), t) is None
    assert t.shape == shape


@dtype_param
def test_zero_dim_tensor(isa, dtype):
    t = torch.tensor(-3.0, dtype=dtype)
    assert _C.stats(t) == (9.0, 3.0, False)
    ref = scale_ref(t, 1.5)
    _C.scale_(t, 1.5)
    assert_bitwise(t, ref)
    d = torch.tensor(0.0, dtype=torch.float32)
    _C.cast_(d, t)
    assert_bitwise(d, t.float())
