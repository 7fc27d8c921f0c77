"""Random training configurations for the differential harness.

A case is a plain dict drawn from one integer seed, so a failing case is replayed from its seed
alone (`python tests/differential/run.py --replay SEED`). Each key is one axis; `draw` keeps the
combinations a user could write (e.g. comm hooks only with several processes). A new capability
(a sharding strategy, a collective backend) becomes a new key here and a branch in subject.py,
with its reference in reference.py.
"""
from __future__ import annotations

import os
import random

WORLD_SIZES = (1, 2, 3)
PARAM_DTYPES = ("fp32", "bf16", "mixed")  # mixed: the middle layer in bf16, the rest fp32
MIXED_PRECISIONS = ("no", "bf16", "fp16")
CLIPS = ("none", "norm2", "norminf", "value")
COMM_HOOKS = ("no", "fp16", "bf16")
ZERO_GRADS = ("opt_none", "opt_zeros", "model", "manual_none")
SYNC_STYLES = ("accumulate", "no_sync")
OPTIMIZERS = ("sgd", "sgd_momentum", "adamw")
ADAM_KINDS = ("adamw", "adam_l2", "adamw_maximize", "adamw_amsgrad")
SHARDINGS = ("none", "zero1", "zero2", "fsdp", "zero3")
FSDP_WRAPS = ("NO_WRAP", "SIZE_BASED_WRAP", "TRANSFORMER_BASED_WRAP")
# DeepSpeed stage 3's (stage3_prefetch_bucket_size, stage3_param_persistence_threshold): its
# defaults (one unit, every parameter of these tiny models persistent), units of >= 50 elements
# with none persistent, and with the small parameters (biases) persistent
ZERO3_UNITS = ((50_000_000, 100_000), (50, 0), (50, 20))


