"""save_state / load_state of a ~1 GiB training state: accelerate_c vs accelerate 1.15 vs
torch.save/torch.load, against the disk and page-cache limits measured in the same run.

    python benchmarks/bench_checkpoint.py [--dir DIR] [--repeats 3] [--layers 5] [--width 2048]

The state: an MLP of --layers pairs of Linear(width, 2*width) / Linear(2*width, width) (5 x 2048:
84M fp32 parameters, 336 MB) with AdamW's state after one step (exp_avg + exp_avg_sq, 671 MB).

Saves are timed until durable for every contender: accelerate_c fsyncs every file and the
directory itself; for accelerate and torch.save the benchmark fsyncs each file they wrote inside
the timed region. Every save goes to a fresh directory (the previous one is removed and synced untimed: see rm()).
The save limit: the same number of bytes as one big buffer, written with os.write to a fresh
file, then fsynced (through the page cache, as accelerate and torch.save write; the targets
compare against this row). A second limit row writes the same bytes from one page-aligned buffer
with O_DIRECT in 8 MiB pieces, then fsyncs: the bound for accelerate_c's files of 4 MiB and more,
which it writes with O_DIRECT (ACCELERATE_C_DIRECT_IO, docs/checkpoints.md); the row is left out
where the file system refuses O_DIRECT.
Loads read files that are in the page cache: O_DIRECT leaves accelerate_c's files out of it, so
before each load phase every contender's files are read once, untimed. Two cases: a resume
(the optimizer has no state yet, so every contender allocates it; limit: the limit's file read into
freshly allocated memory with one preadv per CPU over disjoint ranges) and a reload into a running state (model and
optimizer state exist: accelerate_c reads straight into them; limit: the same read into
memory touched before). accelerate's and
accelerate_c's load_state also restore RNG and scheduler state (small). Contenders run
interleaved (A, B, C, A, B, C, ...), one warm-up round, medians of --repeats rounds.
Targets: save >= 1.5x accelerate and >= 60% of the write+fsync limit; load >= 1.3x accelerate
and >= 50% of the page-cache read limit.
"""
from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Contender, Summary, bytes_table, cpu_model, fsync_path, load_sample, logical_cpus,  # noqa: E402
                     other_load_between, run_interleaved, verdict)
import _targets  # noqa: E402

# (vs accelerate, share of the limit) for the save and for both loads
SAVE_TARGETS = (1.5, 0.6)
LOAD_TARGETS = (1.3, 0.5)


