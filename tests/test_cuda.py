"""CUDA path: kernels against torch on random data, and the tutorial loop on `cuda` against a
plain torch loop with GradScaler. Runs only where a GPU is visible (benchmarks/gpu_check.sh)."""
import warnings

import pytest
import torch

from accelerate_c import Accelerator, _C
from accelerate_c.state import AcceleratorState, GradientState

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and _C.has_cuda and _C.cuda_device_count() > 0),
                                reason="needs a CUDA GPU and a CUDA build")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 255, 256, 257, 100_003, 1 << 20]


def stream():
    return torch.cuda.current_stream().cuda_stream


@pytest.fixture(autouse=True)
def _reset():
    AcceleratorState._reset_state()
    GradientState._reset_state()
    yield


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_scale_matches_torch(dtype, n):
    t = torch.randn(n, device="cuda").to(dtype)
    ref = (t.float() * 0.37).to(dtype)
    _C.cuda_scale_(t, 0.37, None, stream())
    assert torch.equal(t, ref)
    f = torch.tensor([2.0], device="cuda")
    _C.cuda_scale_(t, 0.5, f, stream())
    assert torch.equal(t, ref)  # x 0.5 x 2.0 is exact


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_stats_match_torch(dtype, n):
    t = torch.randn(n, device="cuda").to(dtype)
    out = torch.zeros(3, device="cuda")
    _C.cuda_stats_(t, out, stream())
    ref = t.double().pow(2).sum().item()
    assert abs(out[0].item() - ref) <= 1e-5 * ref
    assert out[1].item() == t.float().abs().max().item()
    assert out[2].item() == 0.0
    for where in (0, n // 2, n - 1):
        bad = t.clone()
        bad[where] = float("nan")
        out.zero_()
        _C.cuda_stats_(bad, out, stream())
        assert out[2].item() == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_check_matches_gradscaler(dtype):
    t = torch.randn(1 << 16, device="cuda").to(dtype) * 1024
    ref = t.clone()
    found_ref = torch.zeros(1, device="cuda")
    inv = torch.tensor([1 / 1024], device="cuda")
    torch._amp_foreach_non_finite_check_and_unscale_([ref], found_ref, inv)
    found = torch.zeros(1, device="cuda")
    _C.cuda_unscale_check_(t, inv, found, None, stream())
    assert torch.equal(t, ref) and found.item() == found_ref.item() == 0.0
    t[7] = float("inf")
    _C.cuda_unscale_check_(t, inv, found, None, stream())
    assert found.item() == 1.0


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_cast_matches_torch(src, dst):
    s = torch.randn(100_001, device="cuda").to(src)
    d = torch.empty(100_001, device="cuda", dtype=dst)
    _C.cuda_cast_(d, s, stream())
    assert torch.equal(d, s.to(dst))


def _run(mp, ours, steps=12, accum=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(steps)]
    if ours:
        acc = Accelerator(mixed_precision=mp, gradient_accumulation_steps=accum)
        model, opt = acc.prepare(model, opt)
        for x, y in batches:
            with acc.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x.cuda()), y.cuda())
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]
    model.cuda()
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[mp]
    scaler = torch.amp.GradScaler("cuda", enabled=mp == "fp16")
    for i, (x, y) in enumerate(batches):
        with torch.autocast("cuda", dtype=dt):
            out = model(x.cuda())
        loss = torch.nn.functional.cross_entropy(out.float(), y.cuda()) / accum
        scaler.scale(loss).backward()
        if (i + 1) % accum == 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return [p.detach().cpu() for p in model.parameters()]


@pytest.mark.parametrize("mp", ["fp16", "bf16"])
def test_tutorial_loop_on_cuda_matches_torch(mp):
    ours, ref = _run(mp, True), _run(mp, False)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_one_sync_per_fp16_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerator(mixed_precision="fp16")
    model, opt = acc.prepare(model, opt)
    x = torch.randn(8, 64, device="cuda")
    acc.backward(model(x).pow(2).mean())
    acc.clip_grad_norm_(model.parameters(), 1.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [x for x in w if "synchroniz" in str(x.message).lower()]
    assert len(syncs) <= 1, [str(x.message) for x in syncs]
