"""Data loaders as `prepare()` returns them: device placement, end-of-data tracking for
gradient accumulation, mid-epoch resume (skip_first_batches) and seedable shuffling."""
from __future__ import annotations

import inspect
import sys

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler

from .batch_dispatch import BatchChannel, batch_size_of, concatenate, slice_batch
from .batch_sharding import BatchSamplerShard, IterableDatasetShard, check_split_batches
from .state import GradientState, PartialState
from .state_io import rng_state, set_rng_state
from .stateful_loader import stateful_variant
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


class DataLoaderAdapter:
    """What the prepared loaders (DataLoaderShard, DataLoaderDispatcher, their stateful variants)
    share under accelerate's name, so `isinstance(loader, DataLoaderAdapter)` tells a prepared
    loader as in accelerate. accelerate's adapter wraps a DataLoader (or StatefulDataLoader) as
    `base_dataloader` and passes attributes through; accelerate_c's prepared loaders are that
    DataLoader themselves (subclasses of it), so `base_dataloader` is the loader. prepare() makes
    them; a bare DataLoaderAdapter is refused (it would be no loader here)."""

    def __new__(cls, *args, **kwargs):
        if cls is DataLoaderAdapter:
            raise TypeError("DataLoaderAdapter is the base of the loaders Accelerator.prepare() returns; prepare a "
                            "torch DataLoader (or use DataLoaderShard / DataLoaderDispatcher) instead")
        return super().__new__(cls)

    @property
    def base_dataloader(self):
        """The DataLoader (StatefulDataLoader with use_stateful_dataloader) that iterates: this one."""
        return self


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


