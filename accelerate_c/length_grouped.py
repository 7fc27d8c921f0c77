"""transformers' `train_sampling_strategy="group_by_length"`: a sampler that puts samples of
about the same length next to each other (less padding per batch) while staying random, with
the index order of transformers 5.23's LengthGroupedSampler for the same random state, and how
its Trainer finds the lengths. Imports nothing of accelerate_c.

The order, for n samples and a batch size b: a random permutation of range(n) (torch.randperm
on the sampler's generator, or on the global torch RNG without one), cut into mega-batches of
m * b indices (m = min(n // (4 b), 50), at least 1), each sorted by decreasing length (ties
keep their permuted order); then the first index of the mega-batch holding the longest sample
(the first such) trades places with the very first index, so an out-of-memory error shows in
the first batch. On several processes transformers' Trainer uses this same global order and
accelerate shards its batches (BatchSamplerShard), which the Accelerator's prepare does here.
DistributedLengthGroupedSampler, which transformers still ships but its Trainer no longer uses,
is here for loops that build it themselves."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
from torch.utils.data import Sampler


def length_grouped_indices(lengths, batch_size: int, mega_batch_mult: int | None = None, generator=None) -> list:
    """The indices of `lengths` in length-grouped random order (the module's rule)."""
    n = len(lengths)
    if mega_batch_mult is None:
        mega_batch_mult = max(1, min(n // (batch_size * 4), 50))
    perm = torch.randperm(n, generator=generator).tolist()
    size = mega_batch_mult * batch_size
    groups = [sorted(perm[i:i + size], key=lambda j: lengths[j], reverse=True) for i in range(0, n, size)]
    if not groups:
        return []
    heads = [lengths[g[0]] for g in groups]
    top = heads.index(max(heads))  # the first mega-batch holding a longest sample
    groups[0][0], groups[top][0] = groups[top][0], groups[0][0]
    return [i for g in groups for i in g]


def lengths_of(dataset, model_input_name: str | None = None, length_column_name: str | None = None,
               what: str = "dataset") -> list:
    """The length of every sample as transformers' Trainer finds it: a `datasets.Dataset`'s
    `length_column_name` column when it has one, else len(sample[model_input_name]) (default
    "input_ids") of every sample, which must then be mappings holding that key."""
    columns = getattr(dataset, "column_names", None)
    if length_column_name and isinstance(columns, (list, tuple)) and length_column_name in columns and \
            type(dataset).__module__.split(".")[0] == "datasets":
        return list(dataset[length_column_name])
    key = model_input_name if model_input_name is not None else "input_ids"
    first = dataset[0] if len(dataset) else None
    if not isinstance(first, Mapping) or key not in first:
        raise ValueError(f"train_sampling_strategy='group_by_length': the lengths of the {what}'s samples are read "
                         f"from their {key!r} entry, and its samples are {type(first).__name__}s without one; give "
                         f"samples that are mappings with {key!r}, or a datasets.Dataset with a length column "
                         f"(length_column_name)")
    return [len(sample[key]) for sample in dataset]


class LengthGroupedSampler(Sampler):
    """Samples in length-grouped random order (length_grouped_indices) with transformers'
    signature; `lengths` (a list or a tensor) or the `dataset`'s samples give the lengths.
    Without a generator each pass draws its permutation from the global torch RNG, as
    transformers' does for the training set."""

    def __init__(self, batch_size: int, dataset=None, lengths=None, model_input_name: str | None = None,
                 generator=None):
        if dataset is None and lengths is None:
            raise ValueError("LengthGroupedSampler: give a dataset or its lengths")
        if lengths is None:
            lengths = lengths_of(dataset, model_input_name)
        elif isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        self.batch_size = batch_size
        self.lengths = lengths
        self.generator = generator

    def __len__(self):
        return len(self.lengths)

    def __iter__(self):
        return iter(length_grouped_indices(self.lengths, self.batch_size, generator=self.generator))


class DistributedLengthGroupedSampler(Sampler):
    """transformers' DistributedLengthGroupedSampler: every process computes the same
    length-grouped order from a generator seeded with `seed` + the epoch (set_epoch), pads it by
    repeating its start to a multiple of `num_replicas` (or, with drop_last, cuts the tail) and
    takes every num_replicas-th index from `rank` on. num_replicas / rank default to the
    initialised process group, else the launcher's WORLD_SIZE / RANK."""

    def __init__(self, batch_size: int, dataset=None, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0, drop_last: bool = False, lengths=None, model_input_name: str | None = None):
        if dataset is None and lengths is None:
            raise ValueError("DistributedLengthGroupedSampler: give a dataset or its lengths")
        if num_replicas is None or rank is None:
            world, me = _world()
            num_replicas = world if num_replicas is None else num_replicas
            rank = me if rank is None else rank
        if lengths is None:
            lengths = lengths_of(dataset, model_input_name)
        elif isinstance(lengths, torch.Tensor):
            lengths = lengths.tolist()
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.drop_last, self.epoch = seed, drop_last, 0
        self.lengths = lengths
        n = len(lengths)
        # with drop_last, the largest multiple of num_replicas below n (as transformers counts it)
        self.num_samples = math.ceil((n - num_replicas) / num_replicas) if drop_last and n % num_replicas \
            else math.ceil(n / num_replicas)
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = length_grouped_indices(self.lengths, self.batch_size, generator=g)
        if self.drop_last:
            order = order[:self.total_size]
        else:
            order += order[:self.total_size - len(order)]
        if len(order) != self.total_size:
            raise ValueError(f"DistributedLengthGroupedSampler: {len(self.lengths)} samples cannot be spread evenly "
                             f"over {self.num_replicas} processes")
        return iter(order[self.rank:self.total_size:self.num_replicas])


def _world():
    """(world size, rank) of the initialised torch process group, else of the launcher's variables."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    raise RuntimeError("DistributedLengthGroupedSampler: pass num_replicas and rank (no process group is "
                       "initialised and WORLD_SIZE / RANK are not set)")
