"""The shard plan (accelerate_c._C.ShardPlan, csrc/core/shard.c) and its thin wrapper
(accelerate_c.shard_plan): the binding against a pure-Python reimplementation of the layout
rules written here, resharding checked by simulation with torch tensors (and through files),
and the layout's collectives on a real 2-process gloo group."""
import os
import random

import pytest
import torch

from accelerate_c import _C
from accelerate_c.shard_plan import DDP_CAP, DDP_FIRST_CAP, ShardLayout, plan_spec
from test_launch import SCRIPTS, launch
from timeouts import wait_s


def ceil_to(x, m):
    return -(-x // m) * m


def ref_layout(numel, order, esize, world, align, first_cap, cap):
    """The rules of csrc/include/ac/shard.h, from scratch: torch DDP's bucket-closing rule over
    the parameters' own bytes, each parameter at a multiple of align, each bucket padded to
    world x align, the full buffer bucket-major, each rank's shard its chunks concatenated.
    Returns (buckets [(B, c, L, first, count)], params [(bucket, offset, numel)], total, shard)."""
    groups, cur, nbytes = [], [], 0
    for k, i in enumerate(order):
        if cur and nbytes >= (first_cap if not groups else cap):
            groups.append(cur)
            cur, nbytes = [], 0
        cur.append(k)
        nbytes += numel[i] * esize
    if cur:
        groups.append(cur)
    buckets, params, full, local = [], [None] * len(numel), 0, 0
    for b, ks in enumerate(groups):
        used = 0
        for k in ks:
            params[order[k]] = (b, full + used, numel[order[k]])
            used += ceil_to(numel[order[k]], align)
        chunk = ceil_to(used, world * align) // world
        buckets.append((full, chunk, local, ks[0], len(ks)))
        full += world * chunk
        local += chunk
    return buckets, params, full, local


def ref_owned(buckets, params, i, rank):
    b, off, n = params[i]
    start, chunk, local = buckets[b][:3]
    lo = start + rank * chunk
    s, e = max(off, lo), min(off + n, lo + chunk)
    return (local + s - lo, s - off, e - s) if s < e else (0, 0, 0)


def random_args(rng, n=None):
    n = rng.choice([0, 1, rng.randint(2, 16)]) if n is None else n
    numel = [0 if rng.random() < 0.1 else rng.randint(0, 1000) for _ in range(n)]
    order = list(range(n))
    rng.shuffle(order)
    return dict(numel=numel, order=order, esize=rng.choice([1, 2, 4, 8]), world=rng.randint(1, 8),
                align=rng.choice([1, 2, 4, 16]), first_cap_bytes=rng.choice([1 << 62, rng.randint(1, 4000)]),
                cap_bytes=rng.choice([1 << 62, rng.randint(1, 8000)]))


def make(args):
    args = dict(args)
    return _C.ShardPlan(args.pop("numel"), args.pop("esize"), args.pop("world"), **args)


def test_random_plans_match_the_reference():
    rng = random.Random(1313)
    for _ in range(300):
        a = random_args(rng)
        plan = make(a)
        buckets, params, total, shard = ref_layout(a["numel"], a["order"], a["esize"], a["world"], a["align"],
                                                   a["first_cap_bytes"], a["cap_bytes"])
        assert (plan.total, plan.shard_numel, plan.nbuckets, plan.nparams) == (total, shard, len(buckets),
                                                                                len(params)), a
        assert plan.buckets() == buckets, a
        assert [plan.bucket(b) for b in range(plan.nbuckets)] == buckets
        assert plan.params() == params, a
        assert [plan.param(i) for i in range(plan.nparams)] == params
        for i in range(plan.nparams):
            for r in range(plan.world):
                assert plan.param_shard(i, r) == ref_owned(buckets, params, i, r), (a, i, r)
        assert plan_spec(plan) == a
        assert plan_spec(make(plan_spec(plan))) == a


def test_worked_example_and_defaults():
    # numel 5, 3, 8 fp32 in reverse order, align 2, caps 32 B / 16 B, world 2 (tests/c/test_shard.c works it)
    plan = _C.ShardPlan([5, 3, 8], 4, 2, align=2, first_cap_bytes=32, cap_bytes=16)
    assert plan.buckets() == [(0, 4, 0, 0, 1), (8, 6, 4, 1, 2)]
    assert plan.params() == [(1, 12, 5), (1, 8, 3), (0, 0, 8)]
    assert [plan.param_shard(0, r) for r in range(2)] == [(8, 0, 2), (4, 2, 3)]
    assert (plan.total, plan.shard_numel, plan.world, plan.nparams, plan.nbuckets) == (20, 10, 2, 3, 2)
    assert repr(plan) == "ShardPlan(nparams=3, esize=4, world=2, align=2, nbuckets=2, total=20, shard_numel=10)"
    # defaults: reverse order, DDP's caps, align 1
    d = _C.ShardPlan([3, 4, 5], 2, 3)
    assert d.order == (2, 1, 0) and d.numel == (3, 4, 5)
    assert (d.align, d.first_cap_bytes, d.cap_bytes) == (1, 1 << 20, 25 << 20) == (1, DDP_FIRST_CAP, DDP_CAP)
    assert d.buckets() == [(0, 4, 0, 0, 3)]
    with pytest.raises(AttributeError):
        d.total = 3  # read-only
    empty = _C.ShardPlan([], 4, 2)
    assert (empty.total, empty.shard_numel, empty.nbuckets, empty.buckets(), empty.params()) == (0, 0, 0, [], [])
    # ints from anything with __index__ (torch sizes, numpy ints)
    assert _C.ShardPlan([torch.tensor(5)], 4, 1).numel == (5,)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="world must be > 0, got 0"):
        _C.ShardPlan([1], 4, 0)
    for kw, val in [("align", 0), ("first_cap_bytes", -1), ("cap_bytes", 0)]:
        with pytest.raises(ValueError, match=f"{kw} must be > 0"):
            _C.ShardPlan([1], 4, 2, **{kw: val})
    with pytest.raises(ValueError, match="esize must be > 0"):
        _C.ShardPlan([1], 0, 2)
    with pytest.raises(ValueError, match=r"order is not a permutation of 0..2 \(order\[2\] is 1, repeated\)") as e:
        _C.ShardPlan([1, 2, 3], 4, 2, order=[0, 1, 1])
    assert e.value.code == "AC_ERR_INVALID_ARG"
    with pytest.raises(ValueError, match="order has 2 entries for 3 parameters"):
        _C.ShardPlan([1, 2, 3], 4, 2, order=[0, 1])
    with pytest.raises(ValueError, match=r"numel\[1\] must be a non-negative int"):
        _C.ShardPlan([1, -2], 4, 2)
    with pytest.raises(TypeError, match=r"numel\[0\] must be an int"):
        _C.ShardPlan(["x"], 4, 2)
    with pytest.raises(TypeError, match="numel must be a sequence"):
        _C.ShardPlan(5, 4, 2)
    with pytest.raises(ValueError, match="parameter 0 has too many elements"):
        _C.ShardPlan([1 << 62], 8, 2)
    plan = _C.ShardPlan([5, 3, 8], 4, 2)
    with pytest.raises(IndexError, match=r"bucket: b 1 out of range \(1 buckets\)"):
        plan.bucket(1)
    with pytest.raises(IndexError, match="param: i -1 out of range"):
        plan.param(-1)
    with pytest.raises(IndexError, match=r"param_shard: rank 2 out of range \(2 ranks\)"):
        plan.param_shard(0, 2)
    with pytest.raises(IndexError, match="param_shard: i 3 out of range"):
        plan.param_shard(3, 0)
    with pytest.raises(IndexError, match="new_rank 2 out of range"):
        plan.reshard_runs(plan, 2)
    with pytest.raises(IndexError, match="old_rank 5 out of range"):
        plan.reshard_runs(plan, 0, old_rank=5)
    with pytest.raises(TypeError, match="old_plan must be a ShardPlan"):
        plan.reshard_runs([5, 3, 8], 0)
    other = _C.ShardPlan([5, 4, 8], 4, 3)
    with pytest.raises(ValueError, match="parameter 1 has 4 elements in the old plan and 3 in the new"):
        plan.reshard_runs(other, 0)
    with pytest.raises(ValueError, match="the old plan has 2 parameters, the new plan 3"):
        plan.reshard_runs(_C.ShardPlan([5, 3], 4, 2), 0)