class EpochResume:
    """What DataLoaderShard and DataLoaderDispatcher share: the start of an epoch (RNG
    synchronisation, the replay of a resumed epoch's RNG states, the iterator), the position
    save_state records, and the snapshots of a stateful loader's state.

    Exact resume (docs/checkpoints.md, "Resuming mid-epoch"):
    _epoch_start: the RNG states as they were when the iterator of the epoch under way was
      created (epoch_rng_states), None when no epoch is under way; save_state records it.
    _resume: set by load_state (resume_from): the next epoch is the resumed one; holds the
      checkpoint's record of its start to replay (when taken mid-epoch) and its position.
    _parent / _stand_in / _skipped: a loader skip_first_batches made from one with a pending
      resume iterates the rest of that loader's epoch for it (see there); a stateful loader's
      `_skipped` is the batches its restored state goes past."""

    use_stateful_dataloader = False

    def _init_epochs(self, iteration: int):
        self.iteration = iteration
        self.batches_seen = 0
        self._epoch_start = None
        self._resume = None
        self._parent = None
        self._stand_in = None
        self._skipped = 0

    def _take_state(self):
        """A stateful loader's state as it is now (stateful_loader.py); others have none."""
        return None

    def _set_state(self, state):
        """A stateful loader's state_dict() from now on is `state` (stateful_loader.py)."""

    def _catch_up(self, it) -> None:
        """A stateful loader's replay of a loaded state (stateful_loader.py); others have none."""

    def _open_epoch(self, first_fetch):
        """Starts an epoch on every process and fetches its first item with first_fetch(iterator):
        returns (iterator, first item), or None when the epoch has nothing (the epoch closed)."""
        resume, self._resume = self._resume, None
        replay = resume.get("epoch_start") if resume is not None else None
        # the process-wide RNG states load_state restored: taken before the broadcast below,
        # which would give every rank rank 0's torch state when rng_types holds "torch"
        now = rng_state(cuda=False) if replay is not None else None
        if self.rng_types:  # a collective: every rank calls it at every epoch start, replay or not
            synchronize_rng_states(self.rng_types, self.synchronized_generator)
        self.begin()
        self.set_epoch(self.iteration)
        self.batches_seen = 0  # batches handed out this epoch: save_state records it for resume
        if self.use_stateful_dataloader:  # its restored state, if any, skips what the epoch had handed out
            mid = resume is not None and resume["position"]["mid_epoch"]
            self._skipped = resume["position"]["batches_seen"] if mid else 0
        self._stand_in = None  # this loader's own epoch: no other loader iterates it for it now
        if self._parent is not None:
            self._parent._stand_in = self
        try:
            if replay is not None:
                # Resumed mid-epoch: creating the iterator draws from the RNGs (the base seed of
                # torch's iterator, and a RandomSampler without a generator of its own seeds its
                # order from the global RNG; one with a generator draws from that). Re-creating it
                # under the states the interrupted epoch's iterator was created with gives that
                # epoch's order again and leaves the generators where the uninterrupted run had
                # them; the process-wide RNGs are then put back to the checkpoint's (finally, below),
                # so dropout and the rest of the loop draw exactly what they drew before.
                set_epoch_rng_states(self, replay)
                self._epoch_start = replay
            else:
                self._epoch_start = epoch_rng_states(self)
            it = super().__iter__()
            self._catch_up(it)  # (under dispatch only the main process has a state, so a replay)
            # the first batch too: a sampler draws its order when first asked for an index
            # (with workers already while the iterator is created)
            first = first_fetch(it)
        except StopIteration:
            self._epoch_over(completed=False)
            self.end()
            return None
        finally:
            if now is not None:
                set_rng_state(now, "the random states load_state restored")
        return it, first

    def _epoch_over(self, completed: bool):
        self._epoch_start = None
        parent = self._parent
        if parent is not None:
            if completed:  # the parent's epoch is done: its next one is the next epoch
                parent.iteration = self.iteration
            if parent._stand_in is self:
                parent._stand_in = None

    def resume_position(self) -> dict:
        """Where this loader stands, for save_state: ``iteration`` (the epoch under way, or the
        next one when none is), ``batches_seen`` (that epoch's batches already handed out),
        ``mid_epoch``, and ``epoch_start`` (this process's RNG states as they were when that
        epoch's iterator was created; None unless mid-epoch). While a loader made from this one
        by skip_first_batches after load_state iterates the rest of the epoch, its position is
        this loader's. Once the last batch of an epoch is out, a checkpoint is at the start of
        the next epoch: nothing is left to replay, and the next epoch's iterator is then created
        from the RNG states saved, exactly as in the uninterrupted run."""
        src = self._stand_in if self._stand_in is not None else self
        if src._resume is not None:  # loaded, the resumed epoch not begun: the checkpoint's position
            return dict(src._resume["position"], iteration=int(src.iteration))
        if src._epoch_start is None:
            return {"iteration": int(self.iteration), "batches_seen": 0, "mid_epoch": False, "epoch_start": None}
        if src.end_of_dataloader:
            return {"iteration": int(src.iteration) + 1, "batches_seen": 0, "mid_epoch": False, "epoch_start": None}
        return {"iteration": int(src.iteration), "batches_seen": src._skipped + src.batches_seen, "mid_epoch": True,
                "epoch_start": src._epoch_start}

    def epoch_under_way(self) -> bool:
        """Whether one of this loader's epochs (or the epoch of the loader skip_first_batches made
        from it) is being iterated now, its last batch not yet out: load_state called inside the
        loop, where a saved position cannot move the iterator (checkpoint_load.py)."""
        src = self._stand_in if self._stand_in is not None else self
        return src._resume is None and src._epoch_start is not None and not src.end_of_dataloader

    def resume_from(self, epoch_start, mid_epoch: bool = False, batches_seen: int = 0):
        """load_state: the next epoch of this loader (or of the loader skip_first_batches makes
        from it) is the resumed one; when ``epoch_start`` is a record (resume_position's, this
        process's), that epoch's iterator is re-created under it. Until that epoch begins,
        resume_position says what the checkpoint said (a save right after a load loses nothing).
        Nothing while an epoch is under way (load_state inside the loop): the next epoch is the
        next one (checkpoint_load._loader_is_iterating)."""
        if self.epoch_under_way():
            return
        self._resume = {"epoch_start": epoch_start,
                        "position": {"batches_seen": int(batches_seen), "mid_epoch": bool(mid_epoch),
                                     "epoch_start": epoch_start}}


class DataLoaderShard(DataLoaderAdapter, DataLoaderStateMixin, EpochResume, DataLoader):
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
        self._init_epochs(iteration)
        self.reset()

    def __iter__(self):
        opened = self._open_epoch(next)
        if opened is None:
            return
        it, current = opened
        index = 0
        while True:
            if self.device is not None:
                current = send_to_device(current, self.device, non_blocking=self._non_blocking)
            # a stateful loader's state with `current` taken (what a save during its step resumes after)
            self._set_state(self._take_state())
            try:
                nxt = next(it)
            except StopIteration:
                self.end_of_dataloader = True
                self._set_state(self._take_state())
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
        self._epoch_over(completed=True)
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


