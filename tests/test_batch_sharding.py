"""Which batches each process gets: BatchSamplerShard / IterableDatasetShard against accelerate
1.15's own classes on every small configuration, plus worked examples stated by hand."""
import itertools

import pytest
from torch.utils.data import BatchSampler, SequentialSampler

from accelerate_c.batch_sharding import BatchSamplerShard, IterableDatasetShard


def shards(n_samples, bs, n, drop=False, split=False, even=True):
    base = BatchSampler(SequentialSampler(range(n_samples)), bs, drop)
    return [[list(b) for b in BatchSamplerShard(base, n, r, split_batches=split, even_batches=even)]
            for r in range(n)]


def test_worked_examples():
    # 10 samples, batches of 3, 2 processes: the short last batch [9] is completed from the start
    assert shards(10, 3, 2) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9, 0, 1]]]
    # 7 samples, batches of 2, 3 processes: [6] is completed, then whole batches from the start
    assert shards(7, 2, 3) == [[[0, 1], [6, 0]], [[2, 3], [1, 2]], [[4, 5], [3, 4]]]
    # uneven: no filling, the last process gets fewer batches
    assert shards(10, 3, 2, even=False) == [[[0, 1, 2], [6, 7, 8]], [[3, 4, 5], [9]]]
    # drop_last: the incomplete last round is dropped
    assert shards(10, 3, 2, drop=True) == [[[0, 1, 2]], [[3, 4, 5]]]
    # split_batches: every batch of 4 is cut in two; the short last one is completed first
    assert shards(10, 4, 2, split=True) == [[[0, 1], [4, 5], [8, 9]], [[2, 3], [6, 7], [0, 1]]]
    it = [list(IterableDatasetShard(range(7), 2, False, 2, r)) for r in range(2)]
    assert it == [[0, 1, 4, 5], [2, 3, 6, 0]]


def test_split_batches_needs_a_multiple_of_processes():
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        BatchSamplerShard(BatchSampler(SequentialSampler(range(8)), 3, False), 2, 0, split_batches=True)


def test_matches_accelerate_on_every_small_configuration():
    ref = pytest.importorskip("accelerate.data_loader")
    for n_samples, bs, n, drop, split, even in itertools.product(range(0, 19), [1, 2, 3, 4, 6], [1, 2, 3, 4],
                                                                 [False, True], [False, True], [False, True]):
        if split and bs % n:
            continue
        base = BatchSampler(SequentialSampler(range(n_samples)), bs, drop)
        for r in range(n):
            theirs = ref.BatchSamplerShard(base, n, r, split_batches=split, even_batches=even)
            ours = BatchSamplerShard(base, n, r, split_batches=split, even_batches=even)
            cfg = (n_samples, bs, n, drop, split, even, r)
            assert [list(b) for b in ours] == [list(b) for b in theirs], cfg
            assert len(ours) == len(theirs), cfg
        if not even:
            continue
        for r in range(n):
            theirs = list(ref.IterableDatasetShard(range(n_samples), bs, drop, n, r, split))
            assert list(IterableDatasetShard(range(n_samples), bs, drop, n, r, split)) == theirs
