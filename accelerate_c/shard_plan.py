"""Shard plans for a list of tensors: one `_C.ShardPlan` per (dtype, device) group, and the
views a sharding strategy works through.

The layout rules are the C plan's (csrc/include/ac/shard.h): the full buffer is bucket-major,
so bucket b's reduce-scatter and all-gather are one contiguous collective each
(`bucket_views`), and each rank's shard is one tensor holding its chunk of every bucket, of
which each parameter's owned part is one contiguous run (`owned_views`). This module makes no
collective call and touches no torch.distributed state: the strategies do that.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from ._C import ShardPlan

DDP_FIRST_CAP = 1 << 20  # torch DDP's first bucket (bytes)
DDP_CAP = 25 << 20  # its bucket_cap_mb=25


def plan_spec(plan: ShardPlan) -> dict:
    """The keyword arguments that rebuild `plan` (`ShardPlan(**spec)`): what a sharded
    checkpoint stores so that another world size can compute its reshard runs."""
    return {"numel": list(plan.numel), "esize": plan.esize, "world": plan.world, "order": list(plan.order),
            "align": plan.align, "first_cap_bytes": plan.first_cap_bytes, "cap_bytes": plan.cap_bytes}


class OwnedPart(NamedTuple):
    """The part of one parameter a rank owns: flattened elements [param_offset, param_offset +
    view.numel()) of the parameter are `view`, a 1-D view of the rank's shard."""
    param_offset: int
    view: torch.Tensor


class ShardGroup:
    """The tensors of one dtype and device (`indices` into the list `ShardLayout.from_params`
    got, in plan parameter order), their plan, and rank `rank`'s shard: a zeroed tensor of
    `plan.shard_numel` elements whose padding nothing writes (made when first asked for: a
    strategy that keeps its own shards, fp32 masters say, never pays for it)."""

    def __init__(self, tensors: Sequence[torch.Tensor], indices: Sequence[int], plan: ShardPlan, rank: int):
        if not 0 <= rank < plan.world:
            raise ValueError(f"rank {rank} is not in 0..{plan.world - 1}")
        self.indices = list(indices)
        self.shapes = [t.shape for t in tensors]
        self.dtype = tensors[0].dtype
        self.device = tensors[0].device
        self.plan = plan
        self.rank = rank
        self._shard = None
        self._owned = None
        # per bucket (start in the full buffer, chunk, start in the shard, ...): the plan's,
        # read once (a step walks them every time)
        self.buckets = tuple(plan.buckets())

    @property
    def shard(self) -> torch.Tensor:
        if self._shard is None:
            self._shard = torch.zeros(self.plan.shard_numel, dtype=self.dtype, device=self.device)
        return self._shard

    @property
    def owned(self) -> list:
        if self._owned is None:
            self._owned = self.owned_views(self.shard)
        return self._owned

    def runs(self) -> list[tuple[int, int, int]]:
        """Per parameter, what this rank owns of it: (offset in the shard, offset in the
        parameter's flattened elements, length; 0 when it owns none)."""
        return [self.plan.param_shard(i, self.rank) for i in range(self.plan.nparams)]

    def owned_views(self, shard: torch.Tensor) -> list[Optional[OwnedPart]]:
        """Per parameter, its owned part as a view of `shard` (this rank's shard, or any 1-D tensor
        of the same length: fp32 master weights, optimizer state); None where the rank owns none."""
        if shard.dim() != 1 or shard.numel() != self.plan.shard_numel:
            raise ValueError(f"shard must be 1-D with {self.plan.shard_numel} elements, got shape {tuple(shard.shape)}")
        out = []
        for i in range(self.plan.nparams):
            local, offset, length = self.plan.param_shard(i, self.rank)
            out.append(OwnedPart(offset, shard[local:local + length]) if length else None)
        return out

    def param_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its range of a full buffer (`plan.total` elements, e.g. the all-gathered
        parameters or the gradients to reduce-scatter), shaped like the parameter."""
        if full.dim() != 1 or full.numel() != self.plan.total:
            raise ValueError(f"full must be 1-D with {self.plan.total} elements, got shape {tuple(full.shape)}")
        return [full[off:off + n].view(shape) for (_, off, n), shape in zip(self.plan.params(), self.shapes)]

    def bucket_views(self, shard: torch.Tensor, full: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per bucket, (this rank's chunk of `shard`, the bucket's range of `full`): the output and
        input of its reduce-scatter, the input and output of its all-gather (torch.distributed's
        reduce_scatter_single / all_gather_single, before torch 2.13 reduce_scatter_tensor /
        all_gather_into_tensor)."""
        world = self.plan.world
        return [(shard[local:local + chunk], full[start:start + world * chunk])
                for start, chunk, local, _, _ in self.buckets]

    def load_shard(self, tensors: Sequence[torch.Tensor], shard: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Copies this rank's owned part of each full-size tensor (in plan parameter order) into
        `shard` (default: self.shard), e.g. master weights from the parameters."""
        shard = self.shard if shard is None else shard
        for part, t in zip(self.owned_views(shard), tensors):
            if part is not None:
                part.view.copy_(t.detach().reshape(-1)[part.param_offset:part.param_offset + part.view.numel()])
        return shard


class ShardLayout:
    """Shard groups of a list of tensors: one per (dtype, device), in the order each first appears."""

    def __init__(self, groups: list[ShardGroup]):
        self.groups = groups

    @classmethod
    def from_params(cls, params: Sequence[torch.Tensor], world: int, rank: int, align: int = 1,
                    first_cap_bytes: int = DDP_FIRST_CAP, cap_bytes: int = DDP_CAP,
                    order: Optional[Sequence[int]] = None, align_bytes: Optional[int] = None) -> "ShardLayout":
        """`order` is a permutation of range(len(params)), the placement order each group takes its
        members in; by default each group places its members in reverse (about backward's order).
        `align` is in elements; `align_bytes`, when given, instead sets each group's alignment in
        bytes (so groups of different dtypes all start their parameters on, say, a cache line)."""
        params = list(params)
        keys: dict = {}
        for j, p in enumerate(params):
            keys.setdefault((p.dtype, p.device), []).append(j)
        if order is not None:
            order = list(order)
            if sorted(order) != list(range(len(params))):
                raise ValueError(f"order must be a permutation of range({len(params)})")
        groups = []
        for members in keys.values():
            local = {j: k for k, j in enumerate(members)}
            placed = None if order is None else [local[j] for j in order if j in local]
            group_params = [params[j] for j in members]
            esize = group_params[0].element_size()
            plan = ShardPlan([p.numel() for p in group_params], esize, world, order=placed,
                             align=max(1, align_bytes // esize) if align_bytes else align,
                             first_cap_bytes=first_cap_bytes, cap_bytes=cap_bytes)
            groups.append(ShardGroup(group_params, members, plan, rank))
        return cls(groups)

    def __iter__(self):
        return iter(self.groups)

    def __len__(self):
        return len(self.groups)
