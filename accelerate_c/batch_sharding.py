"""How a data loader's batches are divided between processes (accelerate's rules).

Without split_batches, process i takes global batches i, i+N, i+2N, ... With even_batches
(the default) and drop_last False, the global sequence is completed to a multiple of N full
batches with samples from the start of the data, so every process sees as many full batches
(gather_for_metrics later drops the duplicates). With split_batches, every global batch is
cut into N equal slices, one per process.
"""
from __future__ import annotations

from torch.utils.data import BatchSampler, IterableDataset


def check_split_batches(batch_size, num_processes: int):
    """split_batches cuts every batch into num_processes equal slices."""
    if batch_size is not None and batch_size > 1 and batch_size % num_processes != 0:
        raise ValueError(f"To use split_batches, the batch size ({batch_size}) must be a multiple of the number of "
                         f"processes ({num_processes}).")


class BatchSamplerShard(BatchSampler):
    """This process's batches of a batch sampler."""

    def __init__(self, batch_sampler, num_processes: int = 1, process_index: int = 0, split_batches: bool = False,
                 even_batches: bool = True):
        bs = getattr(batch_sampler, "batch_size", None)
        if split_batches:
            check_split_batches(bs, num_processes)
        self.batch_sampler = batch_sampler
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches
        self.even_batches = even_batches
        self.batch_size = bs
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        if self.batch_size is None and self.even_batches:
            raise ValueError("even_batches needs a batch sampler with a batch_size; pass even_batches=False")

    @property
    def sampler(self):
        return getattr(self.batch_sampler, "sampler", None)

    @sampler.setter
    def sampler(self, value):
        self.batch_sampler.sampler = value

    @property
    def total_length(self):
        return len(self.batch_sampler)

    def set_epoch(self, epoch: int):
        for obj in (self.batch_sampler, self.sampler):
            if obj is not None and hasattr(obj, "set_epoch"):
                obj.set_epoch(epoch)
                return

    def __len__(self):
        n, total = self.num_processes, len(self.batch_sampler)
        if self.split_batches:
            return total
        if total % n == 0:
            return total // n
        if self.drop_last:
            return total // n
        return total // n + 1 if self.even_batches or self.process_index < total % n else total // n

    def __iter__(self):
        return self._split() if self.split_batches else self._interleave()

    def _split(self):
        b = self.batch_size // self.num_processes
        lo, hi = b * self.process_index, b * (self.process_index + 1)
        first, batch = None, []
        for batch in self.batch_sampler:
            if first is None:
                first = list(batch)
            if len(batch) == self.batch_size:
                yield batch[lo:hi]
        if self.drop_last or first is None or len(batch) == self.batch_size:
            return
        if not self.even_batches:  # the short last batch: slices of the usual size, some empty
            if len(batch) > lo:
                yield batch[lo:hi]
            return
        while len(first) < self.batch_size:  # fewer samples than one batch in the whole dataset
            first += first
        yield (list(batch) + first)[lo:hi]

    def _interleave(self):
        n, me = self.num_processes, self.process_index
        head: list = []  # indices of the first N batches, to complete the end from
        mine = None
        idx, batch = -1, []
        for idx, batch in enumerate(self.batch_sampler):
            if idx < n:
                head += list(batch)
            if idx % n == me:
                mine = batch
            full = self.batch_size is None or len(batch) == self.batch_size
            if idx % n == n - 1 and full:  # a complete round: everyone yields
                yield mine
                mine = None
        if idx < 0 or self.drop_last:
            return  # nothing, or the incomplete last round is dropped
        last_full = self.batch_size is None or len(batch) == self.batch_size
        if idx % n == n - 1 and last_full:
            return  # ended on a complete round
        if not self.even_batches:
            if mine is not None:
                yield mine
            return
        # complete the round: the short last batch first, then whole batches, from `head`
        if mine is not None and (self.batch_size is None or len(mine) == self.batch_size) and \
                (idx % n != me or last_full):
            yield mine
        while len(head) < n * self.batch_size:
            head += head
        pos = 0
        pending = [] if last_full else list(batch)
        slot = idx + 1 if last_full else idx
        while slot % n != 0 or pending:
            take = self.batch_size - len(pending)
            pending += head[pos:pos + take]
            pos += take
            if slot % n == me:
                yield pending
            pending = []
            slot += 1


class IterableDatasetShard(IterableDataset):
    """This process's share of an iterable dataset: items are read in rounds of N x batch_size
    (batch_size with split_batches) and each process takes its slice of every round; the last
    round is completed with the first items unless drop_last."""

    def __init__(self, dataset, batch_size: int = 1, drop_last: bool = False, num_processes: int = 1,
                 process_index: int = 0, split_batches: bool = False):
        if split_batches:
            check_split_batches(batch_size, num_processes)
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_processes = num_processes
        self.process_index = process_index
        self.split_batches = split_batches

    def set_epoch(self, epoch: int):
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self):
        round_size = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        n = len(self.dataset)
        rounds = n // round_size if self.drop_last else -(-n // round_size)
        return rounds * (round_size // self.num_processes)

    def __iter__(self):
        per = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        round_size = per * self.num_processes
        lo, hi = self.process_index * per, (self.process_index + 1) * per
        first, buf = None, []
        for item in self.dataset:
            buf.append(item)
            if len(buf) == round_size:
                yield from buf[lo:hi]
                if first is None:
                    first = list(buf)
                buf = []
        if self.drop_last or not buf:
            return
        if first is None:
            first = list(buf)
        while len(buf) < round_size:
            buf += first[: round_size - len(buf)]
            first = first + first if len(first) < round_size else first
        yield from buf[lo:hi]