class DataLoaderDispatcher(DataLoaderAdapter, DataLoaderStateMixin, EpochResume, DataLoader):
    """A DataLoader that only the main process iterates: each step it takes one loader batch
    (split_batches) or one per process, concatenated, sends that global batch to every process
    (batch_dispatch.BatchChannel: over shared memory on one host) and each process keeps its
    slice. accelerate's DataLoaderDispatcher, step for step: without drop_last, a last global
    batch the processes cannot share equally is completed with the first samples of the epoch's
    first global batch, and the last step's GradientState.remainder is the size of that last
    global batch (gather_for_metrics drops the completion). even_batches plays no part, as in
    accelerate. Every process creates the loader's iterator (its RNG draws are the same on
    every process), only the main one takes batches from it."""

    def __init__(self, dataset, split_batches: bool = False, skip_batches: int = 0, _drop_last: bool = False,
                 _non_blocking: bool = False, slice_fn=None, iteration: int = 0, device=None, **kwargs):
        super().__init__(dataset, **kwargs)
        self.split_batches = split_batches
        self.skip_batches = skip_batches
        self.gradient_state = GradientState()
        self.state = PartialState()
        self.device = device if device is not None else self.state.device
        self._drop_last = _drop_last
        self._non_blocking = _non_blocking
        self.slice_fn = slice_batch if slice_fn is None else slice_fn
        self.rng_types = None
        self.synchronized_generator = None
        self._init_epochs(iteration)
        self.reset()

    def begin(self):
        # accelerate's dispatcher knows its remainder only at the last batch (-1 until then)
        self.reset()
        self.gradient_state._add_dataloader(self)

    def _fetch(self, it, channel):
        """One global batch on every process: (batch, whether the data ended while it was taken,
        the stateful loader's state after it), batch None when nothing was left. Only the main
        process reads `it`; the others get the batch and the flag from it."""
        if channel is not None and self.state.process_index != 0:
            batch, ended = channel.recv()
            return batch, bool(ended), None
        batches, ended = [], False
        for _ in range(1 if self.split_batches else self.state.num_processes):
            try:
                batches.append(next(it))
            except StopIteration:
                ended = True
                break
        if ended and self._drop_last:
            batches = []  # with drop_last a short group of loader batches is dropped, as accelerate does
        state = self._take_state()
        batch = concatenate(batches) if batches else None
        if batch is not None:
            batch = send_to_device(batch, self.device, non_blocking=self._non_blocking)
        if channel is not None:
            channel.send(batch, int(ended))
        return batch, ended, state

    def __iter__(self):
        channel = BatchChannel(src=0, device=self.device) if self.state.num_processes > 1 else None
        opened = self._open_epoch(lambda it: self._fetch(it, channel))
        if opened is None:
            return
        it, (batch, ended, state) = opened
        if batch is None:  # nothing to dispatch (accelerate raises ValueError here; the epoch is just empty)
            self._epoch_over(completed=False)
            self.end()
            return
        n, rank = self.state.num_processes, self.state.process_index
        first_rows = None
        index = 0
        while batch is not None:
            if not self._drop_last and first_rows is None:
                # the epoch's first samples: what completes a last batch the processes cannot share
                first_rows = self.slice_fn(batch, slice(0, n), process_index=rank, num_processes=n)
            observed = batch_size_of(batch)
            if observed is None:
                raise TypeError("dispatch_batches: a batch holds no tensor to find its size from")
            per = observed // n
            nxt = (None, True, None)
            if not ended:  # read one global batch ahead, to know whether this one is the last
                nxt = self._fetch(it, channel)
                if nxt[0] is None:
                    state = nxt[2]  # the loader's state once it has run out
            last = ended or nxt[0] is None
            if last and not self._drop_last and observed % n:
                batch = concatenate([batch, first_rows])
                per += 1
            mine = self.slice_fn(batch, slice(rank * per, (rank + 1) * per), process_index=rank, num_processes=n)
            if last:
                self.end_of_dataloader = True
                self.remainder = observed
            self._set_state(state)
            if index >= self.skip_batches:
                self.batches_seen += 1
                yield mine
            index += 1
            batch, ended, state = nxt
        self.iteration += 1
        self._epoch_over(completed=True)
        self.end()

    def set_epoch(self, epoch: int):
        if self.iteration != epoch:
            self.iteration = epoch
        sampler = getattr(self.batch_sampler, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        elif hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self):
        whole = super().__len__()
        n = self.state.num_processes
        if self.split_batches:
            return whole
        return whole // n if self._drop_last else -(-whole // n)

    @property
    def total_batch_size(self):
        bs = self.batch_size if self.batch_size is not None else getattr(self.batch_sampler, "batch_size", None)
        if bs is None:
            return None
        return bs if self.split_batches else bs * self.state.num_processes

    @property
    def total_dataset_length(self):
        return len(self.dataset)

    def get_sampler(self):
        return get_sampler(self)

    def set_sampler(self, sampler):
        if isinstance(self.sampler, BatchSampler):
            self.sampler.sampler = sampler
        else:
            self.batch_sampler.sampler = sampler


