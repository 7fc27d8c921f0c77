"""GPU-only logic on this GPU-less machine, against stand-ins: which device the small tensors of
the reducer's collectives live on under NCCL (a fake NCCL that, like the real one, refuses CPU
tensors). What only a GPU can show runs in benchmarks/gpu_check.sh (docs/gpu.md)."""
import pytest
import torch

from accelerate_c import ddp


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
    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return fake


class _Manager:
    extra_pending = True


def test_sync_gradients_with_no_pending_bucket_puts_its_flags_on_the_gpu(fake_nccl):
    """Only float64 params (no flat buffer) got gradients on this sync step: no group is
    pending, and the used-flags all-reduce must still go to NCCL on a CUDA device."""
    used, unused = torch.nn.Parameter(torch.ones(3, dtype=torch.float64)), torch.nn.Parameter(torch.ones(2))
    used.grad = fake_nccl.mark(torch.full((3,), 4.0, dtype=torch.float64))
    manager = _Manager()
    ddp.sync_gradients(manager, [], [used, unused])
    flags = [c for c in fake_nccl.calls if c[2] == 2]
    assert flags and flags[0][1].type == "cuda", fake_nccl.calls
    # the reference: torch DDP's average over 2 ranks of the same gradient is that gradient
    assert torch.equal(used.grad, torch.full((3,), 4.0, dtype=torch.float64))
    assert unused.grad is None and manager.extra_pending is False


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
        groups = []

    j = ddp.ModelJoinable(_Mgr(), torch.nn.Linear(1, 1))
    assert j.join_device == torch.device("cuda", 0)
