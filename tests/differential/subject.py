"""A case trained the way a user writes it with accelerate_c (the code under test).

Returns the trace the reference also produces: after every optimizer step (every sync step) the
parameters, the norm clip returned, whether the step was skipped and the learning rate; then,
when the case evaluates, what gather_for_metrics collected over the evaluation set.
"""
from __future__ import annotations

import contextlib
import os

import torch

from accelerate_c import Accelerator, GradientAccumulationPlugin, collectives
from accelerate.utils import DeepSpeedPlugin  # accelerate's own plugins, as a moved script keeps them
from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin
from accelerate_c.utils import DataLoaderConfiguration, DistributedDataParallelKwargs

from . import workload as W


def _clip(acc, case, params):
    kind = case["clip"]
    if kind == "none":
        return None
    if kind == "value":
        acc.clip_grad_value_(params, case["max_norm"])
        return None
    norm_type = 2.0 if kind == "norm2" else float("inf")
    norm = acc.clip_grad_norm_(params, case["max_norm"], norm_type=norm_type)
    if case["clip_twice"]:
        norm = acc.clip_grad_norm_(params, case["max_norm"], norm_type=norm_type)
    return float(norm)



def _aux(case, acc, model, x):
    """fsdp_aux: the output layer of the prepared model called directly, outside its forward
    (which the Accelerator wrapped in autocast): under mixed precision the loop asks for the
    Accelerator's autocast itself, as accelerate's docs say for code outside the forward."""
    with acc.autocast() if case["mp"] != "no" else contextlib.nullcontext():
        return W.aux_loss(case, model.out, x)


def _values(acc, case, models, params) -> list:
    """The parameters' values (fp32 copies); under full sharding each process holds a shard of
    each, so the full values come from accelerator.get_state_dict (a collective)."""
    if case.get("sharding") not in ("fsdp", "zero3"):
        return [p.detach().float().clone() for p in params]
    full = {}
    for m in models:
        sd = [acc.get_state_dict(m)]  # the main process's ({} or, at DeepSpeed stage 3, None elsewhere)
        torch.distributed.broadcast_object_list(sd, src=0)
        sd = sd[0]
        # the state dict's names: FSDP2's (torch's get_model_state_dict) drop a compiled
        # wrapper's `_orig_mod.`; DeepSpeed's consolidated 16-bit one names the parameters of
        # the module it was given, a user's compiled wrapper included
        keep = case["sharding"] == "zero3"
        for name, p in acc.unwrap_model(m, keep_torch_compile=keep).named_parameters():
            full[id(p)] = sd[name].float().clone()
    return [full[id(p)] for p in params]


def run(case: dict) -> dict:
    if case.get("flat_buffers"):  # read when the models are prepared
        saved = os.environ.get("ACCELERATE_C_GRAD_BUFFERS")
        os.environ["ACCELERATE_C_GRAD_BUFFERS"] = "flat"
        try:
            return _run_staged(case)
        finally:
            if saved is None:
                os.environ.pop("ACCELERATE_C_GRAD_BUFFERS", None)
            else:
                os.environ["ACCELERATE_C_GRAD_BUFFERS"] = saved
    return _run_staged(case)


def _run_staged(case: dict) -> dict:
    if not case.get("staged"):
        return _run(case)
    # the staged axis: every synchronous all-reduce of a private tensor over shared memory goes
    # through the scratch window (collectives._staged), as it does from 1 MiB on a host with
    # more ranks than cores; this training's collectives are all far smaller
    saved = collectives.SCRATCH_MIN, collectives._oversubscribed
    collectives.SCRATCH_MIN, collectives._oversubscribed = 1, lambda shm: not collectives.hierarchical()
    try:
        return _run(case)
    finally:
        collectives.SCRATCH_MIN, collectives._oversubscribed = saved


