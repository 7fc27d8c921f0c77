"""The differential harness in the test suite (tests/differential/): random training
configurations run through accelerate_c and through plain torch (DDP, GradScaler, clip_grad_*,
torch's compress hooks) in the same process group, compared after every optimizer step; the
cases of the defects found so far; and the bucket plans against torch's own assignment.

Budget: a few minutes here (AC_DIFF_CASES sets how many random cases; `make soak SECONDS=N`
runs new seeds for as long as asked).
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.distributed as dist

from accelerate_c import _C
from differential import run as harness
from differential.cases import REGRESSIONS

CASES = int(os.environ.get("AC_DIFF_CASES", "500"))


def _fail(failures):
    pytest.fail("\n".join(harness.report(c, e) for c, e in failures), pytrace=False)


@pytest.mark.timeout(900)
def test_defects_found_so_far():
    failures = harness.run_cases([dict(c) for c in REGRESSIONS.values()], log=lambda s: None)
    if failures:
        _fail(failures)


@pytest.mark.timeout(1500)
def test_random_configurations():
    failures = harness.run_seeds(range(1, CASES + 1), log=lambda s: None)
    if failures:
        _fail(failures)


def _torch_buckets(numel, esize, caps):
    dtype = {2: torch.bfloat16, 4: torch.float32}[esize]
    tensors = [torch.empty(n, dtype=dtype) for n in numel]
    buckets, _ = dist._compute_bucket_assignment_by_size(tensors, list(caps))
    return sorted(sorted(b) for b in buckets)


def _our_buckets(numel, esize, caps, align):
    plan = _C.Reducer(numel, list(range(len(numel))), esize, caps[0], caps[1], align)
    _, bucket_of = plan.layout()
    groups: dict = {}
    for i, b in enumerate(bucket_of):
        groups.setdefault(b, []).append(i)
    return sorted(groups.values())


@pytest.mark.parametrize("seed", range(200))
def test_bucket_plan_is_torchs(seed):
    """The plan puts the same gradients together as torch DDP's own assignment
    (dist._compute_bucket_assignment_by_size), gradients taken in the same order: the first
    bucket's cap, then the others', a bucket closing once it reaches its cap."""
    r = random.Random(seed)
    n = r.randint(1, 40)
    numel = [r.choice((1, 3, 17, 64, 100, 1000, 4096, 30000)) for _ in range(n)]
    esize = r.choice((2, 4))
    cap = r.choice((64, 400, 4000, 40000, 400000))
    caps = (cap, cap) if r.random() < 0.5 else (r.choice((64, 1024, 16384)), cap)
    # align: the gradient buffers start each range on 32 elements (grad_layout.ALIGN); padding must
    # not move a bucket boundary
    assert _our_buckets(numel, esize, caps, align=r.choice((1, 32))) == _torch_buckets(numel, esize, caps)