def shards_from(plan, values):
    """Every rank's shard of `values` (one flat tensor per parameter) through param_shard; padding 0."""
    out = []
    for r in range(plan.world):
        shard = torch.zeros(plan.shard_numel, dtype=torch.float64)
        for i, v in enumerate(values):
            local, off, n = plan.param_shard(i, r)
            shard[local:local + n] = v[off:off + n]
        out.append(shard)
    return out


def test_reshard_by_simulation():
    rng = random.Random(7)
    for _ in range(150):
        a = random_args(rng)
        b = random_args(rng, n=len(a["numel"]))
        b["numel"] = a["numel"]
        old, new = make(a), make(b)
        g = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
        values = [torch.rand(n, dtype=torch.float64, generator=g) + 1 for n in a["numel"]]  # never 0
        old_shards, want = shards_from(old, values), shards_from(new, values)
        for r in range(new.world):
            runs = new.reshard_runs(old, r)
            got = torch.zeros(new.shard_numel, dtype=torch.float64)
            writes = torch.zeros(new.shard_numel, dtype=torch.int64)
            for q, oo, no, n in runs:
                got[no:no + n] = old_shards[q][oo:oo + n]
                writes[no:no + n] += 1
            assert torch.equal(got, want[r]), (a, b, r)
            assert torch.equal(writes, (want[r] != 0).long()), (a, b, r)  # non-padding once, padding never
            assert [run[2] for run in runs] == sorted(run[2] for run in runs)
            for q in range(old.world):
                mine = sorted((run for run in runs if run[0] == q), key=lambda run: run[1])
                assert new.reshard_runs(old, r, old_rank=q) == mine
                assert new.reshard_runs(old, new_rank=r, old_rank=q) == mine