def _run(case: dict) -> dict:
    handlers = [DistributedDataParallelKwargs(bucket_cap_mb=W.bucket_cap_mb(case), find_unused_parameters=case["unused"],
                                              comm_hook=case["comm_hook"])]
    ga = case["ga"] if case["sync_style"] == "accumulate" else 1
    sharding = {}
    if case.get("sharding", "none") in ("zero1", "zero2", "zero3"):
        clip = case["max_norm"] if case["clip"] == "norm2" else 0.0  # the engine clips inside its step
        plugin = DeepSpeedPlugin(zero_stage=int(case["sharding"][-1]), gradient_accumulation_steps=ga,
                                 gradient_clipping=clip, zero3_save_16bit_model=case["sharding"] == "zero3")
        if case["sharding"] == "zero3":
            prefetch, persist = case["zero3_units"]
            plugin.deepspeed_config["zero_optimization"].update(
                stage3_prefetch_bucket_size=prefetch, stage3_param_persistence_threshold=persist)
        if case["mp"] == "fp16":  # DeepSpeed's fp16 section as a user writes it (workload.py says why)
            plugin.deepspeed_config["fp16"] = {"enabled": True, "auto_cast": True, **W.deepspeed_fp16(case)}
        sharding["deepspeed_plugin"] = plugin
    elif case.get("sharding") == "fsdp":
        sharding["fsdp_plugin"] = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy=case["fsdp_wrap"], reshard_after_forward=case["fsdp_reshard"],
            min_num_params=50, transformer_cls_names_to_wrap=["Linear"], activation_checkpointing=case["fsdp_ac"])
    if case.get("sync_each"):  # accumulate() reduces every micro-batch's gradients
        sharding["gradient_accumulation_plugin"] = GradientAccumulationPlugin(num_steps=ga, sync_each_batch=True)
    else:
        sharding["gradient_accumulation_steps"] = ga
    if case.get("compile") and not case.get("user_compile"):
        sharding["dynamo_plugin"] = TorchDynamoPlugin(backend="eager",
                                                      use_regional_compilation=bool(case.get("regional")))
    acc = Accelerator(cpu=True, mixed_precision=case["mp"], kwargs_handlers=handlers,
                      dataloader_config=DataLoaderConfiguration(even_batches=not case["uneven"]), **sharding)
    models = W.models(case)
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    opts = W.optimizers(case, params)
    if case.get("user_compile"):  # the user's own torch.compile, before prepare() (cases.py)
        models = [torch.compile(m, backend="eager") for m in models]
    sched = W.schedule(opts[0])
    dl = W.loader(W.dataset(case), case)
    if case.get("eval_first"):  # prepared for evaluation first: its gradients must still be reduced after
        for m in models:
            acc.prepare_model(m, evaluation_mode=True)
    prepared = acc.prepare(*models, *opts, dl, sched)
    n, k = len(models), len(opts)
    models, opts, (dl, sched) = list(prepared[:n]), list(prepared[n:n + k]), prepared[n + k:]
    if case.get("sharding") == "fsdp" and not case.get("fsdp_prefetch", True):
        # prefetch off: the prepared strategy's switch, as tests/scripts/fsdp_prefetch.py turns it off
        acc._grads.strategy.prefetch = False
    params = [p for m in models for p in m.parameters() if p.requires_grad]
    trace = {"steps": []}
    if case.get("sharding") in ("zero1", "zero2") and collectives.cpu_comm() == "shm" and \
            not collectives.hierarchical() and os.environ.get("ACCELERATE_C_SHM_WINDOWS", "1") != "0":
        # over shared memory ZeRO's parameter buffers live in windows (the all-gather after each
        # step reads the chunks in place): the worker checks it was so for every parameter
        trace["params_in_windows"] = all(collectives.in_shared_buffer(p) for p in params)
    with acc.join_uneven_inputs(models) if case["uneven"] else contextlib.nullcontext():
        _train(case, acc, models, params, opts, dl, sched, trace)
    # after a join every rank holds the model of one that ran to the end
    trace["final"] = _values(acc, case, models, params)
    if case["eval"]:
        edl = acc.prepare(W.loader(W.eval_dataset(case), case))
        if case["eval_skip"]:
            edl = acc.skip_first_batches(edl, case["eval_skip"])
        outs = []
        with torch.no_grad():
            for x, _ in edl:
                outs.append(acc.gather_for_metrics(models[0](W.inputs(case, x))).float())
        trace["eval"] = torch.cat(outs)
    return trace


def _train(case, acc, models, params, opts, dl, sched, trace):
    resumed = False
    for epoch in range(case["epochs"]):
        loader = acc.skip_first_batches(dl, case["skip_first"]) if (epoch == 0 and case["skip_first"]) else dl
        n = len(loader)
        for i, (x, y) in enumerate(loader):
            window_end = (i + 1) % case["ga"] == 0 or i + 1 == n
            synced = _micro(case, acc, models, params, opts, sched, x, y, i, epoch, window_end, trace)
            if synced and case.get("resume") == len(trace["steps"]) and i + 1 < n and not resumed:
                _save_detour_load(case, acc, models, params, opts, sched, x, y, i, window_end)
                resumed = trace["resumed"] = True


