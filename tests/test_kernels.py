"""CPU kernels of accelerate_c._C (scale_, stats, nonfinite, scale_stats_, cast_) checked bit for
bit (or, for double sums of squares, to a relative 1e-9) against plain PyTorch on the same data,
on both instruction-set paths and with 1 and 2 pool threads; plus argument validation, thread
count / ISA controls, determinism, concurrency, fork safety and GIL release."""
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
    AVAILABLE_ISAS,
    STARTUP_ISA,
    CHUNK,
    DTYPE_IDS,
    DTYPES,
    SIZES,
    assert_bitwise,
    assert_stats,
    finite_data,
    gen,
    int_view,
    ref_stats,
    wide_data,
)
from timeouts import wait_s

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")

# 1e4 overflows fp16 for |x| > 6.55; 0.0 and -1.5 check sign handling; 1/65536 makes fp16
# subnormals; 3.7 and 1e-3 are inexact so every element needs rounding.
FACTORS = [0.5, 1.0 / 65536, 3.7, 1e-3, -1.5, 1e4, 0.0]

dtype_param = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
size_param = pytest.mark.parametrize("n", SIZES)


def scale_ref(t, factor):
    """torch's in-place multiply for 16-bit types: fp32 math, round to nearest even."""
    return (t.float() * factor).to(t.dtype)


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


# ---------------------------------------------------------------------------------------------
# cast_


pair_params = pytest.mark.parametrize(
    "src_dt,dst_dt",
    [(s, d) for s in DTYPES for d in DTYPES],
    ids=[f"{a}-{b}" for a in DTYPE_IDS for b in DTYPE_IDS],
)


@size_param
@pair_params
def test_cast_random(isa, threads, src_dt, dst_dt, n):
    src = wide_data(n, src_dt, seed=600 + n)
    before = src.clone()
    dst = torch.full((n,), 123.0, dtype=dst_dt)
    assert _C.cast_(dst, src) is None
    assert_bitwise(dst, src.to(dst_dt))
    assert_bitwise(src, before)


@pair_params
def test_cast_special_values(isa, src_dt, dst_dt):
    for r in SPECIAL_ROUNDS:
        src = tiled_specials(src_dt, r)
        dst = torch.full_like(src, 7.0, dtype=dst_dt)
        _C.cast_(dst, src)
        assert_bitwise(dst, src.to(dst_dt))


@pair_params
def test_cast_different_shapes_same_numel(src_dt, dst_dt):
    src = finite_data(20, src_dt, seed=7)
    dst = torch.zeros(4, 5, dtype=dst_dt)
    _C.cast_(dst, src)
    assert_bitwise(dst, src.to(dst_dt).reshape(4, 5))


@pytest.mark.parametrize("src_dt", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_cast_all_16bit_patterns(isa, threads, src_dt):
    src = torch.arange(-32768, 32768, dtype=torch.int16).view(src_dt)
    assert src.numel() == 65536
    for dst_dt in DTYPES:
        dst = torch.empty(65536, dtype=dst_dt)
        _C.cast_(dst, src)
        assert_bitwise(dst, src.to(dst_dt))
    # round trip through fp32: torch's result, and the original bits for every non-NaN
    f = torch.empty(65536, dtype=torch.float32)
    _C.cast_(f, src)
    back = torch.empty(65536, dtype=src_dt)
    _C.cast_(back, f)
    assert_bitwise(back, f.to(src_dt))
    assert_bitwise(back, src)


@pytest.mark.parametrize("dst_dt", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_cast_random_f32_bit_patterns(isa, threads, dst_dt):
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 20,), dtype=torch.int32, generator=gen(11))
    src = bits.view(torch.float32)
    assert torch.isnan(src).any()  # the sample includes NaNs (and everything else)
    dst = torch.empty(1 << 20, dtype=dst_dt)
    _C.cast_(dst, src)
    assert_bitwise(dst, src.to(dst_dt))


