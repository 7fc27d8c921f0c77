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
accelerate shards its batches (BatchSamplerShard), which the Accelerator's prepare does here."""
from __future__ import annotations

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
