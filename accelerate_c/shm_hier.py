"""Collectives of a job whose processes span several hosts: shared memory within each host, gloo
between the hosts' leaders (docs/collectives.md, "Several hosts").

`HierGroup.create(hosts)` splits the default group by host: one shared-memory communicator per
host (shm.ShmGroup over a new_group of that host's ranks), one gloo group of the leaders (each
host's lowest rank) and one gloo group of every rank for the collectives that do not split by
host. An all-reduce is a reduction within the host (through its shared windows when the tensor
lives in one), the leaders' all-reduce over gloo, and a broadcast from the leader within the
host; a broadcast goes to the source's host, across the leaders, then out within each other host;
a reduce-scatter is that all-reduce of a copy, sliced; an all-gather (its output interleaves every
host's ranks) goes through gloo over every rank.

Every call runs on one worker thread per group, in call order (async_op returns at once with a
work to wait for). That keeps each host's communicator and the leaders' group seeing the same
sequence of calls on every rank, which the steps of several overlapping calls would otherwise
interleave differently from rank to rank (a rank that ran out of data under join shadows the
others' bucket all-reduces one by one while they launch all before waiting). The object has
ShmGroup's calls, so collectives.py routes to it as it does to one host's communicator.
"""
from __future__ import annotations

import collections
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from .shm import ShmGroup


class _FutureWork:
    """An asynchronous call's work: wait() returns once it ran (raising its error)."""

    def __init__(self, fut):
        self.fut = fut

    def wait(self, *args, **kwargs):
        self.fut.result()
        return True

    def is_completed(self) -> bool:
        return self.fut.done()


class HierGroup:
    """The default group as hosts: a ShmGroup per host and gloo groups of the leaders and of all."""

    hierarchical = True  # several hosts joined by gloo (shm_hier.HierGroup)

    def __init__(self, local: ShmGroup, leaders, everyone, is_leader: bool, host_of: list, local_ranks: list):
        self.local = local
        self.leaders = leaders
        self.everyone = everyone  # gloo over every rank, used only from the worker thread
        self.is_leader = is_leader
        self.host_of = host_of  # global rank -> index of its host
        self.local_ranks = local_ranks  # per host, its global ranks in order
        self.timeout_s = local.timeout_s
        self.size = dist.get_world_size()
        self.rank = dist.get_rank()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="accelerate_c-shm-hier")
        # the tensors of the latest gloo calls, kept so that a gloo worker's release of a finished
        # work is never the last reference to a Python tensor (collectives.py explains the abort
        # at interpreter exit that would cause)
        self._recent = collections.deque(maxlen=64)

    @classmethod
    def create(cls, hosts: list, timeout_s=None):
        """The hierarchy over the default group, or None when some host cannot make its shared-
        memory communicator (every rank agrees). A collective of the default group: every rank
        makes every subgroup, as torch asks."""
        rank = dist.get_rank()
        order = list(dict.fromkeys(hosts))  # hosts in the order of their lowest rank
        host_of = [order.index(h) for h in hosts]
        local_ranks = [[r for r, h in enumerate(host_of) if h == k] for k in range(len(order))]
        groups = [dist.new_group(ranks) for ranks in local_ranks]
        leaders = dist.new_group([ranks[0] for ranks in local_ranks])
        everyone = dist.new_group(list(range(len(hosts))))
        mine = host_of[rank]
        local = ShmGroup.create(groups[mine], timeout_s=timeout_s, hosts=[hosts[rank]] * len(local_ranks[mine]))
        ok = torch.tensor([int(local is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok[0]:
            if local is not None:
                local.close()
            return None
        return cls(local, leaders, everyone, local_ranks[mine][0] == rank, host_of, local_ranks)

    supports = staticmethod(ShmGroup.supports)

    def _run(self, fn, async_op: bool):
        fut = self._worker.submit(fn)
        if async_op:
            return _FutureWork(fut)
        fut.result()
        return None

    # ---- the steps (on the worker thread) --------------------------------------------------
    def _all_reduce(self, t, op):
        self.local.all_reduce(t, dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op)
        if self.is_leader:
            self._recent.append(t)
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op, group=self.leaders)
        self.local.broadcast(t, 0)
        if op == dist.ReduceOp.AVG:  # an average is the sum over every host, divided once
            t.div_(self.size)

    def _broadcast(self, t, src):
        home, mine = self.host_of[src], self.host_of[self.rank]
        if mine == home:
            self.local.broadcast(t, self.local_ranks[home].index(src))
        if self.is_leader:
            self._recent.append(t)
            dist.broadcast(t, src=self.local_ranks[home][0], group=self.leaders)
        if mine != home:
            self.local.broadcast(t, 0)

    def _all_gather(self, out, t, counts):
        counts = [t.numel()] * self.size if counts is None else list(counts)
        pad = max(counts)
        bufs = [torch.empty(pad, dtype=t.dtype) for _ in counts]
        src = torch.zeros(pad, dtype=t.dtype)
        src[:t.numel()] = t
        self._recent.append((src, bufs))
        dist.all_gather(bufs, src, group=self.everyone)
        for part, buf, c in zip(out.split(counts), bufs, counts):
            part.copy_(buf[:c])

    def _reduce_scatter(self, out, t, op):
        full = t.clone()  # out may alias t (an in-place reduce-scatter)
        self._recent.append(full)
        self._all_reduce(full, op)
        out.copy_(full[self.rank * out.numel():(self.rank + 1) * out.numel()])

    def _barrier(self):
        self.local.barrier()
        if self.is_leader:
            dist.barrier(group=self.leaders)
        self.local.barrier()

    # ---- ShmGroup's calls ------------------------------------------------------------------
    def all_reduce(self, t, op=dist.ReduceOp.SUM, async_op: bool = False):
        return self._run(lambda: self._all_reduce(t, op), async_op)

    def all_reduce_into(self, t, out, op=dist.ReduceOp.SUM) -> None:
        out.copy_(t)
        self.all_reduce(out, op)

    def broadcast(self, t, src: int, async_op: bool = False):
        """`src`: a rank of the default group."""
        return self._run(lambda: self._broadcast(t, src), async_op)

    def all_gather(self, out, t, counts=None, async_op: bool = False):
        return self._run(lambda: self._all_gather(out, t, counts), async_op)

    def reduce_scatter(self, out, t, op=dist.ReduceOp.SUM, async_op: bool = False):
        return self._run(lambda: self._reduce_scatter(out, t, op), async_op)

    def barrier(self) -> None:
        self._run(self._barrier, False)

    def window_tensor(self, numel: int, dtype):
        return self._worker.submit(lambda: self.local.window_tensor(numel, dtype)).result()

    def in_window(self, t) -> bool:
        return self.local.in_window(t)

    def window_ops(self) -> int:
        return self.local.window_ops()

    def close(self) -> None:
        self._worker.shutdown(wait=True)
        self.local.close()
