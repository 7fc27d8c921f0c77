"""cast_ of accelerate_c._C between fp32, fp16 and bf16 checked bit for bit against torch's .to():
random data, the special values, every 16-bit pattern, random fp32 bit patterns, the rounding
midpoints, the two instruction sets agreeing (NaN payloads included), same-dtype copies and
overlapping buffers."""
import math

import pytest
import torch

import accelerate_c
from accelerate_c import _C

from conftest import (
    AVAILABLE_ISAS,
    DTYPE_IDS,
    DTYPES,
    SPECIAL_ROUNDS,
    assert_bitwise,
    finite_data,
    gen,
    int_view,
    size_param,
    tiled_specials,
    wide_data,
)

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")


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
