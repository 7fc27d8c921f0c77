"""CUDA path: kernels against torch on random data, the tutorial loop on `cuda` against a plain
torch loop with GradScaler, and the checkpoint writer staging CUDA tensors through pinned buffers
(byte-identical to the safetensors package). Runs only where a GPU is visible
(benchmarks/gpu_check.sh)."""
import os
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
@pytest.mark.parametrize("n", [(1 << 24) + 17, 3 * 4096 * 256 + 5, 300_001])
def test_sumsq_is_bitwise_reproducible_and_matches_torch(dtype, n):
    """The sum of squares of cuda_stats_ and of cuda_unscale_check_ is bitwise the same in 20
    runs (per-block partials summed in a fixed order, not float atomics), and within fp32
    rounding of torch's float64 sum; a second buffer accumulates onto the first's."""
    torch.manual_seed(5)
    t = (torch.randn(n, device="cuda") * 3).to(dtype)
    ref = t.double().pow(2).sum().item()
    bits = set()
    out = torch.zeros(3, device="cuda")
    for _ in range(20):
        out.zero_()
        _C.cuda_stats_(t, out, stream())
        bits.add(out[0:1].view(torch.int32).item())
    assert len(bits) == 1, f"{len(bits)} different sums in 20 runs"
    assert abs(out[0].item() - ref) <= 1e-6 * ref
    inv, found, sq = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    sq_bits = set()
    for _ in range(20):
        sq.zero_()
        _C.cuda_unscale_check_(t, inv, found, sq, stream())  # x 1.0: t is unchanged
        sq_bits.add(sq.view(torch.int32).item())
    assert len(sq_bits) == 1 and sq_bits == bits
    _C.cuda_stats_(t[: n // 2], out, stream())
    want = ref + t[: n // 2].double().pow(2).sum().item()
    assert abs(out[0].item() - want) <= 2e-6 * want


@pytest.mark.parametrize("dtype", DTYPES)
def test_unscale_check_matches_gradscaler(dtype):
    t = torch.randn(1 << 16, device="cuda").to(dtype) * 1024
    ref = t.clone()
    found_ref = torch.zeros(1, device="cuda")
    inv = torch.tensor([1 / 1024], device="cuda")
    if dtype == torch.bfloat16:
        # torch's CUDA unscale kernel has no bfloat16 (GradScaler is for fp16 gradients): the
        # reference is its arithmetic spelled out, the product taken in float then rounded
        ref = (ref.float() * inv).to(dtype)
        found_ref += (~torch.isfinite(ref)).any().float()
    else:
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


class _TwoGpuMlp(torch.nn.Module):
    """A model spread over two GPUs as hf_device_map places one: layer a on cuda:0, b on cuda:1."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64).to("cuda:0"), torch.nn.Linear(64, 4).to("cuda:1")
        self.c = torch.nn.Linear(32, 4).to("cuda:0")

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to("cuda:1")) + self.c(x).to("cuda:1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="multi-device clip: needs two GPUs (only one visible)")
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_of_a_model_on_two_gpus_matches_torch(norm_type):
    """Gradient groups on cuda:0 and cuda:1 (hf_device_map): every kernel runs on its own
    device with its own scratch and stream; the norm and the clipped gradients equal torch's."""
    torch.manual_seed(0)
    torch.cuda.set_device(0)
    ref = _TwoGpuMlp()
    model = _TwoGpuMlp()
    model.load_state_dict(ref.state_dict())
    model.hf_device_map = {"a": 0, "c": 0, "b": 1}
    acc = Accelerator()
    model = acc.prepare(model)
    x = torch.randn(16, 32, device="cuda:0")
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
    got = acc.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type)
    assert torch.cuda.current_device() == 0
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), rtol=1e-5, atol=0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.device == q.grad.device, n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_grad_norm_of_a_16bit_model_is_torchs_bit_for_bit(dtype):
    """A 16-bit model on one GPU: torch's clip takes each gradient's norm in its dtype before
    the total; the CUDA path does (torch's _foreach_norm for the sum of squares), so norms,
    clipped gradients and parameters are torch's bit for bit over several steps."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).to("cuda", dtype)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).to("cuda", dtype)
    model.load_state_dict(ref.state_dict())
    acc = Accelerator()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(8, 16, device="cuda", dtype=dtype)
        for m in (model, ref):
            m(x).float().pow(2).mean().backward()
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        got = acc.clip_grad_norm_(model.parameters(), 0.05)
        assert got.dtype == want.dtype and torch.equal(got, want), (step, got, want)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), step
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), step


# ---- checkpoint writer: CUDA tensors staged through pinned buffers in C ----------------------------

def _o_direct_ok(directory):
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False
    probe = os.path.join(directory, ".probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | flag, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _checkpoint_tensors():
    torch.manual_seed(0)
    return {
        "w.f32": torch.randn(1000, 33, device="cuda"),
        "w.f16": torch.randn(777, device="cuda").half(),
        "w.bf16": torch.randn(64, 65, device="cuda").bfloat16(),
        "w.f64": torch.randn(129, device="cuda").double(),
        "step.i64": torch.arange(12345, device="cuda"),
        "mask.bool": torch.rand(1001, device="cuda") > 0.5,
        "ids.u8": torch.randint(0, 256, (4099,), dtype=torch.uint8, device="cuda"),
        "w.transposed": torch.randn(300, 200, device="cuda").t(),  # non-contiguous
        "w.big": torch.randn(5 << 20, device="cuda"),  # 20 MB: spans three 8 MiB chunks
        "scalar": torch.tensor(3.5, device="cuda"),
        "empty": torch.empty(0, 4, device="cuda"),
        "cpu.bias": torch.randn(100, 7),  # a CPU tensor in the same file
    }


@pytest.mark.parametrize("direct_io,threads", [("0", 0), ("1", 0), ("auto", 0), ("auto", 4)])
def test_save_file_stages_cuda_tensors(tmp_path, monkeypatch, direct_io, threads):
    """save_file hands CUDA tensors to the C writer (pinned staging, device->host copies on its
    own streams): the file is byte-identical to safetensors.torch.save_file of the same tensors
    on the CPU, in every ACCELERATE_C_DIRECT_IO mode, and loads back equal."""
    st_pkg = pytest.importorskip("safetensors.torch")
    from accelerate_c.safetensors_io import load_file, save_file
    if direct_io == "1" and not _o_direct_ok(str(tmp_path)):
        pytest.skip("the file system of tmp_path refuses O_DIRECT")
    monkeypatch.setenv("ACCELERATE_C_DIRECT_IO", direct_io)
    tensors = _checkpoint_tensors()
    device_before = torch.cuda.current_device()
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    save_file(tensors, ours, metadata={"format": "pt"}, threads=threads)
    if direct_io == "0":
        assert _C.st_last_write_mode() == "buffered"
    elif direct_io == "1":
        assert _C.st_last_write_mode() == "direct"
    assert torch.cuda.current_device() == device_before
    st_pkg.save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, ref, metadata={"format": "pt"})
    assert ours.read_bytes() == ref.read_bytes()
    back = load_file(ours)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v.cpu()), k
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "ref.safetensors"]


def test_save_file_waits_for_pending_gpu_work(tmp_path):
    """The writer's copies run on streams of its own: save_file must first wait for the kernels
    still queued on torch's current stream (here a side stream) that write the tensors."""
    from accelerate_c.safetensors_io import load_file, save_file
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(4 << 20, device="cuda")
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before the fill
        x.fill_(7.0)
        save_file({"x": x}, tmp_path / "x.safetensors")
    assert torch.all(load_file(tmp_path / "x.safetensors")["x"] == 7.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_save_file_tensors_on_two_gpus(tmp_path):
    st_pkg = pytest.importorskip("safetensors.torch")
    from accelerate_c.safetensors_io import save_file
    torch.cuda.set_device(0)
    tensors = {"a": torch.randn(3 << 20, device="cuda:0"), "b": torch.randn(3 << 20, device="cuda:1"),
               "c": torch.arange(1000, device="cuda:1")}
    save_file(tensors, tmp_path / "two.safetensors")
    assert torch.cuda.current_device() == 0
    st_pkg.save_file({k: v.cpu() for k, v in tensors.items()}, tmp_path / "ref.safetensors")
    assert (tmp_path / "two.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


# ---- the writer's copies wait for the stream that produced the tensors, on any thread ------------
_SLEEP = 400_000_000  # ~0.2 s of GPU time queued before the kernels that write the tensors


def test_save_file_on_another_thread_waits_for_the_producers_stream(tmp_path):
    """A tensor written by a kernel on a side stream right before the save, saved from another
    thread (whose current stream is not the side stream) with the events record_ready took on
    the producing thread: the file holds the kernel's values."""
    import threading

    from accelerate_c.safetensors_io import after_ready, load_file, record_ready, save_file
    side = torch.cuda.Stream()
    x = torch.zeros(4 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(_SLEEP)
        x.fill_(7.0)
        ready = record_ready(x)
    err = []
    write = after_ready(ready, lambda: save_file({"x": x}, tmp_path / "x.safetensors"))
    t = threading.Thread(target=lambda: _capture(err, write))
    t.start()
    t.join()
    assert not err, err
    assert torch.all(load_file(tmp_path / "x.safetensors")["x"] == 7.0)


def _capture(err, fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as e:  # noqa: BLE001 - reported by the test
        err.append(e)


def test_save_state_and_sharded_save_model_wait_for_side_stream_work(tmp_path):
    """save_state and a sharded save_model write their files from worker threads: parameters
    written on the training thread's side stream right before the save are saved with the
    written values (the workers' own current streams know nothing of that work)."""
    from accelerate_c.safetensors_io import load_file
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerator()
    model, opt = acc.prepare(model, opt)
    side = torch.cuda.Stream()
    for k, save in enumerate((lambda d: acc.save_state(d),
                              lambda d: acc.save_model(model, d, max_shard_size="1MB"))):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(_SLEEP)
            with torch.no_grad():
                for i, p in enumerate(model.parameters()):
                    p.fill_(float(10 * k + i + 1))
            save(str(tmp_path / f"s{k}"))
        files = sorted(f for f in os.listdir(tmp_path / f"s{k}") if f.startswith("model") and
                       f.endswith(".safetensors"))
        assert len(files) >= (1 if k == 0 else 2), files
        got = {}
        for f in files:
            got.update(load_file(tmp_path / f"s{k}" / f))
        for i, (n, p) in enumerate(model.named_parameters()):
            assert torch.all(got[n] == float(10 * k + i + 1)), (k, n)
