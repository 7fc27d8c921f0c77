"""Run by tests/test_wheel_ops.py on N CPU processes: the behaviours accelerate's own test
scripts (tests/test_accelerate_scripts.py) found missing or different, each checked against
plain torch.distributed on the same data."""
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accelerate_c import Accelerator, DataLoaderConfiguration
from accelerate_c.utils import (
    DistributedOperationException,
    copy_tensor_to_devices,
    pad_across_processes,
    synchronize_rng_states,
)


acc = Accelerator(cpu=True)
n, r = acc.num_processes, acc.process_index
assert n > 1


def everyone(t):
    """Plain torch: every rank's copy of t."""
    out = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(out, t.contiguous())
    return out


# synchronize_rng_states (exported from accelerate_c.utils): rank 0's torch and generator state everywhere
torch.manual_seed(100 + r)
gen = torch.Generator().manual_seed(200 + r)
rank0_torch = everyone(torch.get_rng_state())[0]
rank0_gen = everyone(gen.get_state())[0]
synchronize_rng_states(["torch", "generator"], generator=gen)
assert torch.equal(torch.get_rng_state(), rank0_torch) and torch.equal(gen.get_state(), rank0_gen)
assert all(torch.equal(s, rank0_torch) for s in everyone(torch.get_rng_state()))

# copy_tensor_to_devices: only the last rank holds the tensor; dtype and shape travel too
ref = torch.arange(6, dtype=torch.int32).reshape(2, 3) * 7
got = copy_tensor_to_devices(ref.clone() if r == n - 1 else None)
assert got.dtype == torch.int32 and torch.equal(got, ref), got
assert all(torch.equal(t, ref) for t in everyone(got))

# pad_across_processes: tensors of different ranks (number of dims) -> DistributedOperationException
# (still a ValueError) on every rank, not a hang or a silent pad
t = torch.zeros(1, 5) if r == 0 else torch.zeros(1, 1, 6)
try:
    pad_across_processes({"tensor": t}, dim=0)
    raise AssertionError("pad_across_processes with different ranks did not raise")
except DistributedOperationException as e:
    assert isinstance(e, ValueError) and "number of dimensions" in str(e), e
# and the ordinary case still pads like torch: rank k has k+1 rows
mine = torch.full((r + 1, 2), float(r))
padded = pad_across_processes(mine, dim=0, pad_index=-1)
assert padded.shape == (n, 2) and torch.equal(padded[: r + 1], mine) and bool((padded[r + 1:] == -1).all())
# broadcast / reduce mismatches raise the same class
try:
    acc.reduce(torch.zeros(r + 1))
    raise AssertionError("reduce with different shapes did not raise")
except DistributedOperationException:
    pass

# join_uneven_inputs: even_batches overridden for map-style loaders inside the block only
acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(even_batches=True))
dl = acc.prepare(DataLoader(TensorDataset(torch.arange(2 * n - 1)), batch_size=1))
ref_counts = [len(list(range(k, 2 * n - 1, n))) for k in range(n)]  # plain round-robin: uneven
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with acc.join_uneven_inputs([], even_batches=False):
        assert dl.batch_sampler.even_batches is False
        inside = [b[0].tolist() for b in dl]
    assert not w, [str(x.message) for x in w]
assert len(inside) == ref_counts[r], (inside, ref_counts)
assert sum(x for b in inside for x in b) == sum(range(2 * n - 1)[r::n])
assert dl.batch_sampler.even_batches is True and len(list(dl)) == 2  # restored: padded to even


class Stream(IterableDataset):
    def __iter__(self):
        yield from range(4 * n)


acc.prepare(DataLoader(Stream(), batch_size=1))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with acc.join_uneven_inputs([], even_batches=False):
        pass
assert any("only supported for map-style datasets" in str(x.message) for x in w), [str(x.message) for x in w]
acc.print(f"wheel ops OK on {n} processes")