def _around(mid_bits):
    """fp32 bit patterns at, just below and just above each given one, both signs."""
    b = torch.cat([mid_bits, mid_bits - 1, mid_bits + 1])
    return torch.cat([b, b | torch.tensor(-(2**31), dtype=torch.int32)]).view(torch.float32)


def test_cast_f32_to_f16_rounding_midpoints(isa, threads):
    # every finite non-negative fp16 value and its successor (65520 for the largest)
    h = torch.arange(0, 0x7C00, dtype=torch.int16).view(torch.float16).double()
    nxt = torch.cat([h[1:], torch.tensor([65520.0], dtype=torch.float64)])
    mid = ((h + nxt) / 2).float()  # exact: fp16 midpoints fit in fp32
    src = _around(mid.view(torch.int32))
    dst = torch.empty(src.numel(), dtype=torch.float16)
    _C.cast_(dst, src)
    assert_bitwise(dst, src.to(torch.float16))


def test_cast_f32_to_bf16_rounding_midpoints(isa, threads):
    # midpoint between bf16 k and k+1 is the fp32 pattern (k << 16) | 0x8000
    k = torch.arange(0, 0x7F80, dtype=torch.int32)
    src = _around((k << 16) | 0x8000)
    dst = torch.empty(src.numel(), dtype=torch.bfloat16)
    _C.cast_(dst, src)
    assert_bitwise(dst, src.to(torch.bfloat16))


@pytest.mark.skipif(len(AVAILABLE_ISAS) < 2, reason="needs both instruction sets")
def test_isas_agree_bit_for_bit_nan_payloads_included():
    """The scalar and AVX2 paths store the same bits, NaN payloads included (torch's own
    vector and scalar conversions do not, hence the NaN-mask comparisons elsewhere)."""
    all16 = torch.arange(-32768, 32768, dtype=torch.int16)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 18,), dtype=torch.int32, generator=gen(12))
    srcs = [all16.view(torch.float16), all16.view(torch.bfloat16), bits.view(torch.float32)]
    for src in srcs:
        outs = {}
        for which in ("scalar", "avx2"):
            _C.set_kernel_isa(which)
            res = []
            for dst_dt in DTYPES:
                d = torch.empty(src.numel(), dtype=dst_dt)
                _C.cast_(d, src)
                res.append(d)
            for f in (0.5, 3.7, -1e-3, math.inf):
                t = src.clone()
                _C.scale_(t, f)
                res.append(t)
            outs[which] = res
        for a, b in zip(outs["scalar"], outs["avx2"]):
            assert torch.equal(int_view(a), int_view(b)), (src.dtype, a.dtype)


def test_cast_same_dtype_is_a_copy(isa):
    for dt in DTYPES:
        src = tiled_specials(dt, 3)
        dst = torch.zeros_like(src)
        _C.cast_(dst, src)
        assert torch.equal(int_view(dst), int_view(src))  # bit copy, NaN payloads included
        _C.cast_(src, src)  # same buffer, same dtype: allowed, a no-op
        assert torch.equal(int_view(dst), int_view(src))


def test_cast_overlapping_buffers_rejected():
    x = torch.arange(16, dtype=torch.float32)
    before = x.clone()
    # the fp16 destination lies inside the fp32 source's bytes
    with pytest.raises(accelerate_c.CoreError) as ei:
        _C.cast_(x.view(torch.float16)[:8], x[:8])
    assert ei.value.code == "AC_ERR_INVALID_ARG"
    assert "overlap" in str(ei.value)
    assert torch.equal(x, before)
    # disjoint parts of the same storage are fine
    _C.cast_(x.view(torch.float16)[16:24], x[:8])  # bytes 32..47 vs 0..31
    assert torch.equal(x.view(torch.float16)[16:24], before[:8].half())


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
# controls: threads, ISA, CUDA presence