def _epoch_generators(loader) -> dict:
    """The generators of its own that creating a loader's iterator may draw from, by role (one
    object may hold several): its sampler's, the DataLoader's `generator=` (the base seed, and
    torch's own RandomSampler for shuffle=True), the one kept in step across processes. CPU
    generators only."""
    found = {"sampler": getattr(get_sampler(loader), "generator", None), "loader": getattr(loader, "generator", None),
             "synchronized": getattr(loader, "synchronized_generator", None)}
    return {role: g for role, g in found.items() if isinstance(g, torch.Generator) and g.device.type == "cpu"}


def epoch_rng_states(loader) -> dict:
    """What creating `loader`'s iterator may draw from, as it is now: the process-wide RNGs
    (python, numpy, torch's CPU generator; in rng_state's format) and the loader's generators."""
    return {"rng": rng_state(cuda=False),
            "generators": {role: g.get_state() for role, g in _epoch_generators(loader).items()}}


def set_epoch_rng_states(loader, record: dict) -> None:
    """Puts back what epoch_rng_states recorded (into the loader's generators that exist)."""
    set_rng_state(record["rng"], "a data loader's epoch-start random states")
    for role, g in _epoch_generators(loader).items():
        if role in record["generators"]:
            g.set_state(record["generators"][role])


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
    """Wraps a DataLoader for this process (one process: the same batches, placed on device).

    dispatch_batches: the main process iterates `dataloader` and sends every process its slice
    (DataLoaderDispatcher); None means "when batches are placed on a device and the dataset is
    iterable", as in accelerate. use_stateful_dataloader: torchdata's StatefulDataLoader
    underneath (stateful_loader.py)."""
    if dispatch_batches is None:
        dispatch_batches = bool(put_on_device) and isinstance(dataloader.dataset, IterableDataset)
    if dispatch_batches and not put_on_device:
        raise ValueError("dispatch_batches=True needs put_on_device=True (the main process sends each batch to "
                         "the other processes' devices)")
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
    if dispatch_batches:
        return _dispatcher(dataloader, device, split_batches, slice_fn_for_dispatch, non_blocking,
                           use_stateful_dataloader, sampler if use_seedable_sampler else None)
    if num_processes > 1:
        if not split_batches and _streaming_shards(dataset) >= num_processes:
            # a Hugging Face streaming dataset with a shard (file) per process at least: each
            # process streams its own shards, as accelerate does (no read-and-discard)
            dataset = dataset.shard(num_shards=num_processes, index=process_index)
        elif isinstance(dataset, IterableDataset):
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
    cls = DataLoaderShard
    if use_stateful_dataloader:
        cls = stateful_variant(DataLoaderShard)
        kwargs = _stateful_kwargs(kwargs, cls)
    if isinstance(dataset, IterableDataset):
        bs = dataloader.batch_size
        if split_batches and num_processes > 1 and bs is not None:
            bs = bs // num_processes
        new = cls(dataset, batch_size=bs, drop_last=dataloader.drop_last, **common, **kwargs)
    elif is_batch_sampler:
        new = cls(dataset, sampler=batch_sampler, batch_size=dataloader.batch_size, **common, **kwargs)
    elif batch_sampler is None:  # batch_size=None: samples are yielded unbatched
        new = cls(dataset, sampler=dataloader.sampler, batch_size=None, **common, **kwargs)
    else:
        new = cls(dataset, batch_sampler=batch_sampler, **common, **kwargs)
    if isinstance(sampler, SeedableRandomSampler):
        new.set_sampler(sampler)
    return new


def _streaming_shards(dataset) -> int:
    """A datasets.IterableDataset's number of shards; 0 for anything else. (datasets is only
    looked up when already imported: an object of it cannot exist otherwise.)"""
    hf = sys.modules.get("datasets")
    kind = getattr(hf, "IterableDataset", None)
    return int(dataset.n_shards) if kind is not None and isinstance(dataset, kind) else 0


def _stateful_kwargs(kwargs: dict, cls) -> dict:
    """DataLoader arguments an older StatefulDataLoader lacks (in_order before torchdata 0.11)
    are dropped at their default values; given otherwise, refused by name."""
    accepted = inspect.signature(cls._stateful_base.__init__).parameters
    out = {}
    for k, v in kwargs.items():
        if k in accepted:
            out[k] = v
        elif v is not _DL_DEFAULTS.get(k) and v != _DL_DEFAULTS.get(k):
            raise ValueError(f"use_stateful_dataloader=True: the installed torchdata's StatefulDataLoader has no "
                             f"{k}= argument, and the DataLoader sets it to {v!r}")
    return out


