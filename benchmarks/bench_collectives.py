"""Shared-memory collectives (accelerate_c/shm.py, csrc/core/comm_shm.c) beside gloo, on the same
tensors in the same processes: all-reduce, reduce-scatter and all-gather of 64 KiB ... 256 MiB
(fp32) among 2 and 4 CPU processes.

    .venv/bin/python benchmarks/bench_collectives.py                    # 2 and 4 processes
    .venv/bin/python benchmarks/bench_collectives.py --worlds 2 --max-mb 32 --repeats 3

Per size: the median over --repeats samples (the slowest rank's) of the time per call, algbw =
bytes / time and busbw =
algbw x 2(n-1)/n for all-reduce, (n-1)/n for reduce-scatter and all-gather (the bytes each rank
must move, NCCL's convention). The limit printed beside: this machine's memcpy bandwidth at the same
size (bytes copied per second, a copy of `size` bytes), measured in the same run.
A sample is back-to-back calls after one barrier, divided by their number (as nccl-tests and
the OSU benchmarks time): INNER calls below 1 MiB, INNER_MID up to 32 MiB, one above. Timed one
call per barrier, a call's time would include how far apart the ranks left the barrier: tens of
microseconds on gloo's barrier with a core per process (most of a 64 KiB all-reduce over shared
memory), milliseconds with 4 processes on 2 cores (a third of a 32 MiB one). Both contenders are
timed the same way. The memcpy limit is timed by one process while the others wait.

The copy path's floor is printed beside it ("copies only"): every rank copies its tensor into a
window and back out in the slots' 2 MiB pieces, at once, with nothing else; no all-reduce of a private tensor through shared
memory can take less, so the busbw share it gives is the most the copy path can reach here (with
more ranks than cores it is below the 50% target: 4 ranks' copies share 2 cores).

The all-reduce is timed twice over shared memory: of a private tensor (copied into the segment
and out), and of a tensor living in a shared window (reduced in place: how the reducer's gradient
buffers go, "all_reduce win"), and the in-place all-gather of a window tensor's chunks (how ZeRO's
parameter buffers go, "all_gather win").

Targets (at 32 MiB; 64 KiB for latency): busbw >= 50% of the memcpy bandwidth at that
size, shm >= 4x gloo, 64 KiB all-reduce latency >= 20x better than gloo; accelerate_c's
accelerator.reduce of 8 MiB (accelerate_c.utils.reduce) >= 4x faster over shm than over gloo.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _targets  # noqa: E402
from _common import launch_on  # noqa: E402

BENCH = "bench_collectives"
KB = 1 << 10
INNER = 20  # back-to-back calls per timed sample below 1 MiB (see above)
INNER_MID = 5  # ... from 1 to 32 MiB
PIECE = 2 << 20  # bytes: the copy path's piece (half of a 4 MiB slot, csrc/core/comm_shm.c)


def inner_calls(nbytes: int) -> int:
    """Back-to-back calls per timed sample: INNER below 1 MiB, INNER_MID up to 32 MiB (a call of
    a few milliseconds is still within reach of the barrier's exit skew, which on 4 processes
    sharing 2 cores is milliseconds), one above."""
    return INNER if nbytes < (1 << 20) else INNER_MID if nbytes <= (32 << 20) else 1


def sizes(max_mb: int):
    s, out = 64 * KB, []
    while s <= max_mb << 20:
        out.append(s)
        s *= 8 if s < (1 << 20) else 2
    return out


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from accelerate_c.shm import ShmGroup

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shm = ShmGroup.create()

    def timed(fn, reps, inner=1):
        """Median over `reps` samples of the slowest rank's time per call, a sample being
        `inner` back-to-back calls after a barrier."""
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            t = torch.tensor([(time.perf_counter() - t0) / inner], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        return statistics.median(times)

    rows = []
    for nbytes in sizes(args.max_mb):
        n = nbytes // 4 // world * world
        reps = args.repeats if nbytes >= (1 << 20) else args.repeats * 10
        inner = inner_calls(nbytes)
        # zeros: hundreds of in-place all-reduce sums of ones would reach inf (2^128) on the way
        x = torch.zeros(n)
        out_rs = torch.empty(n // world)
        out_ag = torch.empty(n)
        part = torch.ones(n // world)
        win = shm.window_tensor(n, torch.float32)  # the reducer's gradient buffers live in one
        # what accelerate_c's all-reduce of a private tensor of 1-64 MiB does (collectives._staged):
        # copied into a scratch window, reduced there in place, copied back
        scratch = shm.window_tensor(n, torch.float32) if (1 << 20) <= nbytes <= (64 << 20) else None

        def staged():
            scratch.copy_(x)
            shm.all_reduce(scratch)
            x.copy_(scratch)

        piece = shm.window_tensor(PIECE // 4, torch.float32)
        bounds = [(o, min(o + PIECE // 4, n)) for o in range(0, n, PIECE // 4)]

        def copies_only():
            # the floor of any all-reduce of a private tensor through shared memory: every rank
            # copies its tensor in and the result back out, at once, with no reduction and no
            # waiting on the others (what the copy path cannot avoid, whatever its algorithm),
            # in pieces that stay in cache between the copy in and the copy out, as its slots do
            for a, b in bounds:
                piece[:b - a].copy_(x[a:b])
                x[a:b].copy_(piece[:b - a])

        res = {
            ("all_reduce", "floor"): timed(copies_only, reps, inner) if nbytes == 32 << 20 else float("nan"),
            ("all_reduce", "staged"): timed(staged, reps, inner) if scratch is not None else float("nan"),
            ("all_reduce", "gloo"): timed(lambda: dist.all_reduce(x), reps, inner),
            ("all_reduce", "shm"): timed(lambda: shm.all_reduce(x), reps, inner),
            ("all_reduce", "window"): timed(lambda: shm.all_reduce(win), reps, inner) if win is not None else float("nan"),
            ("reduce_scatter", "gloo"): timed(lambda: dist.reduce_scatter_tensor(out_rs, x), reps, inner),
            ("reduce_scatter", "shm"): timed(lambda: shm.reduce_scatter(out_rs, x), reps, inner),
            ("all_gather", "gloo"): timed(lambda: dist.all_gather_into_tensor(out_ag, part), reps, inner),
            ("all_gather", "shm"): timed(lambda: shm.all_gather(out_ag, part), reps, inner),
            # ZeRO's parameter buffers: this rank's chunk in place in a window, gathered there
            ("all_gather", "window"): timed(lambda: shm.all_gather(win, win[rank * (n // world):(rank + 1) * (n // world)]),
                                            reps, inner) if win is not None else float("nan"),
        }
        # the limit: one process copying alone (the others wait), its destination touched first
        dst = torch.empty_like(x)
        dist.barrier()
        copy = float("nan")
        if rank == 0:
            dst.copy_(x)
            copy = statistics.median([_copy_time(dst, x) for _ in range(reps)])
        dist.barrier()
        rows.append((nbytes, res, copy))
        del x, out_rs, out_ag, part, dst, win, scratch, piece
    if rank == 0:
        print(f"\n{world} processes (fp32, medians; busbw: NCCL's convention; memcpy: one process, same size)")
        print(f"{'size':>9} {'collective':>15} {'gloo ms':>9} {'shm ms':>9} {'shm/gloo':>9} {'shm busbw GB/s':>15} "
              f"{'memcpy GB/s':>12}  (in a window: rows of their own)")
        factor = {"all_reduce": 2 * (world - 1) / world, "reduce_scatter": (world - 1) / world,
                  "all_gather": (world - 1) / world}
        for nbytes, res, copy in rows:
            mem_bw = nbytes / copy / 1e9  # bytes copied per second, as memcpy bandwidth is quoted
            for coll, how in (("all_reduce", "shm"), ("all_reduce", "staged"), ("all_reduce", "window"),
                              ("reduce_scatter", "shm"), ("all_gather", "shm"), ("all_gather", "window")):
                g, s = res[(coll, "gloo")], res[(coll, how)]
                if s != s:  # NaN: not timed at this size
                    continue
                busbw = nbytes / s * factor[coll] / 1e9
                label = f"{nbytes // KB} KiB" if nbytes < (1 << 20) else f"{nbytes >> 20} MiB"
                name = coll if how == "shm" else f"{coll} {'win' if how == 'window' else how}"
                print(f"{label:>9} {name:>15} {g * 1e3:9.3f} {s * 1e3:9.3f} {g / s:9.1f} {busbw:15.2f} {mem_bw:12.2f}")
                if nbytes == 32 << 20:
                    floor = res[("all_reduce", "floor")]
                    limit = f"memcpy {mem_bw:.1f} GB/s at 32 MiB (one process)"
                    if coll == "all_reduce" and how == "shm" and floor == floor:
                        # the copy path's ceiling on this machine: its unavoidable copies alone
                        ceiling = nbytes / floor * factor[coll] / 1e9
                        limit += (f"; the copies in and out alone: {floor * 1e3:.2f} ms, at most {g / floor:.1f}x gloo "
                                  f"and {ceiling / mem_bw:.0%} of memcpy")
                        print(f"{'':>9} {'(copies only)':>15} {'':>9} {floor * 1e3:9.3f} {g / floor:9.1f} "
                              f"{ceiling:15.2f} {mem_bw:12.2f}  the copy path's floor: every rank's copy in and out at once")
                        _targets.info(BENCH, f"all_reduce copy path's ceiling (copies alone) share of memcpy, 32 MiB, "
                                      f"{world} procs", ceiling / mem_bw, unit="%", limit=limit)
                    what = coll if how == "shm" else f"{coll} in a window" if how == "window" else \
                        f"{coll} staged through a window"
                    if coll == "all_gather" or how == "staged":  # information: the targets are the all-reduce's
                        # (copy path and window); accelerate_c stages a private tensor only where a
                        # host has more ranks than cores (collectives._staged)
                        _targets.info(BENCH, f"{what} shm vs gloo, 32 MiB, {world} procs", g / s)
                        continue
                    _targets.target(BENCH, f"{what} shm vs gloo, 32 MiB, {world} procs", g / s, 4.0, limit=limit)
                    _targets.target(BENCH, f"{what} shm busbw share of memcpy, 32 MiB, {world} procs",
                                    busbw / mem_bw, 0.5, unit="%", limit=limit)
                if nbytes == 64 * KB and coll == "all_reduce" and how == "shm":
                    _targets.target(BENCH, f"all_reduce 64 KiB latency shm vs gloo, {world} procs", g / s, 20.0,
                                    limit=f"gloo {g * 1e6:.0f} us, shm {s * 1e6:.1f} us")
    # accelerator.reduce (accelerate_c.utils.reduce: a copy, the shape check, the all-reduce) of
    # 8 MiB, with the CPU collectives on gloo and then on shared memory
    from accelerate_c import collectives
    from accelerate_c.utils import reduce as ac_reduce

    x8 = torch.ones((8 << 20) // 4)
    reps = args.repeats * 4
    collectives.select_cpu_comm("gloo")
    t_gloo = timed(lambda: ac_reduce(x8), reps, inner_calls(x8.numel() * 4))
    collectives.select_cpu_comm("shm")
    t_shm = timed(lambda: ac_reduce(x8), reps, inner_calls(x8.numel() * 4))
    if rank == 0:
        print(f"accelerator.reduce of 8 MiB: gloo {t_gloo * 1e3:.2f} ms, shm {t_shm * 1e3:.2f} ms, "
              f"{t_gloo / t_shm:.1f}x")
        _targets.target(BENCH, f"accelerator.reduce 8 MiB shm vs gloo, {world} procs", t_gloo / t_shm, 4.0,
                        limit=f"gloo {t_gloo * 1e3:.1f} ms, shm {t_shm * 1e3:.2f} ms")
    collectives.select_cpu_comm("gloo")
    shm.close()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _copy_time(dst, src) -> float:
    t0 = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--max-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rc = 0
    for w in [int(x) for x in args.worlds.split(",")]:
        rc |= launch_on(w, __file__, ["--max-mb", args.max_mb, "--repeats", args.repeats])
    return rc


if __name__ == "__main__":
    sys.exit(main())