def draw(seed: int, world: int | None = None, sharding: str | None = None, resume: bool = False) -> dict:
    """The case of `seed` (for `world` processes and the `sharding` strategy when given, else
    drawn too; a sharding needs several processes and even inputs, and is "none" otherwise).

    The world size is always drawn, then overridden: the draws after it do not depend on whether
    `world` was given, so `--replay SEED --world W` (the command a failure prints) is the case
    the soak ran whenever W is the world size it drew."""
    r = random.Random(seed)
    c: dict = {"seed": seed}
    drawn = r.choice(WORLD_SIZES)
    c["world"] = world if world is not None else drawn
    c["param_dtype"] = r.choice(PARAM_DTYPES)
    c["mp"] = r.choice(MIXED_PRECISIONS)
    c["ga"] = r.randint(1, 4)
    # batches per process: often not a multiple of ga, so the loader ends mid-window
    c["batch_size"] = r.choice((2, 3, 4))
    c["batches"] = r.randint(2, 8)
    c["dataset_extra"] = r.randint(0, c["batch_size"] * c["world"] - 1)  # a ragged last batch
    c["clip"] = r.choice(CLIPS)
    c["max_norm"] = r.choice((0.05, 0.5, 100.0))  # clips hard, sometimes, never
    c["clip_subset"] = r.random() < 0.2  # clip part of the parameters (part of a flat buffer)
    c["unscale_first"] = r.random() < 0.3
    c["clip_twice"] = r.random() < 0.2
    c["comm_hook"] = r.choice(COMM_HOOKS) if c["world"] > 1 else "no"
    c["tiny_buckets"] = r.random() < 0.5
    c["unused"] = r.random() < 0.25  # a layer that never takes part (find_unused_parameters)
    c["frozen"] = r.random() < 0.25
    c["zero_grad"] = r.choice(ZERO_GRADS)
    c["assign_grad"] = r.random() < 0.15  # a .grad assigned between backward and the step
    c["two_models"] = r.random() < 0.2
    c["sync_style"] = r.choice(SYNC_STYLES)
    # Adam's update is g / sqrt(v): the sign of a near-zero gradient decides a whole step, so
    # 16-bit rounding noise (summation order of a 16-bit wire or an autocast forward) would be
    # amplified past any tolerance that still catches bugs; Adam is drawn with fp32 end to end
    exact = c["param_dtype"] == "fp32" and c["mp"] == "no" and c["comm_hook"] == "no"
    c["optimizer"] = r.choice(OPTIMIZERS) if exact else r.choice(OPTIMIZERS[:2])
    # two optimizers over halves of the parameters, each covering part of a flat buffer. Not
    # with fp16: accelerate updates the loss scale in every optimizer's step, and torch's
    # GradScaler then unscales the second optimizer's gradients again (its per-optimizer state
    # ends at update()); accelerate_c unscales each gradient once, so there is no torch loop
    # that computes what it does
    c["two_optimizers"] = c["mp"] != "fp16" and r.random() < 0.15
    c["skip_first"] = r.choice((0, 0, 1, 2))
    c["epochs"] = r.choice((1, 1, 2))
    # reentrant activation checkpointing: a weight used by two segments ("shared": torch DDP
    # refuses it without static_graph, so one process only), or a segment per layer with the
    # output layer inside one ("separate": the first gradients arrive in a nested backward)
    # (torch DDP refuses reentrant checkpointing with find_unused_parameters, and under Join)
    c["reentrant"] = False
    if r.random() < 0.2:
        c["reentrant"] = "shared" if c["world"] == 1 else "separate"
    if c["reentrant"] == "separate" and (c["unused"] or c["frozen"]):
        # a frozen first layer leaves the segments' inputs without grad, and a reentrant
        # segment whose inputs need no grad gives its weights none (torch's own rule)
        c["reentrant"] = False
    # non-finite values: an overflowing loss on one rank (fp16 must skip that step everywhere),
    # or a NaN gradient after backward (clipping must propagate it as torch does)
    # (drawn within the batches left after skip_first and the steps they make)
    left = max(1, c["batches"] - c["skip_first"])
    c["overflow"] = None
    if c["mp"] == "fp16" and r.random() < 0.4:
        c["overflow"] = (r.randrange(c["world"]), r.randrange(left))
    # under fp16 a NaN gradient must skip the step (and back the scale off) as GradScaler does
    c["nan_grad_step"] = r.randrange(max(1, left // c["ga"])) if r.random() < 0.1 else None
    c["eval"] = r.random() < 0.5
    c["eval_skip"] = r.choice((0, 0, 1)) if c["eval"] else 0  # evaluation resumed past its first batch
    # uneven inputs: even_batches=False, the loop inside join_uneven_inputs (torch's Join). The
    # reference is torch DDP under Join, which itself mismatches its collectives under no_sync
    # accumulation and with two DDP models in one loss: one model, a step per batch
    c["uneven"] = c["world"] > 1 and r.random() < 0.2
    if c["uneven"]:
        c["epochs"], c["skip_first"], c["eval"], c["eval_skip"] = 1, 0, False, 0
        c["ga"], c["two_models"] = 1, False
        c["reentrant"] = False
        c["dataset_extra"] = max(1, c["dataset_extra"])  # some ranks get a batch more
    # sharding (drawn last, so every earlier axis of a seed stays what it was): ZeRO stage 1
    # through DeepSpeedPlugin, as a user turns it on; its reference is the same torch DDP run, or
    # under bf16/fp16 DeepSpeed's policy in torch (reference_ds.py: a 16-bit model, fp32 masters,
    # DeepSpeed's loss scaler). Not under join_uneven_inputs (accelerate's join does nothing under
    # DeepSpeed, and the processes that ran out would miss the all-gathers)
    drawn = r.choice(SHARDINGS)
    c["sharding"] = (drawn if sharding is None else sharding) if c["world"] > 1 else "none"
    if c["uneven"]:
        c["sharding"] = "none"
    if c["sharding"] == "fsdp":
        # full sharding (FSDP2's semantics, through accelerate's FullyShardedDataParallelPlugin):
        # fp32 or bf16 (drawn below; fp16 is refused under FSDP); no full gradient between
        # backward and the step, so no loop writes or NaNs one, and `p.grad = None` has nothing to
        # drop (zero_grad clears the shards); no comm hooks (FSDP has none)
        c["mp"] = "no"
        c["comm_hook"] = "no"
        c["assign_grad"] = False
        c["nan_grad_step"] = None
        c["overflow"] = None
        c["two_optimizers"] = False
        if c["clip"] == "value":
            c["clip"] = "norm2"
        if c["zero_grad"] == "manual_none":
            c["zero_grad"] = "opt_none"
        c["fsdp_wrap"] = r.choice(FSDP_WRAPS)
        c["fsdp_reshard"] = r.random() < 0.7
        # FSDP's own activation checkpointing (each unit recomputed in backward), and the model
        # prepared for evaluation before it is prepared for training (the Trainer's evaluate()
        # before train())
        c["fsdp_ac"] = r.random() < 0.3
        c["eval_first"] = r.random() < 0.3
        # FSDP2's bf16 policy (reference_fsdp.py), in half the cases; Adam is drawn with fp32 end
        # to end only (above: a 16-bit rounding decides the sign of a near-zero update)
        if r.random() < 0.5:
            c["mp"] = "bf16"
            if c["optimizer"] == "adamw":
                c["optimizer"] = "sgd_momentum"
            # one micro-batch per step more often: on two processes the subject and FSDP2's policy
            # then round identically and are held to fp32 roundings (compare.fsdp_exact)
            if r.random() < 0.35:
                c["ga"] = 1
        # a weight tied between two modules of different units (it goes to the root, as a tied
        # embedding and output layer), and a unit mixing frozen and trainable parameters under
        # every wrap policy (the middle layer's bias frozen); not with the model's own reentrant
        # checkpointing, whose segments the tied layer is not in
        c["tied"] = r.random() < 0.3 and not c["reentrant"]
        c["frozen_bias"] = r.random() < 0.3
        # (drawn after the axes above, so a seed's earlier axes stay what they were)
        # a forward whose path leaves out the middle layer on some micro-batches (every
        # `fsdp_skip`-th, counted the same on every process: control flow the loop passes to the
        # forward): the unit recorded next in the last forward, which prefetch gathered ahead, is
        # not run. The layer must be a unit of its own (any wrap but NO_WRAP), or the case must pass
        # find_unused_parameters (`unused`): accelerate_c refuses a unit group only partly used in a
        # backward without it (docs/differential.md); not with the model's reentrant checkpointing
        c["fsdp_skip"] = r.choice((0, 0, 2, 3))
        if c["reentrant"] or (c["fsdp_wrap"] == "NO_WRAP" and not c["unused"]):
            c["fsdp_skip"] = 0
        # an extra loss term from the output layer called directly on the prepared model, outside
        # its forward (as T5's get_encoder()), before or after the model's forward: under NO_WRAP
        # and SIZE_BASED_WRAP (39 parameters, under min_num_params) that layer's parameters are the
        # root unit's, gathered on demand (strategies/fsdp.py, _root_on_demand); under
        # TRANSFORMER_BASED_WRAP it is a unit of its own, run outside the root's forward.
        # Not with the model's reentrant checkpointing: its output layer's gradient then arrives in
        # the segment's own backward and again in the outer one (torch DDP refuses that too)
        # (Its own unit resharded between its two runs under bf16 found a defect, fixed since:
        # docs/differential.md, "Found and fixed".)
        c["fsdp_aux"] = r.choice((None, None, "before", "after"))
        if c["reentrant"]:
            c["fsdp_aux"] = None
        # prefetch off (FullShardStrategy.prefetch, as tests/scripts/fsdp_prefetch.py sets it):
        # every gather is then the unit's own, in its hooks
        c["fsdp_prefetch"] = r.random() < 0.7
    if c["sharding"] == "zero3":
        # DeepSpeed's stage 3 (full sharding with DeepSpeed's settings: size-based units,
        # small parameters persistent): fp32, bf16 or fp16 (DeepSpeed's loss scaler over the fp32
        # gradient shards); as under FSDP, no full gradient exists between backward and the step.
        # An overflowing loss on one rank only with fp16, whose scaler skips that step everywhere
        c["assign_grad"] = False
        if c["mp"] != "fp16":
            c["overflow"] = None
        if c["zero_grad"] == "manual_none":
            c["zero_grad"] = "opt_none"
        c["zero3_units"] = r.choice(ZERO3_UNITS)
    if c["sharding"] in ("zero1", "zero2", "zero3") and c["mp"] != "no":
        # DeepSpeed has no DDP comm hooks; and a NaN gradient under bf16 is skipped by DeepSpeed
        # 0.19.3 on (bf16.check_grad_overflow) but stepped by older ones and by accelerate_c
        # (docs/sharding.md): not drawn until one version is the reference
        c["comm_hook"] = "no"
        if c["mp"] == "bf16":
            c["nan_grad_step"] = None
    if c["sharding"] in ("zero2", "zero3"):
        # no full gradient exists between backward and the step (p.grad is None, as with
        # DeepSpeed's stage 2): a loop cannot write one. DDP's comm hooks are not DeepSpeed's (stage
        # 2 reduce-scatters in the gradients' dtype)
        c["assign_grad"] = False
        c["comm_hook"] = "no"
        c["nan_grad_step"] = None
    if c["sharding"] in ("zero1", "zero2", "zero3"):
        # under DeepSpeed the engine clips inside its step, at the configuration's
        # gradient_clipping: the 2-norm of the whole model, once (clip_grad_norm_ only reports
        # the norm, clip_grad_value_ is refused, as in accelerate); one engine, one optimizer
        if c["clip"] != "none":
            c["clip"] = "norm2"
        c["clip_subset"] = c["clip_twice"] = c["two_optimizers"] = False
        # DeepSpeed's engine clears the gradients after its step: a loop that never calls
        # zero_grad trains the same (accelerate makes the wrapper's zero_grad a no-op there)
        if r.random() < 0.25:
            c["zero_grad"] = "never"
    # resume (drawn last, so every earlier axis of a seed stays what it was): after optimizer
    # step `resume`, save_state, one more window (a detour that changes every state), then
    # load_state; training must go on as if nothing happened. Not under join_uneven_inputs
    # (the ranks that ran out would miss the save's collectives); not drawn when the step falls
    # on an epoch's last batch (subject.py then skips it)
    c["resume"] = r.randint(1, 2) if (r.random() < 0.3 and not c["uneven"]) else 0
    if resume and not c["uneven"]:  # run.py --resume: every case that can resume does
        c["resume"] = c["resume"] or 1
    # rank-dependent control flow (drawn last): rank r leaves the middle layer out of its forward
    # at micro-batch i when (i + r) % rank_skip == rank_skip - 1, so in a step some ranks give
    # that layer a gradient and others none. torch DDP needs find_unused_parameters for it
    # (`unused` without sharding; DeepSpeed's ignore_unused_parameters, on by default, under
    # ZeRO-1/2); full sharding gathers units with every rank in step, where FSDP2 and DeepSpeed
    # stage 3 hang. Under ZeRO-2 over shared memory a bucket then has gradients to stage on some
    # ranks and none on others: the reduce-scatter's inputs sit in the window on some ranks and
    # in private zeros on others (grad_shards.py, the window agreement). Under ZeRO a backward
    # over several gradient groups (two models, or fp32 and bf16 layers without mixed precision:
    # DeepSpeed casts the model otherwise) takes it with find_unused_parameters=True only
    # (DDPStrategy._in_order). Under join_uneven_inputs too (torch DDP's Join shadows
    # find_unused_parameters' collectives); not with reentrant checkpointing (as fsdp_skip)
    c["rank_skip"] = 0
    groups = 1 + c["two_models"] + (c["param_dtype"] == "mixed" and c["mp"] == "no")
    if c["world"] > 1 and not c["reentrant"] and r.random() < 0.3 and (
            (c["sharding"] in ("none", "zero1", "zero2") and c["unused"])
            or (c["sharding"] in ("zero1", "zero2") and groups == 1)):
        c["rank_skip"] = r.choice((2, 3))
    # torch's non-reentrant activation checkpointing (use_reentrant=False, transformers'
    # gradient_checkpointing with it, torch's recommended kind): the middle and the output layer
    # each in a segment, recomputed inside the backward (the gradients' hooks fire from the
    # recomputation's graph; under full sharding the units must be gathered for it)
    c["nonreentrant"] = not c["reentrant"] and r.random() < 0.2
    # GradientAccumulationPlugin(sync_each_batch=True): accumulate() reduces every micro-batch
    # (accelerate's option for memory-bound runs); the reference is torch DDP without no_sync
    # inside the window. accumulate() only, several processes and micro-batches, no sharding
    # (ZeRO reduces every micro-batch anyway; FSDP's bf16 reference models one reduction a window)
    c["sync_each"] = (c["world"] > 1 and c["ga"] > 1 and c["sync_style"] == "accumulate" and
                      c["sharding"] == "none" and not c["uneven"] and r.random() < 0.3)
    # over shared memory (one host), every synchronous all-reduce of a private tensor staged
    # through the scratch window (collectives._staged: in a job, from 1 MiB where a host has more
    # ranks than cores): the clip's sums, the overflow and unused-parameter agreements, the
    # fallbacks. subject.py lowers the threshold for the case
    c["staged"] = c["world"] > 1 and r.random() < 0.3
    # a float64 layer beside the middle one (`side`, left out with it by rank_skip): float64 has
    # no flat buffer (no C kernels), so its gradients stay torch tensors, averaged one all-reduce
    # each at the end of Accelerator.backward, or at the end of backward under find_unused or
    # join (docs/ddp.md);
    # unscaled, checked and clipped by torch
    # ops beside the buffers. Replicated training only (the sharding strategies lay every
    # trainable parameter out in their own buffers); not with the model's reentrant
    # checkpointing (its segments return before the layer)
    c["f64"] = c["sharding"] == "none" and not c["reentrant"] and r.random() < 0.2
    # a gradient scaled through `.data` between backward and the step (older training code):
    # torch's `.data` has a version counter of its own, so a cached norm would survive it
    # unless the view's `.data` shares the view's (grad_layout.GradView). Where a full gradient
    # exists between backward and the step
    c["grad_data"] = c["sharding"] in ("none", "zero1") and r.random() < 0.15
    # the optimizer's multi-tensor implementation (foreach=True): its _foreach_ ops read the
    # gradient views (and under ZeRO, the rebuilt optimizer over the owned runs must keep it)
    c["foreach"] = r.random() < 0.25
    # the 16-bit model in fp16 instead of bf16 (its clip rounds each gradient's norm to fp16, as
    # torch's: past 65504 a norm is inf). Replicated, without autocast: torch's GradScaler
    # refuses fp16 gradients, and bf16 autocast over fp16 weights is no one's loop
    c["fp16"] = c["param_dtype"] == "bf16" and c["mp"] == "no" and c["sharding"] == "none" and r.random() < 0.5
    # the loop calls loss.backward() itself (divided by the accumulation steps, as
    # Accelerator.backward would) rather than Accelerator.backward: what is averaged when then
    # rests on the step's entry points and accumulate()/no_sync() (float64 layers: docs/ddp.md).
    # Replicated, without fp16's loss scale (which only Accelerator.backward applies). Under
    # join_uneven_inputs with find_unused_parameters it found a defect (drawn cases 149 and 167
    # on 2-3 processes: a `.grad` replaced after the backward was overwritten at the step):
    # GradGroup._end_of_backward now finishes at the outermost backward's end
    c["raw_backward"] = c["sharding"] == "none" and c["mp"] != "fp16" and r.random() < 0.2
    # one process keeps its gradients as autograd's tensors (accelerate_c/loose_grads.py) unless
    # ACCELERATE_C_GRAD_BUFFERS=flat: that path drawn too
    c["flat_buffers"] = c["world"] == 1 and r.random() < 0.3
    # torch.compile through the dynamo plugin (prepare() compiles the model last, as accelerate;
    # in place under the DeepSpeed settings): the "eager" backend runs the same torch ops, so the
    # references stay the uncompiled torch loops. AC_DIFF_COMPILE=1 draws it in every case (a
    # stress run of the axis). Not with the model's reentrant checkpointing: dynamo's tracing of
    # it fails under autocast ("encountered during backward but not found in storage") and moves
    # 16-bit results, on accelerate 1.15 as on accelerate_c (torch 2.13)
    # (Full sharding's aux call, a unit run again outside the compiled forward, is drawn with it:
    # it had its gradient delivered twice until the units' hooks ran outside dynamo's tracing,
    # FullShardStrategy.before_compile)
    c["compile"] = (r.random() < 0.1 or os.environ.get("AC_DIFF_COMPILE") == "1") and not c["reentrant"]
    # two identical blocks in an nn.ModuleList (workload.Net), and with compile, accelerate's
    # regional compilation of them (use_regional_compilation: each block compiled on its own, the
    # rest left eager). AC_DIFF_REGIONAL=1 draws both wherever compile is drawn
    # Deeper, the 16-bit runs amplify their valid rounding differences past the tolerances
    # calibrated on the three-layer net (compare.py): on three processes, where a 16-bit sum of
    # three has no one order, the blocks come only with 32-bit arithmetic throughout. Measured
    # (seeds 3000-3060 --sharding fsdp and 5000-5200 --world 3, blocks forced): three failures,
    # FSDP bf16 gradients 12% apart at step 9 (case 3043), an fp16 hook's clip norm 0.55% apart at
    # step 6, a ZeRO-3 bf16 evaluation 2.4% against 2.34%; in 3043 a torch reference rounding
    # the reduce as accelerate_c documents it (docs/differential.md) agreed with the subject bit
    # for bit at every step: the arithmetic was right, the tolerance too tight for the depth
    sixteen = c["mp"] != "no" or c["param_dtype"] != "fp32" or c["comm_hook"] in ("fp16", "bf16")
    force_regional = os.environ.get("AC_DIFF_REGIONAL") == "1"
    c["blocks"] = (r.random() < 0.25 or force_regional) and (c["world"] <= 2 or not sixteen)
    c["regional"] = c["compile"] and c["blocks"] and (r.random() < 0.5 or force_regional)
    # which Adam (the optimizer axis's "adamw"): torch's AdamW, Adam with its L2 decay in the
    # gradient, AdamW maximizing with beta1 0.3 (lerp's other formula) -- each stepped through
    # accelerate_c's one-pass kernel on the subject's side (accelerate_c/fused_adam.py) -- or
    # AdamW with amsgrad, which the kernel leaves to torch's own step
    # Adam is drawn only with fp32 end to end (above), which left it in ~2% of the cases; the
    # cases that came out fp32 end to end after every axis switch to it in a third of the rest
    # (AC_DIFF_ADAM=1: in all of them), so that the kernel meets every strategy and axis. On one
    # process bf16 autocast over fp32 parameters joins them: subject and torch run the same
    # forward, so no rounding noise is there for Adam to amplify (174 such forced cases of
    # `run.py --adam --world 1`, 102 of them bf16, passed)
    exact = c["param_dtype"] == "fp32" and c["comm_hook"] == "no" and (
        c["mp"] == "no" or (c["mp"] == "bf16" and c["world"] == 1))
    if exact and c["optimizer"] != "adamw" and (r.random() < 1 / 3 or os.environ.get("AC_DIFF_ADAM") == "1"):
        c["optimizer"] = "adamw"
    c["adam_kind"] = r.choice(ADAM_KINDS) if c["optimizer"] == "adamw" else "adamw"
    # where compile is drawn (without regional compilation, which only the plugin does), half the
    # time the user compiles the model (torch.compile, before prepare()) instead of the plugin:
    # prepare() then takes an OptimizedModule, which full sharding has to hook outside dynamo's
    # tracing as it does for its own compile. Drawn last, so every earlier axis keeps its draws
    c["user_compile"] = c["compile"] and not c["regional"] and r.random() < 0.5
    # FSDP under fp16 (accelerate's ShardedGradScaler over FSDP2's fp16 policy, reference_fsdp.py):
    # a third of the FSDP cases drawn with bf16 take fp16 instead, 40% of those with an
    # overflowing loss on one rank (skipped everywhere). Drawn last, as above. One micro-batch
    # per step: over a window accelerate's FSDP2 sums the scaled fp16 gradients unreduced in fp16
    # and skips a step whose sum overflows, where accelerate_c reduces each micro-batch into the
    # fp32 shards (docs/sharding.md: a difference, measured on soak cases 8810000024, -188, -519)
    if c["sharding"] == "fsdp" and c["mp"] == "bf16" and r.random() < 1 / 3:
        c["mp"] = "fp16"
        c["ga"] = 1
        if r.random() < 0.4:
            c["overflow"] = (r.randrange(c["world"]), r.randrange(max(1, c["batches"] - c["skip_first"])))
        # not evaluated with a frozen bf16 input layer of its own unit without reshard_after_forward:
        # FSDP2 leaves that unit gathered after a forward under no_grad, so from the second
        # evaluation batch the workload's `x.to(self.inp.weight.dtype)` reads fp16 there, where
        # accelerate_c reshards after every no_grad forward and it reads bf16 (docs/sharding.md: a
        # difference; reference_fsdp._eval_copy computes FSDP2's)
        if c["eval"] and c["frozen"] and c["param_dtype"] == "bf16" and not c["fsdp_reshard"] \
                and c["fsdp_wrap"] != "NO_WRAP":
            c["eval"] = False
    # DeepSpeed's fp16 with a short loss_scale_window in two thirds of its cases (drawn last, as
    # above): the scale grows within the case, and DeepSpeed's step, which updates the scale
    # before it unscales, divides the gradients of a growing step by the grown scale
    if c["sharding"] in ("zero1", "zero2", "zero3") and c["mp"] == "fp16":
        c["ds_window"] = r.choice((1000, 2, 3))
    return c


def _case(seed: int, **overrides) -> dict:
    """A plain case (no axis switched on) with `overrides`."""
    c = {"seed": seed, "world": 1, "param_dtype": "fp32", "mp": "no", "ga": 1, "batch_size": 3, "batches": 5,
         "dataset_extra": 0, "clip": "none", "max_norm": 0.05, "clip_subset": False, "unscale_first": False,
         "clip_twice": False,
         "comm_hook": "no", "tiny_buckets": False, "unused": False, "frozen": False, "zero_grad": "opt_none",
         "assign_grad": False, "two_models": False, "two_optimizers": False, "sync_style": "accumulate", "optimizer": "sgd", "skip_first": 0,
         "epochs": 1, "reentrant": False, "overflow": None, "nan_grad_step": None, "eval": False, "eval_skip": 0,
         "uneven": False, "sharding": "none", "tied": False, "frozen_bias": False, "resume": 0, "rank_skip": 0,
         "nonreentrant": False, "sync_each": False, "staged": False, "f64": False,
         "grad_data": False, "foreach": False, "fp16": False, "raw_backward": False, "flat_buffers": False,
         "compile": False, "blocks": False, "regional": False, "adam_kind": "adamw", "user_compile": False}
    unknown = set(overrides) - set(c)
    if unknown:
        raise KeyError(f"unknown axes {sorted(unknown)}")
    c.update(overrides)
    return c


# The defects the harness was built to find (issue 11), each as the smallest case that showed
# it; they run in every `make test` besides the random ones, with seeds of their own.
REGRESSION_SEED = 10 ** 9
REGRESSIONS = {
    "fp16 on 2 processes: unscale_gradients() then clip_grad_norm_ (stale bucket sums)":
        _case(REGRESSION_SEED + 1, world=2, mp="fp16", clip="norm2", unscale_first=True, batches=5),
    "clip_grad_norm_ twice on 2 processes (the coefficient applied twice)":
        _case(REGRESSION_SEED + 2, world=2, clip="norm2", clip_twice=True, batches=5),
    "comm_hook=bf16 on bf16 parameters (summed instead of averaged)":
        _case(REGRESSION_SEED + 3, world=2, param_dtype="bf16", comm_hook="bf16", optimizer="sgd"),
    "comm_hook=bf16 on a model with one bf16 layer":
        _case(REGRESSION_SEED + 4, world=2, param_dtype="mixed", comm_hook="bf16", tiny_buckets=True),
    "a NaN gradient: torch clips by NaN":
        _case(REGRESSION_SEED + 5, clip="norm2", nan_grad_step=1),
    "fp16 overflow on one rank, then clip twice (torch's coefficient on the skipped step)":
        _case(REGRESSION_SEED + 6, world=2, mp="fp16", clip="norminf", clip_twice=True, overflow=(1, 1)),
    "one weight in two reentrant-checkpointed segments, one process":
        _case(REGRESSION_SEED + 7, reentrant="shared", ga=2),
    # found by the harness itself, or by reading it (review)
    "fp16: clip_grad_norm_ over one of two models (the other model's gradients stayed scaled)":
        _case(REGRESSION_SEED + 12, mp="fp16", clip="norm2", clip_subset=True, two_models=True),
    "reentrant checkpointing on 2 processes, the output layer in a segment (an end of backward too early)":
        _case(REGRESSION_SEED + 10, world=2, reentrant="separate", ga=2),
    "join_uneven_inputs, find_unused_parameters and a layer that never takes part, bf16 and fp32 layers":
        _case(REGRESSION_SEED + 11, world=3, uneven=True, param_dtype="mixed", unused=True, dataset_extra=1),
    "join_uneven_inputs on a model with bf16 and fp32 layers (the shadow reduced groups out of order)":
        _case(REGRESSION_SEED + 9, world=2, uneven=True, param_dtype="mixed", tiny_buckets=True, dataset_extra=1),
    "ZeRO-2, reentrant checkpointing with the output layer in a segment (the backward ended at the segment's end)":
        _case(REGRESSION_SEED + 13, world=2, reentrant="separate", ga=2, sharding="zero2"),
    "save_state / load_state mid-run, two models stepped by one ZeRO optimizer (their parameters' names collided)":
        _case(REGRESSION_SEED + 14, world=2, two_models=True, sharding="zero2", resume=1),
    "find_unused_parameters, a layer one rank leaves out, fp32 and bf16 layers (that rank's bf16 buffer reduced nothing)":
        _case(REGRESSION_SEED + 15, world=2, param_dtype="mixed", unused=True, rank_skip=2, ga=2),
    "ZeRO-1, find_unused_parameters, two models, a layer one rank leaves out (the models' buckets launched in another order there)":
        _case(REGRESSION_SEED + 16, world=2, two_models=True, unused=True, sharding="zero1", rank_skip=3, batches=6),
    "ZeRO-2, find_unused_parameters, a layer one rank leaves out, fp32 and bf16 layers (a shard reduced nothing)":
        _case(REGRESSION_SEED + 17, world=3, param_dtype="mixed", unused=True, sharding="zero2", rank_skip=3, ga=3),
    "join_uneven_inputs with a float64 layer (no shadow for its step-time all-reduces: a hang)":
        _case(REGRESSION_SEED + 18, world=2, uneven=True, f64=True, dataset_extra=1),
    "find_unused_parameters, a float64 layer one rank leaves out (that rank skipped its step-time all-reduces)":
        _case(REGRESSION_SEED + 19, world=2, f64=True, unused=True, rank_skip=2, ga=2),
    "join_uneven_inputs, find_unused_parameters, a layer one rank leaves out (the joined rank sent zeros for the used-flags torch sends)":
        _case(REGRESSION_SEED + 20, world=3, uneven=True, unused=True, rank_skip=3, dataset_extra=3),
    "a float64 layer under the fp16 comm hook (torch's hook casts float64 buckets to fp16 too)":
        _case(REGRESSION_SEED + 21, world=2, f64=True, comm_hook="fp16", mp="fp16", param_dtype="bf16"),
    "join_uneven_inputs, find_unused_parameters, fp32 and bf16 layers, a layer one rank leaves out (groups finished in each rank's own order)":
        _case(REGRESSION_SEED + 22, world=2, uneven=True, unused=True, param_dtype="mixed", rank_skip=3,
              dataset_extra=1, tiny_buckets=True),
    "a bf16 model clipped by its 2-norm (torch rounds each gradient's norm to bf16 before the total)":
        _case(REGRESSION_SEED + 23, param_dtype="bf16", mp="bf16", clip="norm2", max_norm=0.5, unscale_first=True,
              tiny_buckets=True, batch_size=2, epochs=2),
    "a bf16 model on 2 processes clipped by its 2-norm (the per-bucket sums after each all-reduce)":
        _case(REGRESSION_SEED + 24, world=2, param_dtype="bf16", clip="norm2", max_norm=0.5, tiny_buckets=True,
              batch_size=2, batches=6),
    "a float64 layer under the fp16 comm hook, a sync backward per micro-batch (torch averages after each one)":
        _case(REGRESSION_SEED + 25, world=2, f64=True, comm_hook="fp16", sync_each=True, ga=2, batches=4,
              param_dtype="bf16", mp="bf16"),
    "find_unused_parameters, a raw loss.backward(), a .grad replaced before the step (the step overwrote the average with it)":
        _case(REGRESSION_SEED + 26, world=2, unused=True, rank_skip=2, assign_grad=True, raw_backward=True),
    "one process without flat buffers, fp16, an overflow, clip_grad_value_ (the step re-checked the clamped gradients and did not skip)":
        _case(REGRESSION_SEED + 27, mp="fp16", clip="value", overflow=(0, 3)),
    "full sharding under torch.compile, the output layer's unit called again outside the compiled forward (its gradient delivered twice)":
        {**draw(20001, 2, "fsdp"), "compile": True, "fsdp_aux": "after", "mp": "bf16", "overflow": None,
         "seed": REGRESSION_SEED + 28},  # (bf16 as drawn then: the fp16 draw came later)
    "full sharding of a model the user compiled before prepare(): get_state_dict's keys kept the wrapper's `_orig_mod.` (FSDP2's drop it)":
        {**draw(880015, 3, "fsdp"), "compile": True, "user_compile": True, "regional": False,
         "seed": REGRESSION_SEED + 29},
    "full sharding of a model the user compiled, size-based units, the output layer called before the forward (its parameters still sharded)":
        {**draw(880018, 2, "fsdp"), "compile": True, "user_compile": True, "regional": False,
         "seed": REGRESSION_SEED + 30},
    "DeepSpeed stage 3 under fp16 without gradient_clipping (the fp32 gradient shards were stepped still carrying the loss scale)":
        {**draw(885017, 2, "zero3"), "resume": 0, "seed": REGRESSION_SEED + 31},
    "DeepSpeed stage 3 under fp16, an overflowing loss on one rank, clipped at 0.5 (the clip measured the scaled gradients)":
        {**draw(885045, 2, "zero3"), "seed": REGRESSION_SEED + 32},
    "FSDP under fp16, clipped by the inf-norm (the clip measured the gradient shards still scaled)":
        {**draw(890023, 2, "fsdp"), "seed": REGRESSION_SEED + 33},
    "FSDP under fp16, the first step's scaled gradients overflowing (the step did not check the shards for infs)":
        {**draw(890042, 2, "fsdp"), "seed": REGRESSION_SEED + 34},
    "DeepSpeed stage 3 under fp16, load_state after steps skipped on overflows (persistent parameters stayed gathered with the old values)":
        {**draw(469, 2, "zero3"), "seed": REGRESSION_SEED + 35},
    "DeepSpeed ZeRO-2 under fp16, loss_scale_window 2, no clipping (a step growing the scale unscaled by the scale the gradients carry, where DeepSpeed's step divides by the grown one)":
        {**draw(887658, 2, "zero2"), "seed": REGRESSION_SEED + 36},
    "DeepSpeed stage 3 under fp16, loss_scale_window 2, clipped (the norm stage 3 reports and the clip's measured by the scale the gradients carry, not the updated one)":
        {**draw(887551, 2, "zero3"), "seed": REGRESSION_SEED + 37},
    "skip_first_batches on 2 processes, then gather_for_metrics":
        _case(REGRESSION_SEED + 8, world=2, eval=True, eval_skip=1, dataset_extra=1),
}


def describe(c: dict) -> str:
    """One line naming the axes that differ from the plain default."""
    keys = ("world", "param_dtype", "mp", "ga", "clip", "comm_hook", "sync_style", "zero_grad", "optimizer")
    parts = [f"{k}={c[k]}" for k in keys]
    for flag in ("clip_subset", "unscale_first", "clip_twice", "tiny_buckets", "unused", "frozen", "assign_grad",
                 "two_models", "two_optimizers", "eval", "uneven"):
        if c[flag]:
            parts.append(flag)
    if c["reentrant"]:
        parts.append(f"reentrant={c['reentrant']}")
    if c.get("sharding", "none") != "none":
        parts.append(f"sharding={c['sharding']}")
    if c.get("rank_skip"):
        parts.append(f"rank_skip={c['rank_skip']}")
    # axes added later (absent from older saved cases): named when on
    for flag, shown in (("nonreentrant", "nonreentrant"), ("sync_each", "sync_each_batch"), ("staged", "staged"),
                        ("f64", "f64"), ("grad_data", "grad_data"), ("foreach", "foreach"),
                        ("fp16", "fp16"), ("raw_backward", "raw_backward"), ("flat_buffers", "flat_buffers"),
                        ("compile", "compile"), ("blocks", "blocks"), ("regional", "regional"),
                        ("user_compile", "compiled_by_user")):
        if c.get(flag):
            parts.append(shown)
    if c.get("adam_kind", "adamw") != "adamw":
        parts.append(f"adam={c['adam_kind']}")
    if c.get("sharding") == "zero3":
        parts.append(f"units={c['zero3_units']}")
    if c.get("ds_window", 1000) != 1000:
        parts.append(f"loss_scale_window={c['ds_window']}")
    if c.get("sharding") == "fsdp":
        parts.append(f"wrap={c['fsdp_wrap']} reshard={c['fsdp_reshard']} ac={c['fsdp_ac']} "
                     f"eval_first={c['eval_first']}")
        for flag in ("tied", "frozen_bias"):
            if c.get(flag):
                parts.append(flag)
        if c.get("fsdp_skip"):
            parts.append(f"skip_mid_every={c['fsdp_skip']}")
        if c.get("fsdp_aux"):
            parts.append(f"aux_out={c['fsdp_aux']}")
        if not c.get("fsdp_prefetch", True):
            parts.append("prefetch=False")
    if c["skip_first"]:
        parts.append(f"skip_first={c['skip_first']}")
    if c["overflow"] is not None:
        parts.append(f"overflow={c['overflow']}")
    if c["nan_grad_step"] is not None:
        parts.append(f"nan_grad_step={c['nan_grad_step']}")
    if c["eval_skip"]:
        parts.append(f"eval_skip={c['eval_skip']}")
    if c.get("resume"):
        parts.append(f"resume_after_step={c['resume']}")
    return " ".join(parts)


def lookup(seed: int, world: int | None = None, sharding: str | None = None, resume: bool = False) -> dict:
    """The case a replay command names: a regression case by its seed, else a drawn one."""
    for c in REGRESSIONS.values():
        if c["seed"] == seed and world in (None, c["world"]) and sharding in (None, c["sharding"]):
            return dict(c)
    return draw(seed, world, sharding, resume)