def _dispatcher(dataloader, device, split_batches, slice_fn, non_blocking, use_stateful, seedable):
    """The DataLoaderDispatcher over the user's own sampling: only the main process reads it."""
    kwargs = _dataloader_kwargs(dataloader)
    kwargs.pop("generator", None)  # as accelerate: the dispatcher's loader draws its base seed from the global RNG
    cls = DataLoaderDispatcher
    if use_stateful:
        cls = stateful_variant(DataLoaderDispatcher)
        kwargs = _stateful_kwargs(kwargs, cls)
    dataset = dataloader.dataset
    common = dict(split_batches=split_batches, _drop_last=dataloader.drop_last, _non_blocking=non_blocking,
                  slice_fn=slice_fn, device=device)
    if isinstance(dataset, IterableDataset):
        new = cls(dataset, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last, **common, **kwargs)
    elif isinstance(dataloader.sampler, BatchSampler):
        new = cls(dataset, sampler=dataloader.sampler, batch_size=dataloader.batch_size, **common, **kwargs)
    elif dataloader.batch_sampler is None:
        new = cls(dataset, sampler=dataloader.sampler, batch_size=None, **common, **kwargs)
    else:
        new = cls(dataset, batch_sampler=dataloader.batch_sampler, **common, **kwargs)
    if isinstance(seedable, SeedableRandomSampler):
        new.set_sampler(seedable)
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
    if isinstance(dataloader, DataLoaderDispatcher):
        # as accelerate: over a map-style dataset the main process's batch sampler skips
        # `num_batches` of the loader's own batches (a step takes one per process without
        # split_batches); over an iterable one the first `num_batches` steps are skipped
        cls = type(dataloader)
        extra = dict(skip_batches=num_batches, batch_size=dataloader.batch_size, drop_last=dataloader.drop_last) \
            if new_bs is None else dict(batch_sampler=new_bs)
        if new_bs is not None and is_batch_sampler:
            extra = dict(sampler=new_bs, batch_size=dataloader.batch_size)
        kwargs.pop("generator", None)
        if dataloader.use_stateful_dataloader:
            kwargs = _stateful_kwargs(kwargs, cls)
        new = cls(dataset, split_batches=dataloader.split_batches, _drop_last=dataloader._drop_last,
                  iteration=dataloader.iteration, device=dataloader.device, **extra, **kwargs)
        per_step = 1 if dataloader.split_batches else dataloader.state.num_processes
        new._skipped = num_batches if new_bs is None else num_batches // per_step
        return _continue_resume(dataloader, new)
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
        if dataloader.use_stateful_dataloader:
            kwargs = _stateful_kwargs(kwargs, type(dataloader))
        new = type(dataloader)(dataset, device=dataloader.device, rng_types=dataloader.rng_types,
                               synchronized_generator=dataloader.synchronized_generator,
                               _drop_last=False, _non_blocking=dataloader._non_blocking,
                               iteration=dataloader.iteration, **extra, **kwargs)
        new._skipped = num_batches
        return _continue_resume(dataloader, new)
    if new_bs is None:
        return SkipDataLoader(dataset, skip_batches=num_batches, batch_size=dataloader.batch_size,
                              drop_last=dataloader.drop_last, **kwargs)
    return DataLoader(dataset, batch_sampler=new_bs, **kwargs)


def _continue_resume(dataloader, new):
    """After load_state, the loader skip_first_batches made is the rest of the resumed epoch. It
    replays the epoch's start in the parent's place, stands in for it in save_state while it
    runs, and hands the epoch count back when it is done (so the parent's next epoch is the next
    one, as in the uninterrupted run, where one loader ran every epoch). Without a pending
    resume it stays independent, as accelerate's."""
    if dataloader._resume is not None:
        new._resume, dataloader._resume = dataloader._resume, None
        new._parent, dataloader._stand_in = dataloader, new
    return new


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


def __getattr__(name):
    # the stateful variants (stateful_loader.py) live under this module's name, made on first
    # use: unpickling one in a fresh process finds it here
    bases = {"StatefulDataLoaderShard": DataLoaderShard, "StatefulDataLoaderDispatcher": DataLoaderDispatcher}
    if name in bases:
        return stateful_variant(bases[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
