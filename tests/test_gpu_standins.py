"""GPU-only logic on this GPU-less machine, against stand-ins: which device the small tensors of
the reducer's collectives live on under NCCL (a fake NCCL that, like the real one, refuses CPU
tensors). What only a GPU can show runs in benchmarks/gpu_check.sh (docs/gpu.md)."""
import math
import types

import pytest
import torch

from accelerate_c import collectives
from accelerate_c.strategies import ddp


class FakeNcclDist:
    """torch.distributed as seen on an NCCL process group of `world` ranks, every rank passing
    the same values: an all-reduce sums, and refuses a tensor that is not on a CUDA device
    (what ProcessGroupNCCL does with a CPU tensor). Tensors cannot be put on a GPU here, so
    torch.tensor(..., device=cuda) is patched to make a CPU tensor and remember that it was
    asked for on CUDA; tests mark the gradients that would be on the GPU the same way."""

    def __init__(self, world=2):
        self.world = world
        self.on_cuda = {}  # id(tensor) -> the CUDA device it was asked for on
        self.calls = []

    def mark(self, t, device="cuda:0"):
        self.on_cuda[id(t)] = torch.device(device)
        return t

    def get_backend(self, group=None):
        return "nccl"

    def get_world_size(self, group=None):
        return self.world

    def get_rank(self, group=None):
        return 0

    def all_reduce(self, t, op=None, group=None, async_op=False):
        if id(t) not in self.on_cuda:
            raise RuntimeError("No backend type associated with device type cpu")  # ProcessGroupNCCL's refusal
        self.calls.append(("all_reduce", self.on_cuda[id(t)], t.numel()))
        t.mul_(self.world)


@pytest.fixture
def fake_nccl(monkeypatch):
    fake = FakeNcclDist()
    real_tensor = torch.tensor

    def tensor(data, *args, device=None, **kw):
        t = real_tensor(data, *args, **kw)
        if device is not None and torch.device(device).type == "cuda":
            fake.mark(t, device)
        return t

    monkeypatch.setattr(ddp, "dist", fake)
    monkeypatch.setattr(collectives, "dist", fake)  # the reducer's collectives go through it
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


def test_float64_reduction_puts_its_flags_on_the_gpu(fake_nccl):
    """A model whose float64 params (no flat buffer) got gradients: their used-flags all-reduce
    (DDPStrategy.reduce_unbuffered, with no gradient group involved) must go to NCCL on a CUDA
    device."""
    used, unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64)), torch.nn.Parameter(torch.ones(2))
    used.grad = fake_nccl.mark(torch.full((3,), 4.0, dtype=torch.float64))
    strategy = ddp.DDPStrategy.__new__(ddp.DDPStrategy)  # just what reduce_unbuffered reads
    strategy.manager = types.SimpleNamespace(unbuffered_of={7: [used, unused]})
    strategy.world, strategy.hook_dtype, strategy.unbuffered_used_sum = 2, None, {}
    strategy.reduce_unbuffered(7)
    flags = [c for c in fake_nccl.calls if c[2] == 2]
    assert flags and flags[0][1].type == "cuda", fake_nccl.calls
    # the reference: torch DDP's average over 2 ranks of the same gradient is that gradient
    assert torch.equal(used.grad, torch.full((3,), 4.0, dtype=torch.float64))
    assert unused.grad is None


class _CpuGroup:
    """A gradient group whose buffer is on the CPU (e.g. an offloaded part of a model)."""
    is_cuda = False
    device = torch.device("cpu")


def test_collective_device_is_cuda_on_nccl_whatever_the_groups(fake_nccl):
    class _CudaGroup:
        is_cuda = True
        device = torch.device("cuda", 1)

    assert ddp._collective_device([]) == torch.device("cuda", 0)
    assert ddp._collective_device([_CpuGroup()]) == torch.device("cuda", 0)
    assert ddp._collective_device([_CpuGroup(), _CudaGroup()]) == torch.device("cuda", 1)
    fake_nccl.get_backend = lambda group=None: "gloo"
    assert ddp._collective_device([_CudaGroup()]) == torch.device("cpu")


def test_join_device_is_cuda_on_nccl_without_groups(fake_nccl):
    class _Mgr:
        def groups_of(self, model_key):
            return []

    j = ddp.ModelJoinable(_Mgr(), None, torch.nn.Linear(1, 1))
    assert j.join_device == torch.device("cuda", 0)


# ---- clip on gradient groups spread over several GPUs (hf_device_map) ----------------------------
class FakeCudaKernels:
    """The CUDA kernels of _C as seen from a model spread over GPUs: each call must get the
    buffer, its scratch and a stream of one device (a kernel reads and writes the memory of the
    device it runs on only). `dev_of` maps id(tensor) / stream handles to the device a test put
    them on; the arithmetic is plain torch (the real kernels are checked in tests/test_cuda.py)."""

    def __init__(self):
        self.dev_of = {}
        self.bad = []

    def _same(self, fn, **objs):
        devs = {name: self.dev_of.get(k) for name, k in objs.items()}
        if len(set(devs.values())) != 1:
            self.bad.append((fn, devs))

    def cuda_stats_(self, t, out, stream):
        self._same("cuda_stats_", tensor=id(t), out=id(out), stream=("stream", stream))
        v = t.double()
        out[0] += float((v * v).sum())
        out[1] = max(float(out[1]), float(v.abs().max()))
        if not bool(torch.isfinite(v).all()):
            out[2] = 1.0

    def cuda_scale_(self, t, factor, dev_factor, stream):
        self._same("cuda_scale_", tensor=id(t), stream=("stream", stream))
        t.mul_(factor * (1.0 if dev_factor is None else float(dev_factor[0])))


