"""Fused gradient post-processing on CPU: unscale + non-finite check + global norm + clip.

Compares, on the same 2^26-element gradient buffer held as the .grad of 100 parameters:

  torch         what a user runs today:
                    torch.amp.GradScaler("cpu").unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(params, max_norm)
                (one read+write pass to unscale and check, one read pass for the norm, one
                read+write pass to clip: ~5N element-bytes)
  accelerate_c  what Accelerator.clip_grad_norm_ runs on its flat gradient buffer
                (accelerate_c.grads.GradManager.clip_norm_fused): _C.sumsq (one read pass:
                sum of squares and the non-finite flag), the norm, found_inf and clip
                coefficient in Python, then _C.scale_(buf, inv_scale * clip_coef) (one
                read+write pass): 3N element-bytes.
  limit         an in-place scale of the same buffer (read N + write N), with torch's mul_ and
                with _C.scale_; the faster one is the bandwidth limit the fused path is held to.
  info          _C.sumsq alone and a plain read-only pass (torch's sum): where ours spends its
                time. Not part of any target.

Before every timed call the grads are refilled from a saved copy (untimed), so every contender
starts from the same values and the same cache state ("grads just written by backward").
Repeats are interleaved (torch, ours, ..., limit, torch, ours, ...). The results of both paths
are checked for equality once before timing; a mismatch exits non-zero.

Targets: accelerate_c >= 1.4x faster than torch (median vs median), and its effective
bandwidth (3N element-bytes / time) >= 70% of the limit. A MISS is reported, not an error.
This is the clip over gradients nobody measured (the first step of a loop, or after a write to
them); in a real loop on one process the gradient hooks take the sums of squares while backward
writes them and the clip is one scaling pass: benchmarks/bench_step.py times that case.

    .venv/bin/python benchmarks/bench_kernels.py                 # 2^26 elements, fp32 and bf16
    .venv/bin/python benchmarks/bench_kernels.py --quick         # smoke test, a few seconds
    .venv/bin/python benchmarks/bench_kernels.py --flush-cache   # every call starts from DRAM

Caveats the output helps with: the machine must be otherwise idle (a line at the end says how
many CPUs other processes used during the run); torch's OpenMP threads spin for a while after
each torch op (unless OMP_WAIT_POLICY=passive), which favours the next torch op and competes
with accelerate_c's own threads, both here and in a real training step.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from accelerate_c import _C  # noqa: E402
from accelerate_c.grads import GradManager  # noqa: E402

from _common import (  # noqa: E402
    Contender,
    Summary,
    cpu_model,
    gbps,
    last_level_cache_bytes,
    load_sample,
    logical_cpus,
    other_load,
    other_load_between,
    print_table,
    run_interleaved,
    verdict,
)
import _targets  # noqa: E402

TARGET_SPEEDUP = 1.4
TARGET_FRACTION = 0.70
NUM_PARAMS = 100
INIT_SCALE = 1024.0  # a power of two, as GradScaler's scales are: unscaling is exact
CLIP_FRACTION = 0.5  # max_norm = this * true norm, so clipping takes effect
LIMIT_FACTOR = 0.999

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# Equality checks, run once before timing (a failure exits non-zero).
#  * accelerate_c against an fp64 reference computed from the same data: norm within NORM_RTOL;
#    grads within REF_GRAD_RTOL -- fp32: both round one product per element (1e-6); bf16: the
#    fp32 product and the fp64 product may round to neighbouring bf16 values (one ulp, 2^-7).
#  * accelerate_c against torch: torch's total norm is itself inexact (fp32: it sums squares in
#    fp32 per parameter, ~7e-6 relative at 2^26 elements; bf16: the norm and the clip
#    coefficient are bf16 numbers), and its clip coefficient inherits that error. So grads must
#    agree within TORCH_GRAD_RTOL plus torch's own measured norm error, and torch's norm error
#    must stay under TORCH_NORM_SANITY (if not, the two paths did not see the same data).
NORM_RTOL = 1e-6
REF_GRAD_RTOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-7}
TORCH_GRAD_RTOL = {torch.float32: 1e-6, torch.bfloat16: 1.6e-2}  # bf16: torch.testing's default
TORCH_NORM_SANITY = {torch.float32: 1e-4, torch.bfloat16: 2.0**-7}
CHECK_CHUNK = 1 << 20  # compare in slices: fp64 temporaries of the whole buffer would be 512 MiB


class Case:
    """One flat gradient buffer, its saved scaled contents, 100 parameters whose grads are views
    into it, an SGD optimizer over them (only GradScaler needs it) and a GradScaler."""

    def __init__(self, n: int, dtype: torch.dtype, flush=None, seed: int = 0):
        self.n = n
        self.flush = flush
        self.dtype = dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        gen = torch.Generator().manual_seed(seed)
        # the grads as backward leaves them under GradScaler: scale * g
        self.saved = torch.randn(n, generator=gen, dtype=dtype).mul_(INIT_SCALE)
        self.flat = torch.empty_like(self.saved)
        self.flat.copy_(self.saved)  # touches every page now, not inside a timed call
        # parameter storage is never written, so its pages are never faulted in
        pstore = torch.empty(n, dtype=dtype)
        # sizes that are multiples of the gradient buffers' alignment, so the Accelerator's
        # flat buffer holds the same layout as self.flat (no padding between parameters)
        per = (n // NUM_PARAMS) // 32 * 32
        bounds = [i * per for i in range(NUM_PARAMS)] + [n]  # remainder goes to the last one
        self.params = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            p = torch.nn.Parameter(pstore[lo:hi])
            p.grad = self.flat[lo:hi]
            self.params.append(p)
        assert all(p.grad.data_ptr() == self.flat[lo:].data_ptr() for p, lo in zip(self.params, bounds))
        self.opt = torch.optim.SGD(self.params, lr=0.1)
        # growth_interval: the scale must stay INIT_SCALE across the repeats
        self.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=10**9)
        self.scaler.scale(torch.zeros(()))  # GradScaler creates its scale tensor lazily here
        self.inv_scale = 1.0 / INIT_SCALE
        sq = sum(c.double().square_().sum().item() for c in self.saved.split(CHECK_CHUNK))
        ref = math.sqrt(sq) * self.inv_scale
        self.ref_norm = ref  # fp64 norm of the unscaled grads
        self.max_norm = CLIP_FRACTION * ref
        self.buf = _C.Buffer(self.flat)  # shares self.flat's memory
        # accelerate_c's side: the same parameter sizes registered with the gradient manager
        # the Accelerator uses, so the timed path is the product's own code
        module = torch.nn.Module()
        module.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.empty(hi - lo, dtype=dtype))
                                           for lo, hi in zip(bounds[:-1], bounds[1:]))
        self.mgr = GradManager()
        self.mgr.add_model(module)
        self.group = self.mgr.groups[0]
        # the bucket plan lays the ranges out in reverse registration order (backward's order);
        # the whole-buffer passes do not care, but there must be no padding to time
        assert self.group.flat.numel() == n, "unexpected padding in the gradient buffer"
        self.our_flat = self.group.flat[:n]
        self.our_flat.copy_(self.saved)
        self._unscaled = False
        self.last_torch_norm = None
        self.last_ours = None

    # ---- untimed --------------------------------------------------------------------------
    def refill(self) -> None:
        self.flat.copy_(self.saved)
        if self.flush is not None:
            self.flush()

    def refill_ours(self) -> None:
        self.our_flat.copy_(self.saved)
        self.group.needs_unscale = True  # as after a backward under fp16
        if self.flush is not None:
            self.flush()

    def refill_for_torch(self) -> None:
        # a real loop calls scaler.step()/update() after unscale_; update() also resets the
        # "unscale_ already called" state. Not part of what is timed.
        if self._unscaled:
            self.scaler.update()
            self._unscaled = False
        self.refill()

    # ---- timed ----------------------------------------------------------------------------
    def torch_path(self) -> None:
        self.scaler.unscale_(self.opt)
        self._unscaled = True
        self.last_torch_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)

    def ours(self) -> None:
        norm = self.mgr.clip_norm_fused([self.group], self.max_norm, 2.0, self.inv_scale)
        self.last_ours = (float(norm), bool(self.group.found_inf))

    def limit_torch(self) -> None:
        self.flat.mul_(LIMIT_FACTOR)

    def limit_ours(self) -> None:
        _C.scale_(self.buf, LIMIT_FACTOR)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def max_rel_diff(actual: torch.Tensor, expected_of) -> tuple:
    """Largest |actual - expected| / |expected| over the buffer, in fp64, slice by slice;
    expected_of(lo, hi) gives the expected fp64 values of actual[lo:hi]. Also counts elements
    that differ at all."""
    worst, ndiff = 0.0, 0
    for lo in range(0, actual.numel(), CHECK_CHUNK):
        hi = min(lo + CHECK_CHUNK, actual.numel())
        a, e = actual[lo:hi].double(), expected_of(lo, hi)
        d = (a - e).abs()
        ndiff += int((d != 0).sum())
        bad_zero = (e == 0) & (d != 0)  # a relative error is unbounded there
        if bool(bad_zero.any()):
            return math.inf, ndiff
        worst = max(worst, float((d / e.abs().clamp_min(1e-300)).max()))
    return worst, ndiff


def verify(case: Case) -> list:
    """Runs both paths once on the same input and compares them with each other and with an
    fp64 reference. Returns a list of failures (empty: all agree)."""
    fails = []
    dt = case.dtype
    case.refill_for_torch()
    case.torch_path()
    torch_grads = case.flat.clone()
    torch_norm = case.last_torch_norm.double().item()
    case.refill_for_torch()  # update() halves the scale if unscale_ found an inf
    if case.scaler.get_scale() != INIT_SCALE:
        fails.append(f"GradScaler found non-finite grads (scale is now {case.scaler.get_scale()})")
    torch_err = rel(torch_norm, case.ref_norm)
    if not torch_err <= TORCH_NORM_SANITY[dt]:
        fails.append(f"torch's norm {torch_norm!r} is {torch_err:.2e} off the fp64 norm {case.ref_norm!r}")
    if not torch_norm > case.max_norm:
        fails.append(f"clipping did not take effect: norm {torch_norm} <= max_norm {case.max_norm}")

    ref_factor = case.inv_scale * min(1.0, case.max_norm / (case.ref_norm + 1e-6))

    def ref_grads(lo, hi):  # fp64 result rounded once to the grads' dtype, as a kernel stores it
        return (case.saved[lo:hi].double() * ref_factor).to(dt).double()

    def torch_of(lo, hi):
        return torch_grads[lo:hi].double()

    report = []
    for label, fn in (("clip_norm_fused", case.ours),):
        case.refill_ours()
        fn()
        norm, found_inf = case.last_ours
        if found_inf:
            fails.append(f"accelerate_c ({label}) reported non-finite grads")
        # the norm comes back in the gradients' dtype, as torch's does: compare it with the fp64
        # norm rounded to that dtype (the clip itself uses the unrounded norm; the grads check
        # below holds it to the fp64 reference)
        ref_in_dtype = float(torch.tensor(case.ref_norm, dtype=torch.float64).to(case.dtype))
        if not rel(norm, ref_in_dtype) <= NORM_RTOL:
            fails.append(f"accelerate_c ({label}) norm {norm!r} vs fp64 {case.ref_norm!r} rounded to "
                         f"{case.dtype} {ref_in_dtype!r}: rel {rel(norm, ref_in_dtype):.2e} > {NORM_RTOL:.0e}")
        r_ref, _ = max_rel_diff(case.our_flat, ref_grads)
        if not r_ref <= REF_GRAD_RTOL[dt]:
            fails.append(f"accelerate_c ({label}) grads vs fp64 reference: max rel diff {r_ref:.2e} "
                         f"> {REF_GRAD_RTOL[dt]:.1e}")
        r_torch, nd_torch = max_rel_diff(case.our_flat, torch_of)
        tol = TORCH_GRAD_RTOL[dt] + torch_err
        if not r_torch <= tol:
            fails.append(f"accelerate_c ({label}) grads vs torch: max rel diff {r_torch:.2e} > {tol:.2e} "
                         f"({TORCH_GRAD_RTOL[dt]:.1e} + torch's norm error {torch_err:.2e})")
        report.append((label, norm, r_ref, r_torch, nd_torch))

    label, norm, r_ref, r_torch, nd = report[0]
    print(f"  check: norm  accelerate_c {norm:.10g} (rel err {rel(norm, case.ref_norm):.1e})  "
          f"torch {torch_norm:.10g} (rel err {torch_err:.1e})  fp64 {case.ref_norm:.10g}")
    print(f"  check: clip coef {min(1.0, case.max_norm / (norm + 1e-6)):.6f}; grads: max rel diff "
          f"vs fp64 {r_ref:.1e}, vs torch {r_torch:.1e} ({nd}/{case.n} elements differ from torch)")
    del torch_grads
    return fails


def bench_dtype(name: str, dtype: torch.dtype, n: int, repeats: int, flush=None) -> dict:
    case = Case(n, dtype, flush)
    es = case.esize
    print(f"\n== {name}: {n} elements ({n * es / 2**20:.0f} MiB) as the grads of {NUM_PARAMS} parameters, "
          f"scale {INIT_SCALE:g}, max_norm = {CLIP_FRACTION} x norm")
    fails = verify(case)
    if fails:
        for f in fails:
            print(f"  EQUALITY CHECK FAILED: {f}", file=sys.stderr)
        return {"name": name, "failed": True}
    print("  check: torch and accelerate_c agree")

    T, OB, LT, LO = ("torch unscale_+clip_grad_norm_", "accelerate_c clip_grad_norm_ (fused)",
                     "limit: torch mul_", "limit: _C.scale_")
    IS, IR = "info: _C.sumsq alone", "info: torch sum (read-only pass)"
    contenders = [
        Contender(T, case.torch_path, case.refill_for_torch),
        Contender(OB, case.ours, case.refill_ours),
        Contender(LT, case.limit_torch, case.refill),
        Contender(LO, case.limit_ours, case.refill),
        # where the time of ours goes: its read pass, against a plain read pass of the same buffer
        Contender(IS, lambda: _C.sumsq(case.group.buf), case.refill_ours),
        Contender(IR, lambda: case.flat.sum(), case.refill),
    ]
    # element-bytes moved, in units of N * esize
    traffic = {T: 5, OB: 3, LT: 2, LO: 2, IS: 1, IR: 1}
    times = run_interleaved(contenders, repeats=repeats, warmup=1)
    s = {k: Summary.of(v) for k, v in times.items()}
    bw = {k: gbps(traffic[k] * n * es, s[k].median) for k in s}
    limit_name = max((LT, LO), key=lambda k: bw[k])
    limit = bw[limit_name]
    rows = []
    for k in times:
        rows.append([
            k, f"{traffic[k]}N", f"{s[k].median * 1e3:.2f}", f"{s[k].q1 * 1e3:.2f}", f"{s[k].q3 * 1e3:.2f}",
            f"{bw[k]:.1f}", f"{100 * bw[k] / limit:.0f}%",
            f"{s[T].median / s[k].median:.2f}x",
        ])
    print()
    print_table(["contender", "bytes", "median ms", "q1 ms", "q3 ms", "GB/s", "% limit", "torch/this"], rows)
    speedup = s[T].median / s[OB].median
    frac = bw[OB] / limit
    print(f"  bytes: N x {es} B element-bytes read + written; GB/s = those bytes / median time "
          f"(torch's 5N assumes one unscale pass, one norm pass, one clip pass)")
    print(f"  limit = {limit_name.removeprefix('limit: ')}, {limit:.1f} GB/s (read + write)")
    print(f"  speedup torch / accelerate_c (Buffer): {speedup:.2f}x  (target >= {TARGET_SPEEDUP}x)  {verdict(speedup >= TARGET_SPEEDUP)}")
    print(f"  accelerate_c bandwidth: {bw[OB]:.1f} GB/s = {100 * frac:.0f}% of the limit  "
          f"(target >= {100 * TARGET_FRACTION:.0f}%)  {verdict(frac >= TARGET_FRACTION)}")
    del case
    return {"name": name, "failed": False, "speedup": speedup, "fraction": frac,
            "ours_ms": s[OB].median * 1e3, "torch_ms": s[T].median * 1e3, "limit": limit,
            "limit_name": limit_name.removeprefix("limit: ")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-log2", type=int, default=26, help="buffer of 2^k elements (default 26)")
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats per contender (default 7)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32,bf16 (default both)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for torch and for the kernels alike (default: torch's current count)")
    ap.add_argument("--flush-cache", action="store_true",
                    help="after each refill, write a scratch buffer of twice the last-level cache so "
                         "every contender starts from DRAM (default: grads stay as warm as the refill "
                         "left them, like grads just written by backward)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2^20 elements, 3 repeats")
    args = ap.parse_args(argv)
    if args.quick:
        args.size_log2, args.repeats = 20, 3
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in DTYPES]
    if bad or not names:
        ap.error(f"unknown dtype(s) {bad}; choose from {sorted(DTYPES)}")
    if args.repeats < 1 or not 10 <= args.size_log2 <= 34:
        ap.error("need --repeats >= 1 and 10 <= --size-log2 <= 34")

    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    _C.set_num_threads(threads)
    n = 1 << args.size_log2
    print(f"bench_kernels: fused unscale + non-finite check + norm + clip, CPU")
    print(f"  cpu: {cpu_model()} ({logical_cpus()} logical CPUs available)")
    print(f"  torch {torch.__version__}, threads: torch {torch.get_num_threads()}, "
          f"accelerate_c {_C.get_num_threads()}; kernel ISA: {_C.kernel_isa()}")
    print(f"  OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}: torch's OpenMP threads "
          f"{'sleep' if os.environ.get('OMP_WAIT_POLICY', '').lower() == 'passive' else 'spin'} after each op")
    print(f"  size 2^{args.size_log2} = {n} elements, {args.repeats} interleaved repeats (+1 warm-up), "
          f"medians and quartiles")

    busy = other_load()
    if busy is not None and busy > 0.2:
        print(f"  WARNING: other processes are using {busy:.1f} CPUs' worth right now: "
              f"these numbers share the machine")
    flush = None
    if args.flush_cache:
        scratch = torch.empty(2 * last_level_cache_bytes() // 4, dtype=torch.float32)
        scratch.fill_(0.0)  # fault the pages in now

        def flush():
            scratch.fill_(1.0)

        print(f"  caches: flushed before every timed call ({scratch.numel() * 4 >> 20} MiB scratch written)")
    else:
        print("  caches: warm -- each timed call follows an untimed refill of the grads (--flush-cache "
              "to start cold)")
    results = []
    torch.set_grad_enabled(False)
    run_start = load_sample()
    for name in names:
        results.append(bench_dtype(name, DTYPES[name], n, args.repeats, flush))

    print("\n== summary")
    rows = []
    for r in results:
        if r["failed"]:
            rows.append([r["name"], "-", "-", "-", "-", "EQUALITY CHECK FAILED", "-", "-"])
            continue
        limit = f"{r['limit']:.1f} GB/s read+write ({r['limit_name']})"
        ok_speed = _targets.target("bench_kernels", f"{r['name']} fused unscale+check+norm+clip vs torch",
                                   r["speedup"], TARGET_SPEEDUP, limit=limit)
        ok_frac = _targets.target("bench_kernels", f"{r['name']} fused path's bandwidth, share of the limit",
                                  r["fraction"], TARGET_FRACTION, unit="%", limit=limit)
        rows.append([r["name"], f"{r['torch_ms']:.2f}", f"{r['ours_ms']:.2f}", f"{r['speedup']:.2f}x",
                     verdict(ok_speed), f"{100 * r['fraction']:.0f}%", verdict(ok_frac), limit])
    print_table(["dtype", "torch ms", "ours ms", "speedup", f">={TARGET_SPEEDUP}x",
                 "% of limit", f">={100 * TARGET_FRACTION:.0f}%", "limit"], rows)
    busy = other_load_between(run_start, load_sample())
    if busy is not None:
        note = "  WARNING: the machine was shared, numbers are suspect" if busy > 0.2 else ""
        print(f"  other processes used {busy:.2f} CPUs' worth on average during the run{note}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