def test_num_threads_roundtrip():
    for k in (1, 2, 3, 7):
        _C.set_num_threads(k)
        assert _C.get_num_threads() == k
    _C.set_num_threads(1000)  # capped at 64 (pool.h)
    assert _C.get_num_threads() == 64


@pytest.mark.parametrize("bad", [0, -1, 2**21])
def test_set_num_threads_rejects_out_of_range(bad):
    _C.set_num_threads(3)
    with pytest.raises(ValueError, match="set_num_threads"):
        _C.set_num_threads(bad)
    assert _C.get_num_threads() == 3


def test_set_num_threads_type_and_arity():
    with pytest.raises(TypeError):
        _C.set_num_threads("2")
    with pytest.raises(TypeError):
        _C.set_num_threads()
    with pytest.raises(TypeError):
        _C.set_num_threads(1, 2)
    with pytest.raises(TypeError):
        _C.get_num_threads(1)


def test_kernel_isa_controls():
    assert _C.kernel_isa() in ("scalar", "avx2")
    _C.set_kernel_isa("scalar")
    assert _C.kernel_isa() == "scalar"
    with pytest.raises(accelerate_c.CoreError) as ei:
        _C.set_kernel_isa("bogus")
    assert isinstance(ei.value, RuntimeError)
    assert ei.value.code == "AC_ERR_INVALID_ARG"
    assert "bogus" in str(ei.value)
    assert _C.kernel_isa() == "scalar"  # unchanged by the failed call
    with pytest.raises(TypeError):
        _C.set_kernel_isa(1)
    with pytest.raises(TypeError):
        _C.kernel_isa("scalar")
    if "avx2" not in AVAILABLE_ISAS:
        with pytest.raises(accelerate_c.CoreError) as ei:
            _C.set_kernel_isa("avx2")
        assert ei.value.code == "AC_ERR_UNSUPPORTED"


def test_core_error_is_exported():
    assert accelerate_c.CoreError is _C.CoreError
    assert issubclass(accelerate_c.CoreError, RuntimeError)


def test_cuda_presence():
    assert isinstance(_C.has_cuda, bool)
    # a CPU-only build, or no usable GPU, reports 0 devices
    expected = torch.cuda.device_count() if (_C.has_cuda and torch.cuda.is_available()) else 0
    assert _C.cuda_device_count() == expected


def test_cuda_kernels_reject_cpu_tensors():
    t = torch.ones(8)
    out = torch.zeros(3)
    calls = [
        lambda: _C.cuda_stats_(t, out, 0),
        lambda: _C.cuda_scale_(t, 2.0, None, 0),
        lambda: _C.cuda_unscale_check_(t, torch.ones(1), torch.zeros(1), None, 0),
        lambda: _C.cuda_cast_(torch.zeros(8, dtype=torch.float16), t, 0),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="CUDA"):
            call()
    assert torch.equal(t, torch.ones(8)) and torch.equal(out, torch.zeros(3))
    with pytest.raises(TypeError, match="stream"):
        _C.cuda_scale_(t, 2.0, None, "stream")
    with pytest.raises(TypeError):
        _C.cuda_stats_(t, out)  # arity


# ---------------------------------------------------------------------------------------------
# bad input


KERNEL_CALLS = {
    "stats": lambda x: _C.stats(x),
    "nonfinite": lambda x: _C.nonfinite(x),
    "scale_": lambda x: _C.scale_(x, 2.0),
    "scale_stats_": lambda x: _C.scale_stats_(x, 2.0),
    "cast_dst": lambda x: _C.cast_(x, torch.zeros(_numel(x), dtype=torch.float16)),
    "cast_src": lambda x: _C.cast_(torch.zeros(_numel(x), dtype=torch.float16), x),
}


def _numel(x):
    return x.numel() if isinstance(x, torch.Tensor) else 3


kernel_param = pytest.mark.parametrize("call", list(KERNEL_CALLS.values()), ids=list(KERNEL_CALLS))