def test_reshard_reads_byte_ranges_of_shard_files(tmp_path):
    """A world-3 bf16 checkpoint read by world 2 with another order, caps and alignment: each new
    rank reads, from each old rank's file, only the byte ranges its runs name."""
    numel = [5, 0, 300, 17, 64, 1, 129]
    old = _C.ShardPlan(numel, 2, 3, align=8, first_cap_bytes=100, cap_bytes=300)
    new = _C.ShardPlan(numel, 2, 2, order=[3, 0, 6, 1, 2, 5, 4], align=2, first_cap_bytes=50, cap_bytes=1000)
    g = torch.Generator().manual_seed(3)
    values = [torch.randn(n, generator=g).to(torch.bfloat16) for n in numel]
    for q, shard in enumerate(shards_from(old, [v.double() for v in values])):
        (tmp_path / f"shard_{q}.bin").write_bytes(shard.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
    for r, want in enumerate(shards_from(new, [v.double() for v in values])):
        got = torch.zeros(new.shard_numel, dtype=torch.bfloat16)
        for q in range(old.world):
            with open(tmp_path / f"shard_{q}.bin", "rb") as f:
                for _, oo, no, n in new.reshard_runs(old, r, old_rank=q):
                    f.seek(oo * 2)
                    raw = bytearray(f.read(n * 2))
                    got[no:no + n] = torch.frombuffer(raw, dtype=torch.bfloat16)
        assert torch.equal(got, want.to(torch.bfloat16))


def test_layout_views_over_mixed_dtypes():
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(dt) for s, dt in
              [((4, 3), torch.float32), ((5,), torch.bfloat16), ((0,), torch.float32), ((33,), torch.float32),
               ((2, 2), torch.bfloat16)]]
    world = 3
    layouts = [ShardLayout.from_params(params, world, r, align=4, first_cap_bytes=40, cap_bytes=64)
               for r in range(world)]
    assert len(layouts[0]) == 2
    f32, bf16 = layouts[0].groups
    assert (f32.indices, bf16.indices) == ([0, 2, 3], [1, 4])
    assert f32.plan.order == (2, 1, 0) and f32.plan.esize == 4 and bf16.plan.esize == 2
    for gi in range(2):
        groups = [lay.groups[gi] for lay in layouts]
        plan = groups[0].plan
        members = [params[j] for j in groups[0].indices]
        for grp in groups:
            grp.load_shard(members)
        for i, p in enumerate(members):  # the owned views hold every element of every parameter once
            flat = torch.zeros(p.numel(), dtype=p.dtype)
            count = torch.zeros(p.numel(), dtype=torch.int64)
            for grp in groups:
                part = grp.owned[i]
                if part is not None:
                    assert part.view.untyped_storage().data_ptr() == grp.shard.untyped_storage().data_ptr()
                    flat[part.param_offset:part.param_offset + part.view.numel()] = part.view
                    count[part.param_offset:part.param_offset + part.view.numel()] += 1
            assert torch.equal(flat, p.reshape(-1)) and bool((count == 1).all())
        # the full buffer assembled bucket by bucket from every rank's chunk holds every parameter
        full = torch.zeros(plan.total, dtype=groups[0].dtype)
        for grp in groups:
            for (chunk, bucket), (start, c, local, _, _) in zip(grp.bucket_views(grp.shard, full), plan.buckets()):
                assert chunk.numel() == c and bucket.numel() == world * c
                bucket[grp.rank * c:(grp.rank + 1) * c] = chunk
        for view, p in zip(groups[0].param_views(full), members):
            assert view.shape == p.shape and torch.equal(view, p)
    # a given order is each group's placement order
    lay = ShardLayout.from_params(params, 2, 0, order=[3, 1, 0, 4, 2])  # fp32 [0, 2, 3]: 3, 0, 2; bf16 [1, 4]: 1, 4
    assert [grp.plan.order for grp in lay] == [(2, 0, 1), (0, 1)]
    with pytest.raises(ValueError, match="order must be a permutation"):
        ShardLayout.from_params(params, 2, 0, order=[0, 0, 1, 2, 3])
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        ShardLayout.from_params(params, 2, 2)
    with pytest.raises(ValueError, match="shard must be 1-D"):
        f32.owned_views(torch.zeros(f32.plan.shard_numel + 1))


@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_and_all_gather_on_gloo_processes(world):
    """tests/scripts/shard_collectives.py: per dtype group, the bucket-by-bucket reduce-scatter of
    every rank's gradients leaves each rank the mean at param_shard's positions (padding zero),
    and the bucket-by-bucket all-gather of the stepped shards rebuilds every parameter; the
    chunk collectives (2 processes: all-reduce; 3: one reduce per rank) against torch's."""
    res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "shard_collectives.py")], timeout=wait_s(60))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"shard collectives OK on {world} processes" in res.stdout
