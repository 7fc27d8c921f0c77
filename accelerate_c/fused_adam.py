"""torch.optim.Adam / AdamW's step in one pass over memory (csrc/core/adam.c), with torch's values.

On CPU tensors torch runs Adam(W) as its single-tensor loop: per parameter ~9 tensor operations
(weight decay, lerp, mul, addcmul, sqrt, division, add, addcdiv), each a pass over the
parameter's memory, and ~700 operator calls a step for 76 parameters. The C kernels do the same
operations, in the same order, with the same fp32 roundings (the fused multiply-adds exactly
where torch's vectorised kernels have them: ac/adam.h), on blocks small enough to stay in cache:
the parameters, moments and step counts afterwards are bit for bit torch's
(tests/test_fused_adam.py checks them against torch.optim.AdamW / Adam). The square root is
torch's own: torch computes it with MKL's vector sqrt, whose last bit differs from the correctly
rounded root in ~0.7% of elements, so the kernel calls that function in torch's library with the
mode torch passes (found once, and used only after it gave torch.sqrt's values on a probe); where
it cannot, the update takes two passes with torch.sqrt between them.

It replaces `optimizer.step()` only where that equality is established: the optimizer's class is
exactly torch.optim.Adam or AdamW; every group uses the single-tensor path (foreach, fused,
capturable, differentiable, amsgrad off; lr, betas, eps and weight_decay plain numbers);
parameters, gradients and moments are dense contiguous float32 CPU tensors; torch's CPU
capability is one whose fused multiply-adds are known (x86-64: AVX2, AVX512, DEFAULT); no
optimizer step hook (the optimizer's or global), no replaced `step` (other than the LR
scheduler's marker around torch's own), no tensor subclass, inference tensor, shared memory
between parameters, or active torch function/dispatch mode would be bypassed, and denormals are
not flushed (torch.set_flush_denormal). Anything else runs
torch's own step, unchanged.
ACCELERATE_C_FUSED_ADAM=0 turns it off; ACCELERATE_C_ADAM_SQRT=torch keeps the two passes.
"""
from __future__ import annotations

import array
import os
import platform

import torch
import torch.optim.optimizer as _torch_optimizer

from . import _C
from .grad_layout import GradView

_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
# torch's CPU capabilities on x86-64 and whether their Adam kernels fuse multiply-adds
_FMA = {"AVX512": True, "AVX2": True, "DEFAULT": False}
# flags of ac/adam.h
_DECOUPLED, _DECAY, _MAXIMIZE, _FMA_FLAG = 1, 2, 4, 8


def _unhooked(f):
    """The step function under torch's profile/hook wrapper (Optimizer.profile_hook_step, which
    torch installs on the class at the first optimizer made)."""
    return f.__wrapped__ if getattr(f, "hooked", False) else f


# torch's own Adam.step (AdamW inherits it), as torch.optim defines it
_TORCH_STEP = _unhooked(torch.optim.Adam.__dict__["step"])


def enabled() -> bool:
    return os.environ.get("ACCELERATE_C_FUSED_ADAM", "1") != "0"


