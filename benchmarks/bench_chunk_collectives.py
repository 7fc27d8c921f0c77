"""The chunked collectives the ZeRO strategies run on CPU processes (accelerate_c.collectives
gather_chunks / reduce_chunks) beside gloo's own all-gather and reduce-scatter and its all-reduce,
on the same buckets, 2 / 3 / 4 processes: why gather_chunks is built from broadcasts and
reduce_chunks from reduces (or, on 2 processes, an all-reduce).

    .venv/bin/python benchmarks/bench_chunk_collectives.py                 # 2, 3, 4 processes
    .venv/bin/python benchmarks/bench_chunk_collectives.py --worlds 2 --buckets 4

Each variant moves --buckets buckets of --bucket-mb MiB (fp32), two in flight as the strategies
keep them, and is timed --repeats times (median of the slowest rank's time). The limit printed
beside: a memcpy of the same bytes in one process (the bytes each rank must at least touch).
Recorded (info, no target): gather_chunks / gloo all-gather and reduce_chunks / gloo
reduce-scatter, as speed-ups.
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

BENCH = "bench_chunk_collectives"


def worker(args) -> int:
    import torch
    import torch.distributed as dist

    from accelerate_c import collectives

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    n = (args.bucket_mb << 20) // 4 // world * world
    chunk = n // world
    buf = torch.ones(n * args.buckets)

    def timed(op):
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            inflight = []
            for b in range(args.buckets):
                if len(inflight) == 2:
                    inflight.pop(0).wait()
                inflight.append(op(buf[b * n:(b + 1) * n]))
            for w in inflight:
                w.wait()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        return statistics.median(times)

    out = torch.empty(chunk)
    res = {
        "gloo all_gather": timed(lambda f: collectives.all_gather_into_tensor(f, f[rank * chunk:(rank + 1) * chunk],
                                                                              async_op=True)),
        "gather_chunks": timed(lambda f: collectives.gather_chunks(f, rank, world, async_op=True)),
        "gloo reduce_scatter": timed(lambda f: collectives.reduce_scatter_tensor(out, f, async_op=True)),
        "gloo all_reduce": timed(lambda f: collectives.all_reduce(f, async_op=True)),
        "reduce_chunks": timed(lambda f: collectives.reduce_chunks(f, rank, world, async_op=True)),
    }
    dst = torch.empty_like(buf)
    copies = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        dst.copy_(buf)
        copies.append(time.perf_counter() - t0)
    mb = buf.numel() * 4 / 2**20
    if rank == 0:
        print(f"\n{world} processes, {args.buckets} buckets of {n * 4 / 2**20:.1f} MiB ({mb:.0f} MiB), "
              f"median of {args.repeats}:")
        for k, v in res.items():
            print(f"  {k:22s} {v * 1e3:8.1f} ms   {mb / 1024 / v:6.2f} GiB/s algbw")
        limit = f"memcpy of {mb:.0f} MiB: {statistics.median(copies) * 1e3:.1f} ms"
        print(f"  limit: {limit}")
        _targets.info(BENCH, f"gather_chunks vs gloo all_gather, {world} procs",
                      res["gloo all_gather"] / res["gather_chunks"], limit=limit)
        _targets.info(BENCH, f"reduce_chunks vs gloo reduce_scatter, {world} procs",
                      res["gloo reduce_scatter"] / res["reduce_chunks"], limit=limit)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="2,3,4")
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=25, help="bucket size in MiB (DDP's cap: 25)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rc = 0
    for w in [int(x) for x in args.worlds.split(",")]:
        rc |= launch_on(w, __file__, ["--buckets", args.buckets, "--bucket-mb", args.bucket_mb, "--repeats", args.repeats])
    return rc


if __name__ == "__main__":
    sys.exit(main())