class _FakeCudaGroup:
    def __init__(self, kernels, device_index, buf, sizes=None):
        self.is_cuda, self.needs_unscale = True, False
        self.device_index, self.buf, self.dtype = device_index, buf, buf.dtype
        self.views = list(buf.split(sizes or [buf.numel()]))  # each parameter's gradient
        self.stats_dev, self.part_dev = torch.zeros(3), torch.zeros(3)
        self._stream = 0x1000 + device_index  # the current stream of that device
        for k in (id(buf), id(self.stats_dev), id(self.part_dev), ("stream", self._stream)):
            kernels.dev_of[k] = device_index

    def stream(self):
        return self._stream

    def has_gradients(self):
        return True

    def zero_gaps(self):  # no alignment gaps in these buffers
        pass

    def wrote(self):
        pass


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_on_groups_of_several_gpus_keeps_each_kernel_on_its_device(monkeypatch, norm_type):
    from accelerate_c import grads

    kernels = FakeCudaKernels()
    monkeypatch.setattr(grads, "_C", kernels)
    gen = torch.Generator().manual_seed(3)
    bufs = [torch.randn(n, generator=gen) * s for n, s in ((50, 1.0), (70, 3.0), (20, 0.5))]
    ref = [torch.nn.Parameter(torch.zeros_like(b)) for b in bufs]
    for p, b in zip(ref, bufs):
        p.grad = b.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    # groups on devices 0, 1, 0: the second device's kernels must not get the first's scratch or stream
    groups = [_FakeCudaGroup(kernels, d, b) for d, b in zip((0, 1, 0), bufs)]
    got = grads.GradManager._clip_cuda(None, groups, 1.0, norm_type, None)
    assert kernels.bad == []
    torch.testing.assert_close(got.double(), want.double(), rtol=1e-6, atol=0)
    for g, p in zip(groups, ref):
        torch.testing.assert_close(g.buf, p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_on_gpu_reports_nan_and_inf_as_torch(monkeypatch, bad, norm_type):
    """A NaN gradient gives a NaN norm and NaN gradients, an inf one an inf norm and gradients
    x 0 (inf x 0 = NaN where the inf was), as torch's clip_grad_norm_ does (the CUDA path used
    to report inf for both)."""
    from accelerate_c import grads

    kernels = FakeCudaKernels()
    monkeypatch.setattr(grads, "_C", kernels)
    gen = torch.Generator().manual_seed(5)
    bufs = [torch.randn(n, generator=gen) for n in (30, 40)]
    bufs[1][7] = bad
    ref = [torch.nn.Parameter(torch.zeros_like(b)) for b in bufs]
    for p, b in zip(ref, bufs):
        p.grad = b.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
    groups = [_FakeCudaGroup(kernels, 0, b) for b in bufs]
    got = grads.GradManager._clip_cuda(None, groups, 1.0, norm_type, None)
    torch.testing.assert_close(got.double(), want.double(), equal_nan=True)
    for g, p in zip(groups, ref):
        torch.testing.assert_close(g.buf, p.grad, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_clip_on_gpu_rounds_each_16bit_gradient_norm_as_torch(monkeypatch, dtype):
    """16-bit groups: torch's clip takes each gradient's norm in its dtype before the total;
    the CUDA path uses torch's own per-gradient norms (_foreach_norm) for the sum of squares,
    so the norm and the clipped gradients are torch's bit for bit, over two devices."""
    from accelerate_c import grads

    kernels = FakeCudaKernels()
    monkeypatch.setattr(grads, "_C", kernels)
    gen = torch.Generator().manual_seed(2)  # a draw where the two roundings differ (checked below)
    sizes = [[3, 17, 1, 40, 9], [12, 5, 33]]
    bufs = [(torch.randn(sum(sz), generator=gen) * 3).to(dtype) for sz in sizes]
    ref = [torch.nn.Parameter(torch.zeros_like(v)) for b, sz in zip(bufs, sizes) for v in b.split(sz)]
    for p, v in zip(ref, [v for b, sz in zip(bufs, sizes) for v in b.split(sz)]):
        p.grad = v.clone()
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5)
    groups = [_FakeCudaGroup(kernels, d, b, sz) for d, b, sz in zip((0, 1), bufs, sizes)]
    exact = math.sqrt(sum(float(b.double().square().sum()) for b in bufs))
    assert torch.tensor(exact, dtype=dtype) != want, "the case should tell the two roundings apart"
    got = grads.GradManager._clip_cuda(None, groups, 0.5, 2.0, None)
    assert kernels.bad == []
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)
    for v, p in zip([v for g in groups for v in g.views], ref):
        assert torch.equal(v, p.grad)