def _capability_fma():
    """True / False: whether torch's CPU kernels fuse here; None: not known (no fused step)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    return _FMA.get(torch.backends.cpu.get_cpu_capability())


def _plain_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _dense_f32(t, *types) -> bool:
    """A plain fp32 CPU tensor the kernels may write as torch's in-place ops would: not a subclass
    (whose __torch_function__ or __torch_dispatch__ would see torch's ops), not an inference
    tensor (torch refuses to update one), dense and contiguous."""
    return (type(t) in (types or (torch.Tensor,)) and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.layout == torch.strided and t.is_contiguous() and not t.is_conj() and not t.is_neg()
            and not t.is_inference())


def _group_ok(group) -> bool:
    if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
        return False
    if group.get("foreach") or group.get("fused"):
        return False
    beta1, beta2 = group["betas"]
    return all(_plain_number(v) for v in (group["lr"], beta1, beta2, group["eps"], group["weight_decay"]))


def _hooks_present(optimizer) -> bool:
    """Step hooks torch's step would run (the optimizer's own, or registered globally)."""
    return bool(getattr(optimizer, "_optimizer_step_pre_hooks", None)
                or getattr(optimizer, "_optimizer_step_post_hooks", None)
                or getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
                or getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


def _modes_active() -> bool:
    """A TorchFunctionMode or TorchDispatchMode would see torch's operations, not the kernels'."""
    return bool(torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack())


def _step_is_torchs(optimizer) -> bool:
    """Whether optimizer.step() would run torch's own Adam.step: the class's step not replaced,
    and no step on the instance other than the LR scheduler's marker wrapper around torch's (a
    user's wrapper must run, even one that copied the marker with functools.wraps)."""
    if _unhooked(type(optimizer).step) is not _TORCH_STEP:
        return False
    own = optimizer.__dict__.get("step")
    if own is None:
        return True
    return getattr(own, "_wrapped_by_lr_sched", False) and _unhooked(getattr(own, "__wrapped__", None)) is _TORCH_STEP


def _overlap(tensors) -> bool:
    """Whether two of the tensors share memory (the same parameter twice in the groups: torch
    steps it twice in turn; the kernels would update it from one state)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in tensors if t.numel())
    return any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def eligible(optimizer) -> bool:
    """Whether `step(optimizer)` gives torch's result for this optimizer as it is now."""
    if not enabled() or type(optimizer) not in _CLASSES or _capability_fma() is None:
        return False
    if torch.get_default_dtype() != torch.float32 or torch.compiler.is_compiling() or _modes_active():
        return False
    if _C.adam_denormals_flushed():  # torch.set_flush_denormal(True): torch's result depends on its threads
        return False
    if not _step_is_torchs(optimizer):
        return False
    if _hooks_present(optimizer) or getattr(optimizer, "grad_scale", None) is not None \
            or getattr(optimizer, "found_inf", None) is not None:
        return False
    stepped = []
    for group in optimizer.param_groups:
        if not _group_ok(group):
            return False
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            # a gradient may be the flat buffer's GradView (several processes: torch functions on
            # it are not intercepted, so reading it is reading a plain tensor)
            if not (_dense_f32(p, torch.Tensor, torch.nn.Parameter) and _dense_f32(g, torch.Tensor, GradView)) \
                    or g.shape != p.shape:
                return False
            stepped.append(p)
            state = optimizer.state.get(p)
            if state:
                step_t = state.get("step")
                if not (torch.is_tensor(step_t) and step_t.device.type == "cpu" and step_t.dim() == 0
                        and not step_t.requires_grad):
                    return False
                for key in ("exp_avg", "exp_avg_sq"):
                    t = state.get(key)
                    if not (torch.is_tensor(t) and _dense_f32(t) and t.shape == p.shape):
                        return False
    return not _overlap(stepped)


@torch.no_grad()
def step(optimizer) -> None:
    """torch's Adam/AdamW step for an eligible optimizer: state created as torch creates it, the
    scalars as torch computes them, the update in one C call per set of flags (groups that differ
    in weight decay or maximize); then each parameter's step count advanced and the version
    counters moved as torch's in-place operations move them (autograd's check that a saved tensor
    was not modified sees the update). Nothing is advanced if the kernels refuse their arguments."""
    base = _FMA_FLAG if _capability_fma() else 0
    batches: dict[int, tuple] = {}
    counts = []  # the step tensors, advanced once the kernels ran
    bumps: dict[int, list] = {1: [], 2: []}  # tensors by how many in-place torch ops write them
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        for group in optimizer.param_groups:
            beta1, beta2 = group["betas"]
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            decoupled = bool(group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW))
            flags = base | (_DECAY if wd != 0 else 0) | (_DECOUPLED if decoupled else 0) \
                | (_MAXIMIZE if group["maximize"] else 0)
            params, grads, avgs, sqs, consts = batches.setdefault(flags, ([], [], [], [], array.array("f")))
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = optimizer.state[p]
                if len(state) == 0:  # as torch's _init_group (capturable and fused off)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_t = state["step"]
                counts.append(step_t)
                # the count torch's `step_t += 1` gives: the sum of two integers exact in double,
                # rounded once to the step tensor's dtype (float32 unless a state_dict said otherwise)
                k = torch.tensor(step_t.item() + 1, dtype=step_t.dtype).item() \
                    if step_t.dtype != torch.float32 else float(array.array("f", (step_t.item() + 1,))[0])
                # torch's _single_tensor_adam arithmetic on Python floats (double); array('f')
                # then rounds each to fp32, as torch's kernels convert their scalar arguments
                bias1 = 1 - beta1 ** k
                bias2 = 1 - beta2 ** k
                decay = (1 - lr * wd) if decoupled else wd
                consts.extend((decay, 1 - beta1, beta2, 1 - beta2, bias2 ** 0.5, eps, -(lr / bias1)))
                params.append(p.detach())
                grads.append(p.grad.detach())
                avgs.append(state["exp_avg"])
                sqs.append(state["exp_avg_sq"])
                # param: mul_ (AdamW's decay) and addcdiv_; exp_avg: lerp_; exp_avg_sq: mul_, addcmul_
                bumps[2 if (wd != 0 and decoupled) else 1].append(p)
                bumps[1].append(state["exp_avg"])
                bumps[2].append(state["exp_avg_sq"])
        for flags, (params, grads, avgs, sqs, consts) in batches.items():
            if params:
                _update(params, grads, avgs, sqs, consts, flags)
        for step_t in counts:
            step_t += 1
        for times, tensors in bumps.items():
            for _ in range(times):
                if tensors:
                    torch.autograd.graph.increment_version(tensors)
        optimizer._optimizer_step_code()  # torch's profiler entry point, as its step wrapper calls it
    optimizer._opt_called = True  # what torch's LR scheduler reads to know the step ran