def dir_bytes(directory):
    return sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="directory for the files (default: the temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--width", type=int, default=2048)
    args = ap.parse_args()

    import accelerate

    from accelerate_c import Accelerator as OurAccelerator

    torch.manual_seed(0)
    w = args.width
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(w, 2 * w), nn.Linear(2 * w, w)]
    model = nn.Sequential(*layers)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # AdamW's state exists
    for p in model.parameters():
        p.grad = None
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.99 ** s)

    ours = OurAccelerator(cpu=True)
    m_ours, o_ours, s_ours = ours.prepare(model, opt, sched)
    theirs = accelerate.Accelerator(cpu=True)
    m_acc, o_acc, s_acc = theirs.prepare(model, opt, sched)

    work = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir)
    d_ours, d_acc, p_torch, p_plain = (os.path.join(work, n) for n in ("ours", "acc", "torch.pt", "plain.bin"))

    # sizes: one save of ours, untimed
    ours.save_state(d_ours)
    nbytes = dir_bytes(d_ours)
    print(f"bench_checkpoint: {n_params / 1e6:.1f}M fp32 params + AdamW state, checkpoint {nbytes / 1e6:.0f} MB, "
          f"dir {work}")
    print(f"cpu: {cpu_model()} ({logical_cpus()} logical), torch {torch.__version__}, accelerate "
          f"{accelerate.__version__}")
    chunk = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    chunk_view = memoryview(chunk.numpy())

    def rm(path):
        """Removes a contender's previous output, then syncs (untimed): on a file system mounted
        with `discard` (ext4 here) freeing the blocks of deleted files is paid by the next
        journal commit, i.e. by whoever fsyncs next; without this sync a save's fsync would pay
        for deleting the previous save (this is the "first save to a fresh file is sometimes
        ~2x slower" effect, seen the same with the safetensors package)."""
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
        os.sync()

    def plain_write():
        fd = os.open(p_plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while off < nbytes:
                off += os.write(fd, chunk_view[off:off + (1 << 30)])
            os.fsync(fd)
        finally:
            os.close(fd)

    # The O_DIRECT limit: the same bytes in one page-aligned buffer (an anonymous mmap), written
    # in 8 MiB pieces (aligned offsets and lengths; the last piece padded to 4096, then the file
    # is cut to size) and fsynced.
    p_direct = os.path.join(work, "direct.bin")
    padded = (nbytes + 4095) // 4096 * 4096
    direct_buf = mmap.mmap(-1, padded)
    direct_buf[:nbytes] = chunk_view
    direct_view = memoryview(direct_buf)

    def direct_write():
        fd = os.open(p_direct, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        try:
            for off in range(0, padded, 8 << 20):
                end = min(padded, off + (8 << 20))
                while off < end:
                    off += os.pwrite(fd, direct_view[off:end], off)
            os.ftruncate(fd, nbytes)
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        direct_write()
        have_direct = hasattr(os, "O_DIRECT")
    except OSError as e:  # EINVAL: this file system refuses O_DIRECT
        have_direct = False
        print(f"note: no O_DIRECT limit row: {e}")
    rm(p_direct)

    def acc_save():
        theirs.save_state(d_acc)
        fsync_path(d_acc)

    def torch_save():
        with open(p_torch, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())

    saves = [
        Contender("write + fsync, one buffer (limit)", plain_write, setup=lambda: rm(p_plain)),
        *([Contender("write + fsync, O_DIRECT one buffer", direct_write, setup=lambda: rm(p_direct))]
          if have_direct else []),
        Contender("accelerate_c save_state", lambda: ours.save_state(d_ours), setup=lambda: rm(d_ours)),
        Contender("accelerate save_state + fsync", acc_save, setup=lambda: rm(d_acc)),
        Contender("torch.save + fsync", torch_save, setup=lambda: rm(p_torch)),
    ]
    a = load_sample()
    t_save = run_interleaved(saves, args.repeats)
    rm(p_direct)
    del direct_view
    direct_buf.close()

    def sums():
        return ([float(v.double().sum()) for v in model.state_dict().values()],
                [float(t.double().sum()) for st in opt.state_dict()["state"].values() for t in st.values()])

    ref_sums = sums()

    n_threads = max(1, logical_cpus())

    def plain_read(buf=None):
        """The page-cache read limit: one preadv per thread over disjoint ranges of the file, one
        thread per CPU (a single-threaded readinto is slower than what the machine can do)."""
        if buf is None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
        mv = memoryview(buf.numpy())
        step = max(4096, ((nbytes + n_threads - 1) // n_threads + 4095) // 4096 * 4096)
        fd = os.open(p_plain, os.O_RDONLY)

        def part(lo):
            hi = min(nbytes, lo + step)
            while lo < hi:
                got = os.preadv(fd, [mv[lo:hi]], lo)
                if got <= 0:
                    raise OSError("short read")
                lo += got

        try:
            with ThreadPoolExecutor(n_threads) as ex:
                list(ex.map(part, range(0, nbytes, step)))
        finally:
            os.close(fd)
        return buf

    touched = torch.zeros(nbytes, dtype=torch.uint8)

    def torch_load():
        sd = torch.load(p_torch, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        sched.load_state_dict(sd["scheduler"])

    def fresh_optimizer():
        import collections

        opt.state = collections.defaultdict(dict)  # a resumed run's optimizer has no state yet
        import gc

        gc.collect()

    def loads(fresh):
        setup = fresh_optimizer if fresh else None
        return [
            Contender("parallel read, new memory (limit)", plain_read),
            Contender("accelerate_c load_state", lambda: ours.load_state(d_ours), setup=setup),
            Contender("accelerate load_state", lambda: theirs.load_state(d_acc), setup=setup),
            Contender("torch.load + load_state_dict", torch_load, setup=setup),
            Contender("parallel read, touched memory (limit)", lambda: plain_read(touched)),
        ]

    read_buf = bytearray(8 << 20)

    def into_page_cache():
        """Reads every contender's files once (untimed), so every load starts from the page
        cache: accelerate_c's O_DIRECT saves leave their files out of it."""
        for top in (d_ours, d_acc, p_torch, p_plain):
            paths = ([os.path.join(r, f) for r, _d, fs in os.walk(top) for f in fs] if os.path.isdir(top)
                     else [top])
            for path in paths:
                with open(path, "rb", buffering=0) as f:
                    while f.readinto(read_buf):
                        pass

    into_page_cache()
    t_resume = run_interleaved(loads(True), args.repeats)
    into_page_cache()
    t_live = run_interleaved(loads(False), args.repeats)
    b = load_sample()
    # what ours loaded is what was saved: from a fresh optimizer and zeroed weights
    fresh_optimizer()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ours.load_state(d_ours)
    assert sums() == ref_sums, "accelerate_c load_state did not restore the saved state"

    def table(title, times, ours_name, limit_name, acc_name):
        s = bytes_table(title, times, ours_name, nbytes, args.repeats)
        mine = s[ours_name].median
        return s[acc_name].median / mine, s[limit_name].median / mine, nbytes / s[limit_name].median / 1e9

    sv_acc, sv_lim, sv_gbps = table("save_state, durable", t_save, "accelerate_c save_state",
                                    "write + fsync, one buffer (limit)", "accelerate save_state + fsync")
    ld_acc, ld_lim, ld_gbps = table("load_state to resume: a fresh optimizer, its state allocated by the load "
                                    "(files in the page cache)", t_resume, "accelerate_c load_state",
                                    "parallel read, new memory (limit)", "accelerate load_state")
    lv_acc, lv_lim, lv_gbps = table("load_state into a running state: model and optimizer state exist (files in "
                                    "the page cache)", t_live, "accelerate_c load_state",
                                    "parallel read, touched memory (limit)", "accelerate load_state")
    print()
    direct_note = ""
    if have_direct:
        dl = Summary.of(t_save["write + fsync, O_DIRECT one buffer"]).median
        direct_note = f"; {dl / Summary.of(t_save['accelerate_c save_state']).median * 100:.0f}% of O_DIRECT write+fsync"
    (sa, sl), (la, ll) = SAVE_TARGETS, LOAD_TARGETS
    print(f"save: {sv_acc:.2f}x accelerate (target >= {sa}x: {verdict(sv_acc >= sa)}), "
          f"{sv_lim * 100:.0f}% of write+fsync (target >= {sl:.0%}: {verdict(sv_lim >= sl)}){direct_note}")
    print(f"load (resume): {ld_acc:.2f}x accelerate (target >= {la}x: {verdict(ld_acc >= la)}), "
          f"{ld_lim * 100:.0f}% of the page-cache read into new memory (target >= {ll:.0%}: {verdict(ld_lim >= ll)})")
    print(f"load (running): {lv_acc:.2f}x accelerate (target >= {la}x: {verdict(lv_acc >= la)}), "
          f"{lv_lim * 100:.0f}% of the page-cache read into touched memory (target >= {ll:.0%}: "
          f"{verdict(lv_lim >= ll)})")
    for what, vs_acc, vs_lim, limit in (
            ("save_state (durable)", sv_acc, sv_lim, f"write+fsync {sv_gbps:.2f} GB/s"),
            ("load_state, resume (fresh optimizer)", ld_acc, ld_lim, f"page-cache read, new memory {ld_gbps:.2f} GB/s"),
            ("load_state into a running state", lv_acc, lv_lim, f"page-cache read, touched memory {lv_gbps:.2f} GB/s")):
        goal_acc, goal_lim = SAVE_TARGETS if what.startswith("save") else LOAD_TARGETS
        _targets.target("bench_checkpoint", f"{what} vs accelerate", vs_acc, goal_acc, limit=limit)
        _targets.target("bench_checkpoint", f"{what}, share of the limit", vs_lim, goal_lim, unit="%", limit=limit)
    other = other_load_between(a, b)
    if other is not None and other > 0.3:
        print(f"warning: other processes used {other:.1f} CPUs on average during the run")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
