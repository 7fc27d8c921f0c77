"""Checkpoint I/O: accelerate_c's C safetensors engine against the safetensors package and
torch.save/torch.load, on ~400 MB of fp32 tensors of a few sizes, in one process.

    python benchmarks/bench_safetensors.py [--dir DIR] [--repeats 5] [--mb 400] [--threads 0]

Saves: every contender's file is fsynced (ours always fsyncs and renames a temp file into place;
for the others the benchmark calls os.fsync right after their save), so the timings compare the
same durability. The "plain write" rows are the physical limit measured in the same run: the same
bytes written with os.pwritev from one thread, then fsynced (and, separately, without fsync: the
page-cache write bandwidth). Loads read files that are in the page cache (each was just written;
ours is written with O_DIRECT, which bypasses the cache, so the value check before the load
tables reads it in, as the warm-up round would anyway); the limit is a plain readinto() of the whole file into freshly allocated memory (for
load_file) or into memory touched before (for loading into existing tensors, the way a model's
parameters are filled). safetensors' load_file maps the file and reads nothing until the
tensors are used, so its load_file row times no data movement; the "into existing tensors"
table is the like-for-like comparison. Contenders run
interleaved (A, B, C, A, B, C, ...); medians and quartiles of --repeats timed rounds after one
warm-up round. A claim is a ratio from one run, never an absolute time.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Contender, bytes_table, cpu_model, fsync_path, logical_cpus, run_interleaved  # noqa: E402
import _targets  # noqa: E402

import safetensors.torch as st_pkg  # noqa: E402

from accelerate_c.safetensors_io import load_file, load_into, save_file  # noqa: E402


def make_tensors(total_mb: int):
    """A model-like mix: a few big matrices, many mid-size ones, many small (biases, norms)."""
    gen = torch.Generator().manual_seed(0)
    total = total_mb * 10**6
    plan = [(0.50, 64 << 20), (0.33, 8 << 20), (0.16, 256 << 10), (0.01, 4 << 10)]
    out = {}
    for frac, nbytes in plan:
        for i in range(max(1, round(total * frac / nbytes))):
            out[f"t{nbytes}.{i}"] = torch.randn(nbytes // 4, generator=gen)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory for the files (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mb", type=int, default=400, help="total tensor bytes, in MB")
    ap.add_argument("--threads", type=int, default=0, help="threads for our engine (0 = choose)")
    args = ap.parse_args()

    tensors = make_tensors(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    work = tempfile.mkdtemp(prefix="bench_st_", dir=args.dir)
    p_ours, p_pkg, p_torch, p_plain = (os.path.join(work, n) for n in
                                       ("ours.safetensors", "pkg.safetensors", "torch.pt", "plain.bin"))
    views = [memoryview(t.numpy()).cast("B") for t in tensors.values()]
    print(f"bench_safetensors: {len(tensors)} fp32 tensors, {nbytes / 1e6:.0f} MB, dir {work}")
    print(f"cpu: {cpu_model()} ({logical_cpus()} logical), torch {torch.__version__}, "
          f"safetensors {__import__('safetensors').__version__}")

    def plain_write(sync):
        fd = os.open(p_plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            for i in range(0, len(views), 512):  # IOV_MAX-sized batches
                off += os.pwritev(fd, views[i:i + 512], off)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def pkg_save():
        st_pkg.save_file(tensors, p_pkg)
        fsync_path(p_pkg)

    def torch_save():
        with open(p_torch, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    saves = [
        Contender("plain pwritev + fsync (limit)", lambda: plain_write(True)),
        Contender("accelerate_c save_file (fsync)", lambda: save_file(tensors, p_ours, threads=args.threads)),
        Contender("safetensors save_file + fsync", pkg_save),
        Contender("torch.save + fsync", torch_save),
        Contender("plain pwritev, no fsync (page cache)", lambda: plain_write(False)),
    ]
    t_save = run_interleaved(saves, args.repeats)

    # every file is now written; the check below reads them all, so each is in the page cache
    # (our O_DIRECT save left its own out)
    def plain_read():
        buf = torch.empty(os.path.getsize(p_plain), dtype=torch.uint8)
        with open(p_plain, "rb", buffering=0) as f:
            f.readinto(memoryview(buf.numpy()))
        return buf

    loads = [
        Contender("plain readinto (limit)", plain_read),
        Contender("accelerate_c load_file", lambda: load_file(p_ours, threads=args.threads)),
        Contender("safetensors load_file (lazy: mmap, data not read)", lambda: st_pkg.load_file(p_pkg)),
        Contender("torch.load", lambda: torch.load(p_torch, weights_only=True)),
    ]
    # check before timing that everyone read the same values
    a, b, c = load_file(p_ours), st_pkg.load_file(p_pkg), torch.load(p_torch, weights_only=True)
    assert all(torch.equal(a[k], v) and torch.equal(b[k], v) and torch.equal(c[k], v) for k, v in tensors.items())
    del a, b, c
    t_load = run_interleaved(loads, args.repeats)

    # Loading a checkpoint into a model that exists: the tensors are allocated and touched once
    # (as parameters are), so no contender pays first-touch page faults here.
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    flat = torch.zeros(nbytes, dtype=torch.uint8)

    def plain_read_into():
        with open(p_plain, "rb", buffering=0) as f:
            f.readinto(memoryview(flat.numpy()))

    def copy_all(src):
        for k, v in src.items():
            targets[k].copy_(v)

    intos = [
        Contender("plain readinto (limit)", plain_read_into),
        Contender("accelerate_c load_into", lambda: load_into(p_ours, targets, threads=args.threads)),
        Contender("safetensors load_file + copy_", lambda: copy_all(st_pkg.load_file(p_pkg))),
        Contender("torch.load + copy_", lambda: copy_all(torch.load(p_torch, weights_only=True))),
        Contender("torch.load(mmap=True) + copy_", lambda: copy_all(torch.load(p_torch, weights_only=True, mmap=True))),
    ]
    t_into = run_interleaved(intos, args.repeats)

    def table(title, times, ours_name, limit_name, other_name):
        """Prints the table; records (no targets: INFO) our share of the limit and the other's
        time / ours."""
        s = bytes_table(title, times, ours_name, nbytes, args.repeats)
        share = s[limit_name].median / s[ours_name].median
        print(f"ours reaches {share * 100:.0f}% of the '{limit_name}' bandwidth")
        limit = f"{limit_name.removesuffix(' (limit)')} {nbytes / s[limit_name].median / 1e9:.2f} GB/s"
        _targets.info("bench_safetensors", f"{title.split(' (')[0]}: share of the limit", share, unit="%",
                      limit=limit)
        _targets.info("bench_safetensors", f"{title.split(' (')[0]}: vs {other_name}",
                      s[other_name].median / s[ours_name].median, limit=limit)

    table("save", t_save, "accelerate_c save_file (fsync)", "plain pwritev + fsync (limit)",
          "safetensors save_file + fsync")
    table("load_file: new tensors (files in the page cache)", t_load, "accelerate_c load_file",
          "plain readinto (limit)", "torch.load")
    table("load into existing tensors (files in the page cache)", t_into, "accelerate_c load_into",
          "plain readinto (limit)", "safetensors load_file + copy_")
    for p in (p_ours, p_pkg, p_torch, p_plain):
        if os.path.exists(p):
            os.unlink(p)
    os.rmdir(work)


if __name__ == "__main__":
    main()