# Square roots held at once between the two passes (elements): a bound on the transient memory
# (torch's own step holds two such temporaries of one parameter at a time)
ROOTS_BUDGET = 1 << 22


_torch_sqrt: bool | None = None  # whether the C kernels call torch's own square root (decided once)


def _probe() -> torch.Tensor:
    """Values a square root can round differently: every binade of fp32 (subnormals included)
    with random mantissas, zeros, infinities, NaN, negatives."""
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(1 << 14, generator=g, device="cpu") + 1.0
    expo = torch.randint(-149, 128, (1 << 14,), generator=g, device="cpu").float()
    special = torch.tensor([0.0, -0.0, float("inf"), float("nan"), -1.0, 1e-45, 3.4e38], device="cpu")
    return torch.cat([mant * torch.exp2(expo), special]).float()


def _torch_cpu_library():
    """The path of torch's libtorch_cpu as this process loaded it (torch/lib in a wheel, the
    environment's lib in conda and distribution layouts), or None."""
    wheel = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if os.path.exists(wheel):
        return wheel
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libtorch_cpu."):
                    return path
    except OSError:
        pass
    return None


def _find_torch_sqrt() -> bool:
    """torch computes sqrt with MKL's vmsSqrt (ac/adam.h): found in torch's own library and
    checked against torch.sqrt on a probe here, the one-pass kernel calls it; else the two-pass
    update keeps calling torch.sqrt. ACCELERATE_C_ADAM_SQRT=torch forces the latter."""
    if os.environ.get("ACCELERATE_C_ADAM_SQRT") == "torch":
        return False
    lib = _torch_cpu_library()
    if lib is None or not _C.adam_load_sqrt(lib):
        return False
    probe = _probe()
    ours = torch.empty_like(probe)
    _C.adam_sqrt(probe, ours)
    theirs = torch.sqrt(probe)
    same = torch.equal(ours.isnan(), theirs.isnan()) and torch.equal(ours.nan_to_num(), theirs.nan_to_num())
    if not same:
        _C.adam_unload_sqrt()
    return same


def uses_torch_sqrt_in_c() -> bool:
    global _torch_sqrt
    if _torch_sqrt is None:
        _torch_sqrt = _find_torch_sqrt()
    return _torch_sqrt


def _update(params, grads, avgs, sqs, consts, flags) -> None:
    """One pass (the moments, torch's square root and the parameters on cache-sized blocks) when
    the kernels can call torch's square root; else the moments of all parameters in one pass,
    then, a few parameters at a time, torch.sqrt of each second moment and the parameters' pass."""
    if uses_torch_sqrt_in_c():
        _C.adam_fused(params, grads, avgs, sqs, consts, flags)
        return
    _C.adam_moments(params, grads, avgs, sqs, consts, flags)
    first, roots, held = 0, [], 0
    for i, sq in enumerate(sqs):
        roots.append(torch.sqrt(sq))
        held += sq.numel()
        if held >= ROOTS_BUDGET or i == len(sqs) - 1:
            _C.adam_apply(params[first:i + 1], avgs[first:i + 1], roots, consts[7 * first:7 * (i + 1)], flags)
            first, roots, held = i + 1, [], 0


def run_step(optimizer, closure=None):
    """optimizer.step(closure), through the one-pass update when that gives torch's values."""
    if closure is None and eligible(optimizer):
        return step(optimizer)
    return optimizer.step(closure) if closure is not None else optimizer.step()
