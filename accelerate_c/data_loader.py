"""Data loaders as `prepare()` returns them: device placement, end-of-data tracking for
gradient accumulation, mid-epoch resume (skip_first_batches) and seedable shuffling."""
from __future__ import annotations

import inspect

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from .sharding_data import BatchSamplerShard, IterableDatasetShard, check_split_batches
from .state import GradientState, PartialState
from .utils.operations import send_to_device
from .utils.random import synchronize_rng_states

# DataLoader's own constructor arguments and defaults, read off this torch (so new ones carry
# over), less those the sampler rebuild decides.
_DL_DEFAULTS = {k: p.default for k, p in inspect.signature(DataLoader.__init__).parameters.items()
                if k not in ("self", "dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")}


def _dataloader_kwargs(dataloader: DataLoader) -> dict:
    kwargs = {k: getattr(dataloader, k, default) for k, default in _DL_DEFAULTS.items()}
    if kwargs.get("num_workers", 0) == 0:
        kwargs["prefetch_factor"] = None  # torch refuses a prefetch_factor without workers
    return kwargs


class SeedableRandomSampler(RandomSampler):
    """A RandomSampler whose order depends only on (seed, epoch): reproducible across runs and
    resumable, whatever else consumed the global RNG."""

    def __init__(self, *args, data_seed: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial_seed = data_seed if data_seed is not None else torch.random.initial_seed()
        self.epoch = 0

    def __iter__(self):
        if self.generator is None:
            self.generator = torch.Generator()
        self.generator.manual_seed(self.initial_seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)

    def set_epoch(self, epoch: int):
        self.epoch = epoch


class SkipBatchSampler(BatchSampler):
    """Yields the batches of another batch sampler after dropping the first `skip_batches`."""

    def __init__(self, batch_sampler, skip_batches: int = 0):
        self.batch_sampler = batch_sampler
        self.skip_batches = skip_batches

    @property
    def batch_size(self):
        return getattr(self.batch_sampler, "batch_size", None)

    @property
    def drop_last(self):
        return getattr(self.batch_sampler, "drop_last", False)

    @property
    def sampler(self):
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self):
        for i, batch in enumerate(self.batch_sampler):
            if i >= self.skip_batches:
                yield batch

    @property
    def total_length(self):
        return len(self.batch_sampler)

    def __len__(self):
        return max(0, len(self.batch_sampler) - self.skip_batches)


class DataLoaderStateMixin:
    """end_of_dataloader / remainder bookkeeping shared with GradientState."""

    def reset(self):
        self.end_of_dataloader = False
        self.remainder = -1

    def begin(self):
        self.reset()
        # A loader made by skip_first_batches over a map-style dataset reports no remainder
        # (-1), as accelerate's does: gather_for_metrics then keeps every gathered sample of
        # its last batch rather than cutting at a count that was worked out for the full pass.
        if not self._drop_last and not isinstance(_batch_sampler(self), SkipBatchSampler):
            try:
                length = getattr(self.dataset, "total_length", None) or len(self.dataset)
                self.remainder = length % self.total_batch_size
            except (TypeError, ZeroDivisionError):
                pass  # unsized dataset: remainder stays unknown (-1), as in accelerate
        self.gradient_state._add_dataloader(self)

    def end(self):
        self.gradient_state._remove_dataloader(self)


