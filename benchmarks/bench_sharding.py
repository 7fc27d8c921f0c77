"""ZeRO on CPU processes: memory per rank and training-step throughput of accelerate_c's DDP,
ZeRO-1, ZeRO-2 and ZeRO-3 (full sharding) beside torch's ZeroRedundancyOptimizer + DDP and torch's
FSDP2, AdamW (foreach=False: see adamw()), 2 and 4 processes (accelerate_c's contenders over shared
memory, its default on one host; --comm gloo puts them on gloo, where torch's contenders are).
Two configurations by default (--configs): Sharding I's ~100M-parameter GPT in fp32, and
Sharding II's ~100M-parameter Llama-shaped model (transformers' LlamaForCausalLM: RMSNorm, rotary,
SwiGLU, untied head) in bf16 as accelerate runs it (autocast for DDP and torch's contenders,
DeepSpeed's bf16 model with fp32 masters at stages 1-2, FSDP2's bf16 policy for zero3 and
torch_fsdp2); vocabulary 8192 for both, so the embedding is a small part of the model.

    .venv/bin/python benchmarks/bench_sharding.py                  # both configs, 2 and 4 processes
    .venv/bin/python benchmarks/bench_sharding.py --worlds 2 --repeats 2 --steps 2 --configs llama:bf16

It launches itself once per world size and contender (`accelerate-c launch --num_processes N
--cpu`, one OpenMP thread per process): each contender runs in processes of its own, so none
inherits another's heap (four processes of this model in one heap each ran this 24 GiB machine
out of memory). Contenders, each built fresh from the same seed for every repeat, on the same
per-rank batches (rank r of step k: global batch k * N + r):

  ddp          accelerate_c's Accelerator(cpu=True): bucketed all-reduce, torch's AdamW
  zero1        Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1, gradient_clipping=0))
  zero2        the same with zero_stage=2
  torch_zero   torch DDP (gradient_as_bucket_view) + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
  zero3        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, TRANSFORMER_BASED_WRAP of
               Block / LlamaDecoderLayer)): full sharding, each block a unit, the next unit's gather prefetched
  zero3_noprefetch  the same with prefetch off (what the prefetch buys, reported without a target)
  torch_fsdp2  torch's fully_shard on each block and the model (FSDP2, a CPU device mesh over gloo); whether
               its gradients come out averaged or summed across the processes (pytorch issue 162338) is
               checked in the same run against the processes' averaged gradients and printed beside it

Per contender and world size:
  counted bytes  from the tensors the rank holds: parameters, gradients (the flat buffers, the
                 ZeRO-2 gradient shard; torch's `.grad`), optimizer state (Adam's moments), against
                 the formula for Ψ elements and N processes: DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ +
                 12Ψ/N, ZeRO-3 16Ψ/N; in bf16 ZeRO-1 4Ψ + 12Ψ/N and ZeRO-2 2Ψ + 14Ψ/N (16-bit model
                 and gradients), the others as in fp32 (ours: distinct storages counted) (torch_zero's optimizer state is sharded by whole parameters: its
                 formula is ZeRO-1's, reported only; torch_fsdp2's is ZeRO-3's). ZeRO-2's staging buffers (about two buckets) are printed apart.
  RSS            the rank's peak resident set while the contender ran (VmHWM, reset before it) above
                 its resident set just before it: what the process really took, torch's temporaries
                 and the allocator included.
  steps/s        median over --repeats of (timed steps / the slowest rank's time), a step being
                 forward + backward + optimizer step + zero_grad, after --warmup untimed steps.
The physical limit printed beside: one gloo all-reduce of the gradients' bytes, timed alone (the
communication a DDP step cannot avoid, at loopback speed on this machine).

Correctness guard (the first repeat): after the same steps, what each contender's training moved
the weights by (final - initial, every contender starting from the same seed's weights) against
what ddp's moved them by, over the whole model ||a - b|| / ||b||, must be <= 1e-2 in fp32, 0.25 in
bf16 (DISP_RTOL says why); a contender whose weights are bf16 (zero1/zero2 under bf16) may also
differ by the rounding of its stored weights (STORE_ROUNDING). A contender that never steps is off
by about 1. (AdamW's first steps move an element by ~lr whatever its gradient's size, so rounding
noise in a near-zero gradient is amplified to lr: per tensor, a LayerNorm bias that started at 0
differs by 7.3e-4 of itself between torch DDP and ours on 4 processes.) A mismatch is an ERROR.

Targets: counted bytes within 5% of the formula (plus padding) for ddp, zero1, zero2 and zero3 (its
gathered unit and one unit's gradient staging printed apart); zero1 steps/s >= 0.95x ddp and
>= 1.0x torch_zero; zero3 steps/s >= 1.0x torch_fsdp2.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import json
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _targets  # noqa: E402
from _common import print_table  # noqa: E402

BENCH = "bench_sharding"
NAMES = ["ddp", "zero1", "zero2", "torch_zero", "zero3", "zero3_noprefetch", "torch_fsdp2"]
SEED, DATA_SEED = 1234, 4321
# The correctness guard (below), per precision: ||moved - ddp's moved|| / ||ddp's moved||, where
# moved = final - initial weights. A contender that does not step is off by 1 (the bf16-stored
# zero1/zero2 by less: their storage rounding, STORE_ROUNDING, absorbs part of it; 0.61 measured),
# one at half the learning rate by 0.5. What a correct contender may be off by: AdamW's first
# updates are +-lr per element (m/sqrt(v) is the gradient's sign at the first step), so two correct
# runs move an element alike unless a rounding flips the sign of its (near-zero) gradient, and a
# flipped element is off by twice its own displacement: the error is about 2 sqrt(p), p the share
# of flipped elements (the table prints it). In fp32 a flip needs a gradient within fp32 roundings
# (2**-24 of its terms) of zero: 1e-2 admits p up to 2.5e-5 (measured: 0, bit for bit, on 2
# processes; the old bound, 1e-4 of the weights' norm, was 1.2% of what the training moved them
# by in gpt 2 x 192 over 3 steps: about as strict).
# In bf16 the policies round the forward and the gradients to 2**-8 of their terms (autocast over
# fp32 weights for ddp, DeepSpeed's bf16 model at stages 1-2, bf16 gathers and reduce-scatter for
# zero3 and torch's FSDP2): 0.25 admits p up to 1.6%. Measured (2 processes, llama 2 x 192, 3
# steps): torch's own FSDP2 is 0.047 from ddp (0.15% of the elements flipped), zero3 the same
# 0.047, zero1/zero2 0.026 (0.05%). The old bf16 guard, 1e-2 of the weights' norm, passed a zero1, zero2
# or zero3 that never stepped (6.1e-3 and 6.3e-3 measured): a few steps of lr 1e-4 move weights of
# ~0.02 (and RMSNorm's 1.0) by less than 1% of their norm.
DISP_RTOL = {"fp32": 1e-2, "bf16": 0.25}
STORE_ROUNDING = 2.0 ** -8  # half a bf16 ulp, relative to the value, at its widest
MEM_TOL = 0.05


def launch(world: int, argv) -> int:
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable)) or shutil.which("accelerate-c")
    cmd = [exe, "launch", "--num_processes", str(world), "--cpu", "--main_process_port", "0",
           os.path.abspath(__file__), "--worker", *argv]
    print("launching: " + " ".join(cmd), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return subprocess.call(cmd, env=env)


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def worker(args) -> int:  # noqa: C901 (one linear script)
    import torch
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import accelerate_c.state
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin
    from accelerate_c import Accelerator
    from accelerate_c.utils import CpuCommKwargs
    from models import GPT, GPTConfig, make_tokens

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=8192, block_size=args.seq, n_layer=args.layers, n_head=12, d_model=args.d_model)
    bf16 = args.precision == "bf16"
    block_class = "LlamaDecoderLayer" if args.model == "llama" else "Block"
    total_steps = args.warmup + args.steps
    tokens = make_tokens(total_steps * world, args.seq, cfg.vocab_size, seed=DATA_SEED)  # seq + 1 tokens each
    batches = [(tokens[k * world + rank][None, :-1], tokens[k * world + rank][None, 1:]) for k in range(total_steps)]

    def say(*a):
        if rank == 0:
            print(*a, flush=True)

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def fresh():
        torch.manual_seed(SEED)
        if args.model == "gpt":
            return GPT(cfg)
        from transformers import LlamaConfig, LlamaForCausalLM

        # Llama-shaped: RMSNorm, rotary positions, SwiGLU MLP (8/3 of the width), untied head
        lcfg = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=args.d_model, num_hidden_layers=args.layers,
                           num_attention_heads=12, num_key_value_heads=12, intermediate_size=8 * args.d_model // 3,
                           max_position_embeddings=args.seq, tie_word_embeddings=False)
        return LlamaForCausalLM(lcfg)

    def loss_of(model, x, y):
        if args.model == "gpt":
            return model(x, y)
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def autocast():  # what accelerate's bf16 gives the torch contenders' forward (and ours)
        return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    # foreach=False for every contender: torch's multi-tensor AdamW makes whole-model temporaries
    # (~4 x the parameters' bytes at once), which on 4 processes of a ~100M model exceed this
    # machine's 24 GiB (measured: the OOM killer at 6 GB per process)
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=False)

    def build(name):
        accelerate_c.state.AcceleratorState._reset_state()  # a fresh Accelerator per contender
        accelerate_c.state.GradientState._reset_state()
        model = fresh()
        if name == "torch_fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh("cpu", (world,))
            # accelerate's FSDP2 bf16: gathers, compute and reduce-scatter in bf16, fp32 shards
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 \
                else MixedPrecisionPolicy()
            for m in model.modules():
                if type(m).__name__ == block_class:
                    fully_shard(m, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
            return {"model": model, "inner": model, "opt": adamw(model.parameters()),
                    "backward": lambda loss: loss.backward(), "acc": None, "fsdp2": True}
        if name == "torch_zero":
            ddp = DDP(model, gradient_as_bucket_view=True)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4,
                                          weight_decay=0.01, foreach=False)
            return {"model": ddp, "inner": model, "opt": opt, "backward": lambda loss: loss.backward(), "acc": None}
        kw = {"kwargs_handlers": [CpuCommKwargs(comm=args.comm)], "mixed_precision": args.precision.replace("fp32", "no")}
        if name.startswith("zero3"):
            kw["fsdp_plugin"] = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="TRANSFORMER_BASED_WRAP",
                                                               transformer_cls_names_to_wrap=[block_class])
        elif name != "ddp":
            plugin = DeepSpeedPlugin(zero_stage=int(name[-1]), gradient_clipping=0.0)
            plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
            kw["deepspeed_plugin"] = plugin
        acc = Accelerator(cpu=True, **kw)
        model, opt = acc.prepare(model, adamw(model.parameters()))
        if name == "zero3_noprefetch":
            acc._grads.strategy.prefetch = False
        return {"model": model, "inner": model, "opt": opt, "backward": acc.backward, "acc": acc}

    def step(c, x, y):
        if c["acc"] is None:
            with autocast():
                loss = loss_of(c["model"], x, y)
        else:  # the Accelerator applies its own precision policy
            loss = loss_of(c["model"], x, y)
        c["backward"](loss)
        c["opt"].step()
        c["opt"].zero_grad()

    def counted(c):
        """(bytes held, ZeRO-2 staging bytes) on this rank."""
        inner, opt, acc = c["inner"], c["opt"], c["acc"]
        params = {id(p): p for p in inner.parameters() if p.requires_grad}
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        staging = 0
        if c.get("fsdp2"):  # torch FSDP2: DTensor shards of the parameters, their gradients, the state
            local = [p.to_local() for p in params.values()]
            pbytes = sum(t.numel() * t.element_size() for t in local)
            gbytes = pbytes  # after zero_grad(set_to_none) none are held; while stepping, one shard each
            state = {k: {kk: (vv.to_local() if hasattr(vv, "to_local") else vv) for kk, vv in v.items()}
                     for k, v in opt.state.items()}
        elif acc is None:  # torch: DDP's buckets (the .grad views of gradient_as_bucket_view, kept by
            # its reducer whether .grad is set or not), the local optimizer's state
            gbytes = pbytes
            state = opt.optim.state
        else:  # ours: the distinct storages of the parameters, the gradient buffers, the optimizer's
            # parameters (the fp32 masters where they are apart from the model's) and its state;
            # under full sharding a parameter between steps is a view of its unit's shard
            strategy = acc._grads.strategy
            storages = {}
            tensors = list(params.values()) + [g.flat for g in acc._grads.groups]
            tensors += [p for g in opt.optimizer.param_groups for p in g["params"]]
            tensors += [v for s in opt.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
            for t in tensors:
                st = t.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
            held = sum(storages.values())
            if hasattr(strategy, "memory"):
                mem = strategy.memory()
                held += mem["grad_shards"]
                staging = mem["grad_staging"]
            return held, staging
        sbytes = sum(v.numel() * v.element_size() for s in state.values() for k, v in s.items()
                     if torch.is_tensor(v) and v.dim() > 0)
        return pbytes + gbytes + sbytes, staging

    def fsdp2_grad_factor(c, batch):
        """torch FSDP2's gradient of one backward over the processes' first batches, against the
        average of every process's plain gradient (torch.autograd on an unsharded copy, summed by
        one all-reduce, / N): about 1.0 if it averages, N if it sums (pytorch issue 162338)."""
        c["opt"].zero_grad()
        with autocast():
            loss = loss_of(c["model"], *batch)
        loss.backward()
        got = torch.cat([p.grad.full_tensor().reshape(-1) for p in c["inner"].parameters()])
        c["opt"].zero_grad()
        plain = fresh()
        sd = {n: p.full_tensor() for n, p in c["inner"].named_parameters()}
        plain.load_state_dict(sd, strict=False)
        with autocast():
            loss = loss_of(plain, *batch)
        loss.backward()
        want = torch.cat([p.grad.reshape(-1) for p in plain.parameters()])
        dist.all_reduce(want)
        want /= world
        return float(got.norm() / want.norm())

    psi = sum(p.numel() for p in fresh().parameters())
    formula = {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / world, "zero2": 4 * psi + 12 * psi / world,
               "torch_zero": 8 * psi + 8 * psi / world, "zero3": 16 * psi / world, "torch_fsdp2": 16 * psi / world}
    if bf16:  # DeepSpeed's bf16 policy at stages 1 and 2: a bf16 model and gradients, fp32 masters of the
        # owned runs (docs/sharding.md); DDP and torch's contenders under autocast keep fp32 parameters
        # and gradients; FSDP2's bf16 keeps fp32 shards and fp32 gradient shards
        formula.update(zero1=4 * psi + 12 * psi / world, zero2=2 * psi + 14 * psi / world)
    formula["zero3_noprefetch"] = formula["zero3"]
    say(f"bench_sharding on {world} processes: {args.model} {args.layers} x {args.d_model}, vocab {cfg.vocab_size}, "
        f"{psi / 1e6:.1f}M parameters, {args.seq} tokens per rank and step, AdamW, {args.precision}, "
        "1 thread per process")

    name = args.contender
    result = {"world": world, "psi": psi, "formula": formula}
    if name == "ddp":  # the physical limit: one all-reduce of the gradients' bytes, alone
        buf = torch.zeros(psi, dtype=torch.float32)
        times = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(slowest(time.perf_counter() - t0))
        result["allreduce_s"] = statistics.median(times)
        del buf
        gc.collect()
    rates = []
    for r in range(args.repeats):
        gc.collect()
        rss0 = _rss_kb("VmRSS")
        _reset_peak()
        c = build(name)
        for k in range(args.warmup):
            step(c, *batches[k])
        dist.barrier()
        gc.disable()
        t0 = time.perf_counter()
        for k in range(args.warmup, total_steps):
            step(c, *batches[k])
        elapsed = slowest(time.perf_counter() - t0)
        gc.enable()
        rates.append(args.steps / elapsed)
        if r == 0:
            held, staging = counted(c)
            result["mem"] = (held, staging, (_rss_kb("VmHWM") - rss0) * 1024)
            if name.startswith("zero3"):  # each process holds shards: the whole weights gathered to the main
                # process ({} on the others, as accelerate's FSDP2 get_state_dict), then broadcast one
                # tensor at a time (a pickled state dict through broadcast_object_list took ~7 GB of
                # host memory per process at 100M parameters and 4 processes: the OOM killer's)
                sd = c["acc"].get_state_dict(c["model"])
                final = []
                for n, p in fresh().named_parameters():  # the logical shapes (the prepared ones are runs)
                    t = sd[n].float().clone() if rank == 0 else torch.empty(p.shape, dtype=torch.float32)
                    dist.broadcast(t, src=0)
                    final.append(t)
                del sd
            elif c.get("fsdp2"):
                final = [p.full_tensor().detach().clone() for p in c["inner"].parameters()]
                result["fsdp2_grad_factor"] = fsdp2_grad_factor(c, batches[0])
            else:
                final = [p.detach().clone() for p in c["inner"].parameters()]
            # what the training moved: the final weights less the initial ones (every contender starts
            # from fresh()'s, the same seed), in float64
            init = dict(fresh().named_parameters())
            names = [n for n, _ in c["inner"].named_parameters()]
            moved = [f.double() - init[n].detach().double() for f, n in zip(final, names)]
            # a contender whose weights are kept in 16 bits (zero1/zero2 under bf16: DeepSpeed's bf16
            # model; its fp32 masters are not what the model holds) rounds the initial weights once
            # (the cast at prepare) and the final ones once: half a bf16 ulp each, at most 2**-8 of
            # each magnitude, which its displacement may differ by on top of the bound
            stored16 = any(f.dtype in (torch.bfloat16, torch.float16) for f in final)
            slack = [STORE_ROUNDING * (f.double().abs() + init[n].detach().double().abs()) if stored16 else None
                     for f, n in zip(final, names)]
            del init
            ref_path = os.path.join(args.out, f"ddp_rank{rank}.pt")
            if name == "ddp":
                torch.save(moved, ref_path)
            else:
                ref = torch.load(ref_path)
                # over the whole model, relative to how far ddp moved it: a contender that did not
                # step is off by 1 whatever the weights' size (DISP_RTOL says why the bound is what it is)
                diff = 0.0
                for a, b, r in zip(moved, ref, slack):
                    d = (a - b).abs()
                    if r is not None:
                        d = (d - r).clamp_min(0.0)
                    diff += float(d.square().sum())
                err = (diff / sum(float(b.square().sum()) for b in ref)) ** 0.5
                result["error"] = slowest(err)
                # the share of elements moved the other way than ddp moved them, beyond the storage
                # rounding (DISP_RTOL)
                flips = sum(int((((a * b) < 0) & ((a - b).abs() > (r if r is not None else 0.0))).sum())
                            for a, b, r in zip(moved, ref, slack)) / sum(b.numel() for b in ref)
                result["flipped"] = slowest(flips)
                del ref
        del c
        gc.collect()
    result["rates"] = rates
    if rank == 0:
        with open(os.path.join(args.out, f"{name}.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(out: str, config: str, names=NAMES) -> int:
    """The table and the targets of one world size and configuration (model:precision), from the
    result files of the contenders that ran (`names`: ddp and the ones --only chose); a target
    whose contenders did not all run is left out."""
    res = {}
    for n in names:
        path = os.path.join(out, f"{n}.json")
        if not os.path.isfile(path):
            print(f"ERROR: {n} left no result (it failed: see above)")
            return 1
        with open(path) as f:
            res[n] = json.load(f)
    world, psi, formula = res["ddp"]["world"], res["ddp"]["psi"], res["ddp"]["formula"]
    rtol = DISP_RTOL[config.split(":")[1]]
    tag = f"{config}, N={world}"
    med = {n: statistics.median(r["rates"]) for n, r in res.items()}
    rows = []
    for n in names:
        held, staging, peak = res[n]["mem"]
        if n == "torch_fsdp2":
            n_label = f"torch_fsdp2 (grads x{res[n]['fsdp2_grad_factor']:.2f} of the average)"
        else:
            n_label = n
        rows.append([n_label, f"{med[n]:.3f}", f"{held / 2**20:.0f}", f"{formula[n] / 2**20:.0f}",
                     f"{held / formula[n]:.3f}", f"{staging / 2**20:.0f}", f"{peak / 2**20:.0f}",
                     "-" if n == "ddp" else f"{res[n]['error']:.1e} ({res[n]['flipped']:.2%} flipped)"])
    print(f"\nbench_sharding, {tag}:")
    print_table(["contender", "steps/s", "counted MiB", "formula MiB", "counted/formula", "staging MiB",
                 "peak RSS above start MiB", "moved vs ddp"], rows)
    allreduce_s, ddp_s = res["ddp"]["allreduce_s"], 1 / med["ddp"]
    print(f"limit: one all-reduce of the {4 * psi / 2**20:.0f} MiB of gradients alone takes {allreduce_s:.2f} s "
          f"(gloo, loopback) = {allreduce_s / ddp_s:.0%} of a ddp step ({ddp_s:.2f} s)")
    for n in names:
        print(f"{n}: steps/s over the repeats {', '.join(f'{v:.3f}' for v in res[n]['rates'])}")
    # torch_fsdp2 summing its gradients (a known torch bug on gloo) would show here too: reported, not an error
    bad = [n for n in names if n not in ("ddp", "torch_fsdp2") and res[n]["error"] > rtol]
    if bad:
        print(f"ERROR: {', '.join(bad)}: what the training moved differs from ddp's by more than {rtol} of it: "
              "timings not recorded")
        return 1
    limit = f"all-reduce of the gradients {allreduce_s:.2f} s vs ddp step {ddp_s:.2f} s"
    for n in (n for n in ("ddp", "zero1", "zero2", "zero3") if n in res):
        held = res[n]["mem"][0]
        pad = 4 * 64 * world * 64  # each bucket's padding to N x 16 fp32 elements, a few dozen buckets
        within = abs(held - formula[n]) <= MEM_TOL * formula[n] + pad
        _targets.target(BENCH, f"{n} counted bytes vs formula, |1 - ratio| <= 0.05 ({tag})",
                        1.0 - abs(1.0 - held / formula[n]), 1.0 - MEM_TOL,
                        note=f"{held} bytes held, formula {formula[n]:.0f}, {'within' if within else 'beyond'} 5% + padding")
    if "zero1" in res:
        _targets.target(BENCH, f"zero1 steps/s vs our ddp ({tag})", med["zero1"] / med["ddp"], 0.95, limit=limit)
    if "zero1" in res and "torch_zero" in res:
        _targets.target(BENCH, f"zero1 steps/s vs torch ZeroRedundancyOptimizer ({tag})",
                        med["zero1"] / med["torch_zero"], 1.0, limit=limit)
    if "zero2" in res:
        _targets.info(BENCH, f"zero2 steps/s vs our ddp ({tag})", med["zero2"] / med["ddp"], limit=limit)
        _targets.info(BENCH, f"zero2 counted bytes / ddp's ({tag})", res["zero2"]["mem"][0] / res["ddp"]["mem"][0])
    if "zero3" in res and "torch_fsdp2" in res:
        _targets.target(BENCH, f"zero3 steps/s vs torch FSDP2 fully_shard ({tag})",
                        med["zero3"] / med["torch_fsdp2"], 1.0, limit=limit,
                        note=f"torch FSDP2's gradients came out x{res['torch_fsdp2']['fsdp2_grad_factor']:.2f} "
                        "of the processes' average (1: averaged, N: summed)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="2,4", help="process counts, comma-separated (default 2,4)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--seq", type=int, default=64, help="tokens per rank and step")
    ap.add_argument("--comm", choices=("auto", "gloo", "shm"), default="auto",
                    help="how accelerate_c's contenders' CPU collectives travel (CpuCommKwargs; default: the "
                         "library's, shared memory on one host; torch_zero is on gloo, torch's only CPU backend)")
    ap.add_argument("--configs", default="gpt:fp32,llama:bf16",
                    help="model:precision pairs, comma-separated (models gpt, llama; precisions fp32, bf16; "
                         "default: Sharding I's fp32 GPT and Sharding II's bf16 Llama)")
    ap.add_argument("--only", default=None,
                    help="contenders to run besides ddp (the reference every row is held to), comma-separated "
                         f"from {', '.join(n for n in NAMES if n != 'ddp')} (default: all); targets whose "
                         "contenders did not run are left out")
    ap.add_argument("--contender", choices=NAMES, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=("gpt", "llama"), default="gpt", help=argparse.SUPPRESS)
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        model, _, precision = c.partition(":")
        if model not in ("gpt", "llama") or precision not in ("fp32", "bf16"):
            ap.error(f"--configs: {c!r} is not model:precision with model gpt|llama and precision fp32|bf16")
    names = NAMES
    if args.only:
        chosen = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(chosen - set(NAMES))
        if unknown:
            ap.error(f"--only: unknown contender(s) {', '.join(unknown)}; choose from {', '.join(NAMES)}")
        names = tuple(n for n in NAMES if n == "ddp" or n in chosen)
    rc = 0
    for config in configs:
        model, _, precision = config.partition(":")
        forward = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--layers", str(args.layers), "--d-model", str(args.d_model), "--seq", str(args.seq),
                   "--comm", args.comm, "--model", model, "--precision", precision]
        for w in (int(x) for x in args.worlds.split(",")):
            with tempfile.TemporaryDirectory(prefix="bench_sharding_") as out:
                for name in names:  # each contender in processes of its own: none inherits another's heap
                    rc = max(rc, launch(w, forward + ["--contender", name, "--out", out]))
                rc = max(rc, report(out, config, names))
    return rc


if __name__ == "__main__":
    sys.exit(main())
