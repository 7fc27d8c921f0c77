"""Shared-memory collectives for the processes of one host (csrc/core/comm_shm.c;
docs/collectives.md).

`ShmGroup.create(group)` joins every rank of a torch.distributed process group to one
`_C.ShmComm` when they all run on this host: the host is decided from what every rank reports
through the group (its host name and the kernel's boot id, or ACCELERATE_C_SHM_HOST_ID where a
test splits one machine into several "hosts"), not from LOCAL_WORLD_SIZE; the segment's name is
drawn by rank 0 and sent to the others through the group, so two jobs, or two groups of one job,
never share one. It is a collective of the group. The segment is unlinked as soon as every rank
has mapped it (nothing is left in /dev/shm whatever happens to the processes later).
"""
from __future__ import annotations

import datetime
import os
import secrets
import socket
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from ._C import ShmComm

ENV_HOST_ID = "ACCELERATE_C_SHM_HOST_ID"  # tests: pretend ranks are on different hosts
DEFAULT_SLOT_BYTES = 4 << 20
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)
_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min", dist.ReduceOp.AVG: "avg"}


def host_id() -> str:
    """What identifies this host to its peers: the override, else host name + boot id (two
    containers with one host name but separate kernels, or a reboot, differ)."""
    override = os.environ.get(ENV_HOST_ID)
    if override:
        return override
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def hosts_of(group=None) -> list:
    """Every rank's host_id(), in the group's rank order. A collective of `group`."""
    hosts = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, host_id(), group=group)
    return hosts


def _shm_free_bytes():
    """Free bytes in /dev/shm (None when it cannot be told)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _timeout_s(group) -> float:
    try:
        t = dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
    except Exception:  # noqa: BLE001 (torch's private helper moved): gloo's own default
        t = datetime.timedelta(minutes=30)
    return max(t.total_seconds(), 1.0)


class ShmGroup:
    """A `_C.ShmComm` over every rank of a process group on one host, with torch-shaped calls."""

    hierarchical = False  # several hosts joined by gloo (shm_hier.HierGroup)

    def __init__(self, comm: ShmComm, group, timeout_s: float):
        self.comm = comm
        self.group = group
        self.timeout_s = timeout_s
        self._warned_room = False

    @classmethod
    def create(cls, group=None, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: Optional[float] = None,
               hosts: Optional[list] = None):
        """The group's shared-memory communicator, or None when its ranks are not all on this
        host. A collective of `group`: every rank calls it. hosts: hosts_of(group), when the
        caller has it already."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if len(set(hosts_of(group) if hosts is None else hosts)) != 1:
            return None
        # rank 0 draws the name and checks that /dev/shm has room (a segment it could not make
        # would leave the others waiting for it until the timeout); all follow its answer
        plan = [None]
        if rank == 0:
            need, free = world * slot_bytes + (1 << 20), _shm_free_bytes()
            plan[0] = (f"/acshm-{os.getpid()}-{secrets.token_hex(8)}", need, free)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(plan, src=src, group=group)
        name, need, free = plan[0]
        if free is not None and free < need:
            warnings.warn(f"/dev/shm has {free >> 20} MiB free, the shared-memory collectives of {world} processes "
                          f"need {need >> 20} MiB: CPU collectives use gloo. Enlarge it (docker: --shm-size=1g; "
                          "mount -o remount,size=1G /dev/shm) to use them.", stacklevel=3)
            return None
        timeout_s = _timeout_s(group) if timeout_s is None else timeout_s
        return cls(ShmComm(name, world, rank, slot_bytes, timeout_s), group, timeout_s)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    @staticmethod
    def supports(t: torch.Tensor, op=None) -> bool:
        """Whether this tensor (and reduction op) can go through shared memory."""
        return t.device.type == "cpu" and t.dtype in _DTYPES and t.is_contiguous() and (op is None or op in _OPS) \
            and not (op == dist.ReduceOp.AVG and not t.dtype.is_floating_point)

    @staticmethod
    def _op(op, what):
        name = _OPS.get(op)
        if name is None:
            raise ValueError(f"shared-memory {what} does sum, max, min and avg, not {op}")
        return name

    def all_reduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        """In place; async_op: returns a work with wait() (a _C.ShmWork), else None."""
        return self.comm.all_reduce(t.detach(), self._op(op, "all_reduce"), None, async_op)

    def all_reduce_into(self, t: torch.Tensor, out: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """out = op over ranks of t (t untouched): t is copied into the segment and the result out
        of it, one pass, no copy of t made first."""
        self.comm.all_reduce(t.detach(), self._op(op, "all_reduce"), out.detach(), False)

    def reduce_scatter(self, out: torch.Tensor, t: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
        return self.comm.reduce_scatter(out.detach(), t.detach(), self._op(op, "reduce_scatter"), async_op)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, counts=None, async_op: bool = False):
        return self.comm.all_gather(out.detach(), t.detach(), counts, async_op)

    def broadcast(self, t: torch.Tensor, src: int, async_op: bool = False):
        return self.comm.broadcast(t.detach(), src, async_op)

    def window_tensor(self, numel: int, dtype: torch.dtype):
        """A zeroed 1-D tensor of `numel` elements living in a shared window (memory every rank
        maps), which all_reduce then reduces in place with no copy in or out; None, on every
        rank, where /dev/shm lacks the room (rank 0 decides, warning once). A collective of the
        group: every rank asks for the same windows in the same order."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.zeros(0, dtype=dtype)
        room = torch.ones(1, dtype=torch.int32)
        if self.rank == 0:
            free = _shm_free_bytes()
            # the segment, and as much again for the next one made while this one is alive (a
            # re-laid gradient buffer)
            room[0] = int(free is None or free >= 2 * self.size * nbytes + (1 << 20))
        self.comm.broadcast(room, 0)
        if not room[0]:
            if not self._warned_room:
                self._warned_room = True
                warnings.warn(f"/dev/shm has {(_shm_free_bytes() or 0) >> 20} MiB free, too little for a shared "
                              f"buffer (gradients, ZeRO's parameters or staging) of {self.size} x {nbytes >> 20} "
                              "MiB: its collectives go through copies instead (slower). Enlarge /dev/shm "
                              "(docker: --shm-size) to avoid it.",
                              stacklevel=3)
            return None
        return torch.frombuffer(self.comm.window(nbytes), dtype=dtype)

    def in_window(self, t: torch.Tensor) -> bool:
        """Whether t lies in a window of this group: its all_reduce then takes the window path
        (asked of the extension's own registry, the one all_reduce consults)."""
        return self.supports(t) and self.comm.in_window(t.detach())

    def window_ops(self) -> int:
        """Collectives of this group that took a window's zero-copy path so far."""
        return self.comm.window_ops()

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        self.comm.close()