@kernel_param
def test_non_contiguous_rejected(call):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    before = base.clone()
    for bad in (base.reshape(-1)[::2], base.t(), base[:, 1:3], base[:, 2:3], torch.ones(1).expand(5)):
        assert not bad.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            call(bad)
    assert torch.equal(base, before)


@kernel_param
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_wrong_dtype_rejected(call, dtype):
    t = torch.zeros(3, dtype=dtype)
    name = str(dtype).replace("torch.", "")  # int64, float64, int32, uint8, bool, complex64
    with pytest.raises(TypeError, match=name):
        call(t)


@kernel_param
def test_requires_grad_rejected(call):
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match="detach"):
        call(t)
    assert torch.equal(t.detach(), torch.ones(3))
    call(t.detach())  # the detached view is fine


@kernel_param
@pytest.mark.parametrize("bad", [[1.0, 2.0, 3.0], None, 3.0, "abc", object()], ids=["list", "None", "float", "str", "object"])
def test_non_tensor_rejected(call, bad):
    with pytest.raises(TypeError, match="expected a tensor"):
        call(bad)


def test_wrong_arg_count():
    t = torch.ones(4)
    for fn, args in [
        (_C.stats, ()), (_C.stats, (t, t)), (_C.nonfinite, ()), (_C.scale_, (t,)),
        (_C.scale_, (t, 1.0, 2.0)), (_C.scale_stats_, (t,)), (_C.cast_, (t,)), (_C.cast_, (t, t, t)),
    ]:
        with pytest.raises(TypeError, match="positional argument"):
            fn(*args)
    with pytest.raises(TypeError):
        _C.stats(tensor=t)
    assert torch.equal(t, torch.ones(4))


def test_factor_must_be_a_number():
    t = torch.ones(4)
    for fn in (_C.scale_, _C.scale_stats_):
        with pytest.raises(TypeError, match="factor"):
            fn(t, "2")
        with pytest.raises(TypeError, match="factor"):
            fn(t, None)
    assert torch.equal(t, torch.ones(4))
    _C.scale_(t, 2)  # an int is a number
    assert torch.equal(t, torch.full((4,), 2.0))


def test_cast_size_mismatch():
    dst = torch.zeros(5, dtype=torch.float16)
    for src in (torch.ones(4), torch.ones(6), torch.ones(0)):
        with pytest.raises(ValueError, match="elements"):
            _C.cast_(dst, src)
    assert torch.equal(dst, torch.zeros(5, dtype=torch.float16))


def test_bad_second_argument_names_it():
    dst = torch.zeros(4)
    with pytest.raises(TypeError, match="src"):
        _C.cast_(dst, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="dst"):
        _C.cast_(torch.zeros(4, dtype=torch.int64), dst)
    with pytest.raises(ValueError, match="src.*contiguous"):
        _C.cast_(dst, torch.zeros(8)[::2])


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
        for _ in range(3):
            for name, call in kernels.items():
                c0 = counter[0]
                call()
                progress[name] += counter[0] - c0
    finally:
        stop.set()
        th.join(10)
        sys.setswitchinterval(old)
    stuck = [name for name, p in progress.items() if p <= 0]
    assert not stuck, f"no Python bytecode ran in another thread during {stuck}: GIL not released"
    assert _C.stats(t) == (float(n), 1.0, False)
    assert torch.equal(h, torch.ones(n, dtype=torch.float16))


@pytest.mark.skipif("AC_KERNELS_ISA" in os.environ, reason="start-up ISA forced by the environment")
def test_default_isa_is_the_best_available():
    assert STARTUP_ISA == ("avx2" if "avx2" in AVAILABLE_ISAS else "scalar")


def test_isa_environment_variable_forces_scalar():
    import subprocess

    code = "from accelerate_c import _C; print(_C.kernel_isa())"
    env = dict(os.environ, AC_KERNELS_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=wait_s(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"


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