class DataLoaderShard(DataLoaderStateMixin, DataLoader):
    """A DataLoader that places batches on a device and tells GradientState when the last
    batch is being yielded (it reads one batch ahead to know)."""

    def __init__(self, dataset, device=None, rng_types=None, synchronized_generator=None, skip_batches: int = 0,
                 _drop_last: bool = False, _non_blocking: bool = False, iteration: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.device = device
        self.rng_types = rng_types
        self.synchronized_generator = synchronized_generator
        self.skip_batches = skip_batches
        self.gradient_state = GradientState()
        self._drop_last = _drop_last
        # non_blocking copies only overlap when the source is pinned; elsewhere they are plain copies
        self._non_blocking = _non_blocking
        self.iteration = iteration
        self.batches_seen = 0
        self.reset()

    def __iter__(self):
        if self.rng_types:
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        self.batches_seen = 0  # batches handed out this epoch: save_state records it for resume
        it = super().__iter__()
        try:
            current = next(it)
        except StopIteration:
            self.end()
            return
        index = 0
        while True:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            try:
                nxt = next(it)
            except StopIteration:
                self.end_of_dataloader = True
                if index >= self.skip_batches:
                    self.batches_seen += 1
                    yield current
                break
            if index >= self.skip_batches:
                self.batches_seen += 1
                yield current
            index += 1
            current = nxt
        self.iteration += 1
        self.end()

    def set_epoch(self, epoch: int):
        if self.iteration != epoch:
            self.iteration = epoch
        bs = self.batch_sampler
        for obj in (bs, getattr(bs, "sampler", None), getattr(getattr(bs, "batch_sampler", None), "sampler", None)):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    @property
    def total_batch_size(self):
        bs = _batch_sampler(self)
        if isinstance(bs, SkipBatchSampler):  # skip_first_batches: the shard it wraps decides
            bs = bs.batch_sampler
        if bs is None:
            return self.batch_size
        n = getattr(bs, "num_processes", 1)
        return bs.batch_size if getattr(bs, "split_batches", False) else bs.batch_size * n

    @property
    def total_dataset_length(self):
        return getattr(self.dataset, "total_length", None) or len(self.dataset)

    def set_sampler(self, sampler):
        if isinstance(self.sampler, BatchSampler):
            self.sampler.sampler = sampler
        else:
            self.batch_sampler.sampler = sampler
            if hasattr(self.batch_sampler, "batch_sampler"):
                self.batch_sampler.batch_sampler.sampler = sampler

    def get_sampler(self):
        return get_sampler(self)


def _batch_sampler(dataloader):
    """The loader's batch sampler: its `sampler` when that is one (a loader built with
    batch_size=None around a batch sampler), else its `batch_sampler`."""
    return dataloader.sampler if isinstance(dataloader.sampler, BatchSampler) else dataloader.batch_sampler


def get_sampler(dataloader):
    bs = _batch_sampler(dataloader)
    return getattr(bs, "sampler", None) if bs is not None else None


def prepare_data_loader(dataloader: DataLoader, device=None, num_processes=None, process_index=None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types=None,
                        dispatch_batches=None, even_batches: bool = True, slice_fn_for_dispatch=None,
                        use_seedable_sampler: bool = False, data_seed=None, non_blocking: bool = False,
                        use_stateful_dataloader: bool = False) -> DataLoaderShard:
    """Wraps a DataLoader for this process (one process: the same batches, placed on device)."""
    if dispatch_batches:
        raise NotImplementedError("dispatch_batches=True is not supported yet by accelerate_c")
    if use_stateful_dataloader:
        raise NotImplementedError("use_stateful_dataloader=True is not supported yet by accelerate_c")
    state = PartialState()
    num_processes = state.num_processes if num_processes is None else num_processes
    process_index = state.process_index if process_index is None else process_index
    dataset = dataloader.dataset
    kwargs = _dataloader_kwargs(dataloader)
    is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    synchronized_generator = None
    if split_batches and num_processes > 1:
        bs = dataloader.batch_size if dataloader.batch_size is not None else \
            getattr(dataloader.batch_sampler, "batch_size", None)
        if bs is None:
            raise ValueError("split_batches needs a batch_size on the DataLoader or its batch_sampler")
        check_split_batches(bs, num_processes)
    sampler = get_sampler(dataloader) if not isinstance(dataset, IterableDataset) else None
    if isinstance(sampler, RandomSampler) and use_seedable_sampler:
        sampler = SeedableRandomSampler(sampler.data_source, replacement=sampler.replacement,
                                        num_samples=sampler._num_samples, generator=sampler.generator,
                                        data_seed=data_seed)
    batch_sampler = dataloader.sampler if is_batch_sampler else dataloader.batch_sampler
    if num_processes > 1:
        if isinstance(dataset, IterableDataset):
            synchronized_generator = getattr(dataset, "generator", None)
            dataset = IterableDatasetShard(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last,
                                           num_processes=num_processes, process_index=process_index,
                                           split_batches=split_batches)
        else:
            if not use_seedable_sampler and sampler is not None and hasattr(sampler, "generator"):
                # every process must shuffle alike: one generator, rank 0's state broadcast at
                # each epoch's start (DataLoaderShard.__iter__)
                if sampler.generator is None:
                    sampler.generator = torch.Generator()
                    sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
                synchronized_generator = sampler.generator
            batch_sampler = BatchSamplerShard(batch_sampler, num_processes=num_processes,
                                              process_index=process_index, split_batches=split_batches,
                                              even_batches=even_batches)
    # (On one process the sampler is reused as is, so a shuffled loader draws its order from the
    # global RNG at each epoch exactly as the user's DataLoader would.)
    common = dict(device=device if put_on_device else None, rng_types=rng_types,
                  synchronized_generator=synchronized_generator, _drop_last=dataloader.drop_last,
                  _non_blocking=non_blocking)
    if isinstance(dataset, IterableDataset):
        bs = dataloader.batch_size
        if split_batches and num_processes > 1 and bs is not None:
            bs = bs // num_processes
        new = DataLoaderShard(dataset, batch_size=bs, drop_last=dataloader.drop_last, **common, **kwargs)
    elif is_batch_sampler:
        new = DataLoaderShard(dataset, sampler=batch_sampler, batch_size=dataloader.batch_size, **common,
                              **kwargs)
    elif batch_sampler is None:  # batch_size=None: samples are yielded unbatched
        new = DataLoaderShard(dataset, sampler=dataloader.sampler, batch_size=None, **common, **kwargs)
    else:
        new = DataLoaderShard(dataset, batch_sampler=batch_sampler, **common, **kwargs)
    if isinstance(sampler, SeedableRandomSampler):
        new.set_sampler(sampler)
    return new


def skip_first_batches(dataloader, num_batches: int = 0):
    """A data loader that yields the batches of `dataloader` after the first `num_batches`."""
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    dataset = dataloader.dataset
    kwargs = _dataloader_kwargs(dataloader)
    is_batch_sampler = isinstance(dataloader.sampler, BatchSampler)
    new_bs = None
    if not isinstance(dataset, IterableDataset):
        new_bs = SkipBatchSampler(dataloader.sampler if is_batch_sampler else dataloader.batch_sampler,
                                  skip_batches=num_batches)
    if isinstance(dataloader, DataLoaderShard):
        extra = {}
        if new_bs is None:
            extra = dict(skip_batches=num_batches, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last)
        elif is_batch_sampler:
            extra = dict(sampler=new_bs, batch_size=dataloader.batch_size)
        else:
            extra = dict(batch_sampler=new_bs)
        # _drop_last stays False, as in accelerate's skipped loader: over an iterable shard with
        # drop_last the remainder is then worked out, and is 0 (the shard holds whole batches
        # only); over a map-style dataset it is -1 anyway (DataLoaderStateMixin.begin)
        return DataLoaderShard(dataset, device=dataloader.device, rng_types=dataloader.rng_types,
                               synchronized_generator=dataloader.synchronized_generator,
                               _drop_last=False, _non_blocking=dataloader._non_blocking,
                               iteration=dataloader.iteration, **extra, **kwargs)
    if new_bs is None:
        return SkipDataLoader(dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
                              drop_last=dataloader.drop_last, **kwargs)
    return DataLoader(dataset, batch_sampler=new_bs, **kwargs)


class SkipDataLoader(DataLoaderStateMixin, DataLoader):
    """A plain DataLoader over an iterable dataset that drops its first `skip_batches` batches."""

    def __init__(self, dataset, skip_batches: int = 0, **kwargs):
        super().__init__(dataset, **kwargs)
        self.skip_batches = skip_batches
        self.gradient_state = GradientState()
        self._drop_last = kwargs.get("drop_last", False)
        self.reset()

    @property
    def total_batch_size(self):
        return self.batch_size

    def __iter__(self):
        self.begin()
        for i, batch in enumerate(super().__iter__()):
            if i >= self.skip_batches:
                yield batch
        self.end()