def _save_detour_load(case, acc, models, params, opts, sched, x, y, i, window_end):
    """The resume axis: save_state between two optimizer steps, train one more whole window
    (the last batch again) that changes the parameters, the optimizer's state, the scheduler and
    the loss scale, then load_state: what follows must be what training on without the detour
    gives (the reference trains on; nothing of the detour is recorded)."""
    import shutil
    import tempfile

    d = [tempfile.mkdtemp(prefix="ac_diff_resume_") if acc.is_main_process else None]
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(d, src=0)
    d = d[0]
    try:
        acc.save_state(d)
        # under fp16 windows whose loss overflows on rank 0 follow: each step is skipped and the
        # loss scale backs off, so a scale load_state failed to restore shows at the next step.
        # DeepSpeed's scaler backs off at the second overflow in a row (hysteresis 2, workload.py)
        overflows = 0 if case["mp"] != "fp16" else 2 if W.deepspeed_16bit(case) else 1
        for detour in [-1] + [-2] * overflows:
            for j in range(case["ga"]):
                _micro(case, acc, models, params, opts, sched, x, y, i, detour, j + 1 == case["ga"], None)
        acc.load_state(d)
    finally:
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(d, ignore_errors=True)


def _micro(case, acc, models, params, opts, sched, x, y, i, epoch, window_end, trace) -> bool:
    """One micro-batch of the loop; returns whether it was a sync step (an optimizer step). A
    detour's micro-batches (resume axis) pass no trace and epoch -1 (no overflow or NaN
    injected) or -2 (the loss overflows on rank 0); nothing is recorded."""
    rank = acc.process_index
    step = len(trace["steps"]) if trace is not None else -1
    if case["sync_style"] == "accumulate":
        ctx = acc.accumulate(*models)
    else:  # the user's own accumulation with no_sync, as in accelerate's docs
        ctx = contextlib.ExitStack()
        if not window_end:
            for m in models:
                ctx.enter_context(acc.no_sync(m))
    with ctx:
        aux = _aux(case, acc, models[0], x) if case.get("fsdp_aux") == "before" else 0.0
        outs = [m(W.inputs(case, x), **W.forward_kwargs(case, i, rank)).float() for m in models]
        if case.get("fsdp_aux") == "after":
            aux = _aux(case, acc, models[0], x)
        loss = W.loss_of(outs, y) + aux
        if case["sync_style"] == "no_sync":
            loss = loss / case["ga"]
        if (case["overflow"] is not None and case["overflow"] == (rank, i) and epoch == 0) or (epoch == -2 and rank == 0):
            loss = loss * float("inf")
        if case.get("raw_backward"):
            (loss / acc.gradient_accumulation_steps).backward()
        else:
            acc.backward(loss)
        if case["sharding"] in ("zero2", "zero3", "fsdp"):  # no full gradient exists, as with DeepSpeed's stage 2
            assert all(p.grad is None for p in params), "ZeRO-2 left a full gradient in p.grad"
        # accumulate(): accelerate decides; no_sync: the loop does (its Accelerator has ga=1)
        sync = acc.sync_gradients if case["sync_style"] == "accumulate" else window_end
        if sync:
            W.touch_grads(case, params, step)
            if case["unscale_first"]:
                acc.unscale_gradients()
            norm = _clip(acc, case, W.clipped(case, params))
        if sync:  # what the optimizer is about to read (None kept apart from zeros); under
            # ZeRO-2 no process holds it whole: gathered (a collective, every rank calls it)
            full = [acc.get_full_grad(p) for p in params]
            grads = [None if g is None else g.detach().float().clone() for g in full]
        # under accumulate() the wrapped optimizer and scheduler skip non-sync steps
        # themselves; with no_sync the loop only calls them at a window's end
        if sync or case["sync_style"] == "accumulate":
            for opt in opts:
                opt.step()
            sched.step()
        if sync and trace is not None:
            trace["steps"].append({
                "params": _values(acc, case, models, params),
                "grads": grads,
                "norm": norm,
                "skipped": any(opt.step_was_skipped for opt in opts),
                "lr": sched.get_last_lr()[0],
                "scale": acc.scaler.get_scale() if acc.scaler is not None else None,
            })
        if sync or (case["zero_grad"].startswith("opt") and case["sync_style"] == "accumulate"):
            W.zero_grads(case, opts, models, params)
    return bool(sync)
