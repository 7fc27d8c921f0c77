"""torch.optim.Adam / AdamW's step through accelerate_c's kernels (accelerate_c/fused_adam.py,
csrc/core/adam.c), against torch's own optimizer run side by side in the same test on copies
of the same tensors: parameters, moments and step counts bit for bit, over sizes with vector
tails and parallel chunks, both branches of lerp, weight decay of both kinds, maximize, several
groups, special values, both kernel ISAs, torch's three x86 CPU capabilities, and both forms of
the update (one pass calling torch's own square root, two passes around torch.sqrt). Then what is
not taken (and so stays torch's), and a prepared training loop against a plain torch loop."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import accelerate_c
from accelerate_c import _C, fused_adam
from helpers import fresh_state, make_loader, make_model  # noqa: F401  (fresh_state: autouse)

SIZES = [1, 7, 8, 31, 100, 1000, 32768, 32769, 65537, 140001]
CONFIGS = [
    (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    (torch.optim.AdamW, dict(lr=3e-4, betas=(0.3, 0.95), maximize=True)),  # lerp weight 0.7: the other branch
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.0, eps=1e-6)),
    (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),  # L2 decay in the gradient
    (torch.optim.Adam, dict(lr=1e-3)),
]


@pytest.fixture(params=["one_pass", "two_pass"])
def sqrt_mode(request, monkeypatch):
    """The one-pass kernel (calling torch's own square root from C) and the two-pass update
    (torch.sqrt between the passes): both must give torch's values."""
    if request.param == "one_pass":
        if not fused_adam.uses_torch_sqrt_in_c():
            pytest.skip("torch's square root is not reachable from C here (no MKL)")
    else:
        monkeypatch.setattr(fused_adam, "_torch_sqrt", False)
    return request.param


def test_one_pass_where_torch_has_mkl():
    assert fused_adam.uses_torch_sqrt_in_c() is torch.backends.mkl.is_available()


def _pair(cls, kw, sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs, cls(ours, **kw), cls(theirs, **kw)


def _set_grads(ours, theirs, gen, special=False):
    for a, b in zip(ours, theirs):
        scale = 10.0 ** float(torch.randint(-5, 2, (), generator=gen))
        grad = torch.randn(a.shape, generator=gen) * scale
        if special and grad.numel() > 8:
            grad[0], grad[1], grad[2], grad[3] = float("nan"), float("inf"), -float("inf"), 1e-41  # subnormal
            grad[4] = 0.0
        a.grad, b.grad = grad.clone(), grad.clone()


def _bits(t):
    t = t.detach()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64) if t.dtype == torch.float64 else t


def _run_steps(ours, theirs, oo, ot, gen, steps):
    """`steps` steps with the same gradients: torch's optimizer, then ours through the kernels."""
    for _ in range(steps):
        _set_grads(ours, theirs, gen)
        ot.step()
        assert fused_adam.eligible(oo)
        fused_adam.step(oo)


def _assert_same(ours, theirs, oo, ot):
    """Bit for bit: signs of zeros, infinities and NaN payloads included."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(_bits(a), _bits(b)), f"parameter {i}"
        assert a._version == b._version, (i, a._version, b._version)
        sa, sb = oo.state[a], ot.state[b]
        assert sa.keys() == sb.keys(), i
        for key in sa:
            x, y = sa[key], sb[key]
            assert x.dtype == y.dtype and x.shape == y.shape and x.device == y.device, (i, key)
            assert torch.equal(_bits(x), _bits(y)), (i, key)
            assert x._version == y._version, (i, key, x._version, y._version)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_bitwise_torch(config, threads, sqrt_mode):
    cls, kw = CONFIGS[config]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours, theirs, oo, ot = _pair(cls, kw)
        _run_steps(ours, theirs, oo, ot, torch.Generator().manual_seed(config), 4)
        _assert_same(ours, theirs, oo, ot)
        assert oo.state_dict()["state"].keys() == ot.state_dict()["state"].keys()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("isa", ["scalar", "avx2"])
def test_both_kernel_isas_and_special_values(isa, sqrt_mode):
    if isa == "avx2" and _C.adam_isa() != "avx2" and _C.kernel_isa() != "avx2":
        pytest.skip("no AVX2 here")
    previous = _C.kernel_isa()
    _C.set_kernel_isa(isa)
    try:
        assert _C.adam_isa() == isa
        for cls, kw in CONFIGS:
            ours, theirs, oo, ot = _pair(cls, kw, sizes=[17, 1000, 70001])
            gen = torch.Generator().manual_seed(5)
            for step in range(3):
                _set_grads(ours, theirs, gen, special=step == 1)
                ot.step()
                fused_adam.step(oo)
            _assert_same(ours, theirs, oo, ot)
    finally:
        _C.set_kernel_isa(previous)


def test_two_pass_roots_budget_crossed(monkeypatch):
    monkeypatch.setattr(fused_adam, "_torch_sqrt", False)
    monkeypatch.setattr(fused_adam, "ROOTS_BUDGET", 5000)  # several rounds of square roots per step
    a, b, oa, ob = _torch_result(lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), sizes=(100, 4000, 3000, 9000, 7))
    _assert_same(a, b, oa, ob)


def test_groups_with_different_flags_and_missing_gradients(sqrt_mode):
    g = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (50, 3000, 70000, 9)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.05}, {"params": ps[2:3], "maximize": True, "lr": 1e-2},
                {"params": ps[3:], "weight_decay": 0.0, "betas": (0.5, 0.9)}]
    oo, ot = torch.optim.AdamW(groups(ours), lr=1e-3), torch.optim.AdamW(groups(theirs), lr=1e-3)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        _set_grads(ours, theirs, gen)
        if step == 2:  # a parameter without a gradient: skipped, its step count stays
            ours[1].grad = theirs[1].grad = None
        ot.step()
        fused_adam.step(oo)
    _assert_same(ours, theirs, oo, ot)
    assert oo.state[ours[1]]["step"].item() == 3.0


def test_continues_a_state_torch_started_and_a_loaded_state_dict():
    ours, theirs, oo, ot = _pair(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01), sizes=[100, 40000])
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):  # both sides by torch first
        _set_grads(ours, theirs, gen)
        oo.step()
        ot.step()
    state = oo.state_dict()
    fresh = torch.optim.AdamW(ours, lr=1e-3, weight_decay=0.01)
    fresh.load_state_dict(state)
    _run_steps(ours, theirs, fresh, ot, gen, 2)
    _assert_same(ours, theirs, fresh, ot)


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_torch_cpu_capabilities(capability):
    """torch fuses multiply-adds in its AVX2/AVX-512 kernels and not in DEFAULT: each runs in a
    fresh process (torch reads ATEN_CPU_CAPABILITY when it loads)."""
    code = (
        "import torch, sys; from accelerate_c import fused_adam\n"
        "want = sys.argv[1].upper()\n"
        "if torch.backends.cpu.get_cpu_capability() != want: print('SKIP'); sys.exit(0)\n"
        "for cls, kw in ((torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)), (torch.optim.Adam, dict(lr=1e-2, "
        "weight_decay=0.1)), (torch.optim.AdamW, dict(lr=1e-3, betas=(0.2, 0.99)))):\n"
        "    g = torch.Generator().manual_seed(1)\n"
        "    a = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (33, 70001)]\n"
        "    b = [torch.nn.Parameter(x.detach().clone()) for x in a]\n"
        "    oa, ob = cls(a, **kw), cls(b, **kw)\n"
        "    for _ in range(3):\n"
        "        for x, y in zip(a, b):\n"
        "            x.grad = torch.randn(x.shape, generator=g) * 1e-2; y.grad = x.grad.clone()\n"
        "        oa.step(); assert fused_adam.eligible(ob); fused_adam.step(ob)\n"
        "    for x, y in zip(a, b):\n"
        "        assert torch.equal(x, y), (cls.__name__, kw)\n"
        "        for k in ('exp_avg', 'exp_avg_sq', 'step'): assert torch.equal(oa.state[x][k], ob.state[y][k]), k\n"
        "print('OK')\n")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
    res = subprocess.run([sys.executable, "-c", code, capability], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    if res.stdout.strip() == "SKIP":
        pytest.skip(f"torch cannot use the {capability} capability on this CPU")
    assert res.stdout.strip() == "OK"


def _eligible_after(make):
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = make([p])
    return fused_adam.eligible(opt)


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, foreach=True),
    lambda ps: torch.optim.AdamW(ps, fused=True),
    lambda ps: torch.optim.AdamW(ps, amsgrad=True),
    lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-3)),
    lambda ps: torch.optim.Adam(ps, capturable=True),
    lambda ps: type("MyAdamW", (torch.optim.AdamW,), {})(ps),  # a subclass may change anything
    lambda ps: torch.optim.SGD(ps, lr=0.1),
], ids=["foreach", "fused", "amsgrad", "tensor_lr", "capturable", "subclass", "sgd"])
def test_not_taken_where_torch_runs_another_path(make):
    assert not _eligible_after(make)


def _torch_result(make_opt, mutate=None, steps=2, sizes=(40, 5000)):
    """(ours via run_step, torch's via opt.step()) on copies: parameters and states."""
    g = torch.Generator().manual_seed(11)
    a = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    oa, ob = make_opt(a), make_opt(b)
    if mutate is not None:
        mutate(oa)
        mutate(ob)
    for _ in range(steps):
        for x, y in zip(a, b):
            x.grad = torch.randn(x.shape, generator=g)
            y.grad = x.grad.clone()
        fused_adam.run_step(oa)
        ob.step()
    return a, b, oa, ob


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate parameters")
def test_not_taken_runs_torchs_step():
    for make in (lambda ps: torch.optim.AdamW(ps, foreach=True), lambda ps: torch.optim.AdamW(ps, amsgrad=True),
                 lambda ps: torch.optim.AdamW(ps + ps[:1])):  # a parameter twice (torch warns, steps it twice)
        a, b, oa, ob = _torch_result(make)
        assert not fused_adam.eligible(oa)
        _assert_same(a, b, oa, ob)


def test_user_step_wrappers_are_never_bypassed():
    import functools
    import types
    calls = []

    def make():
        p = torch.nn.Parameter(torch.randn(10))
        p.grad = torch.randn(10)
        return torch.optim.AdamW([p])

    # (a) a wrapper that copied the LR scheduler's marker with functools.wraps
    opt = make()
    torch.optim.lr_scheduler.StepLR(opt, 1)
    inner = opt.step

    @functools.wraps(inner)
    def mine(*args, **kwargs):
        calls.append("a")
        return inner(*args, **kwargs)
    opt.step = mine
    assert getattr(opt.step, "_wrapped_by_lr_sched", False) and not fused_adam.eligible(opt)
    fused_adam.run_step(opt)
    # (b) the user's bound step, then a scheduler wrapping it
    opt = make()
    original = opt.step
    opt.step = types.MethodType(lambda self, closure=None: calls.append("b") or original(), opt)
    torch.optim.lr_scheduler.StepLR(opt, 1)
    assert not fused_adam.eligible(opt)
    fused_adam.run_step(opt)
    # (c) the class's step replaced
    opt = make()
    saved = torch.optim.AdamW.step
    try:
        torch.optim.AdamW.step = lambda self, closure=None: calls.append("c")
        assert not fused_adam.eligible(opt)
        fused_adam.run_step(opt)
    finally:
        torch.optim.AdamW.step = saved
    assert calls == ["a", "b", "c"]
    opt = make()
    torch.optim.lr_scheduler.StepLR(opt, 1)
    assert fused_adam.eligible(opt)  # the scheduler's own marker around torch's step


def test_subclasses_inference_tensors_and_modes_are_left_to_torch():
    seen = []

    class Watched(torch.nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    p = Watched(torch.randn(10))
    p.grad = torch.randn(10)
    opt = torch.optim.AdamW([p], weight_decay=0.1)
    assert not fused_adam.eligible(opt)
    fused_adam.run_step(opt)
    assert "addcdiv_" in seen  # torch's step ran, under the subclass's eyes
    with torch.inference_mode():
        q = torch.nn.Parameter(torch.randn(10))
    q.grad = torch.randn(10)
    assert not fused_adam.eligible(torch.optim.AdamW([q]))
    r = torch.nn.Parameter(torch.randn(10))
    r.grad = torch.randn(10)
    opt = torch.optim.AdamW([r])
    assert fused_adam.eligible(opt)
    with torch.device("meta"):  # a TorchFunctionMode: it must see torch's operations
        assert not fused_adam.eligible(opt)
    if torch.set_flush_denormal(True):  # x86 with SSE3: this thread now flushes denormals
        try:
            assert not fused_adam.eligible(opt)
        finally:
            torch.set_flush_denormal(False)
        assert fused_adam.eligible(opt)


def test_version_counters_as_torchs_and_autograd_still_checks():
    for kw in (dict(weight_decay=0.1), dict(weight_decay=0.0), dict(weight_decay=0.1, maximize=True)):
        a, b, oa, ob = _torch_result(lambda ps: torch.optim.AdamW(ps, **kw))
        _assert_same(a, b, oa, ob)  # includes the version counters
    w = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(3, requires_grad=True)
    y = (w * x).sum()  # saves w for x's gradient
    w.grad = torch.randn(3)
    opt = torch.optim.AdamW([w])
    assert fused_adam.eligible(opt)
    fused_adam.step(opt)
    with pytest.raises(RuntimeError, match="inplace operation"):
        y.backward()


def test_a_refused_update_advances_nothing(monkeypatch):
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    opt = torch.optim.AdamW([p])
    fused_adam.step(opt)
    before = {k: v.clone() for k, v in opt.state[p].items()}
    value = p.detach().clone()

    def refuse(*args):
        raise ValueError("refused")
    monkeypatch.setattr(fused_adam, "_update", refuse)
    with pytest.raises(ValueError, match="refused"):
        fused_adam.step(opt)
    for k, v in before.items():
        assert torch.equal(opt.state[p][k], v), k
    assert torch.equal(p.detach(), value)


def test_another_vml_mode_in_the_thread_changes_nothing(sqrt_mode):
    """torch calls MKL's sqrt with an explicit mode; so must the kernel, whatever vmlSetMode the
    thread was given by another MKL user."""
    import ctypes
    lib = ctypes.CDLL(fused_adam._torch_cpu_library(), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    lib.vmlSetMode.restype = lib.vmlGetMode.restype = ctypes.c_uint
    lib.vmlSetMode.argtypes = [ctypes.c_uint]
    saved = lib.vmlGetMode()
    lib.vmlSetMode(0x3)  # VML_EP: the least accurate mode
    try:
        a, b, oa, ob = _torch_result(lambda ps: torch.optim.AdamW(ps), sizes=(3000, 70001))
    finally:
        lib.vmlSetMode(saved)
    _assert_same(a, b, oa, ob)


def test_hooks_and_a_replaced_step_keep_torchs_step():
    p = torch.nn.Parameter(torch.randn(10))
    p.grad = torch.randn(10)
    opt = torch.optim.AdamW([p])
    assert fused_adam.eligible(opt)
    calls = []
    handle = opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    assert not fused_adam.eligible(opt)
    fused_adam.run_step(opt)  # torch's step: the hook runs
    assert calls == ["pre"]
    handle.remove()
    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global"))
    try:
        assert not fused_adam.eligible(opt)
    finally:
        handle.remove()
    assert fused_adam.eligible(opt)
    opt.step = lambda closure=None: calls.append("mine")  # the user's own wrapper must run
    assert not fused_adam.eligible(opt)
    fused_adam.run_step(opt)
    assert calls == ["pre", "mine"]


def test_off_by_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_C_FUSED_ADAM", "0")
    assert not _eligible_after(lambda ps: torch.optim.AdamW(ps))


def test_lr_scheduler_sees_the_step_and_the_profiler_its_label():
    p = torch.nn.Parameter(torch.randn(10))
    opt = torch.optim.AdamW([p], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    p.grad = torch.randn(10)
    assert fused_adam.eligible(opt)  # the scheduler's marker wrapper does not stop it
    with torch.profiler.profile() as prof, warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        fused_adam.run_step(opt)
        sched.step()
    assert "Optimizer.step#AdamW.step" in {e.key for e in prof.key_averages()}
    assert opt.param_groups[0]["lr"] == 0.5e-3


def test_prepared_loop_bitwise_plain_torch(monkeypatch, sqrt_mode):
    """One process, AdamW with weight decay and a schedule, accumulation 2, clipping: the
    prepared loop (which steps through the kernels) against torch's loop."""
    steps = []
    real = fused_adam.step
    monkeypatch.setattr(fused_adam, "step", lambda opt: (steps.append(1), real(opt))[1])

    def run(ours: bool):
        torch.manual_seed(0)
        model = make_model(seed=4)
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        loader = make_loader(n=32, batch_size=4)
        if ours:
            acc = accelerate_c.Accelerator(cpu=True, gradient_accumulation_steps=2)
            model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        for i, (x, y) in enumerate(loader):
            if ours:
                with acc.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    acc.backward(loss)
                    if acc.sync_gradients:
                        acc.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
            else:
                loss = torch.nn.functional.mse_loss(model(x), y) / 2
                loss.backward()
                if i % 2 == 1:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    opt.step()
                    sched.step()
                    opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    ref = run(False)
    got = run(True)
    assert len(steps) == 4  # every optimizer step went through the kernels
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,start", [(torch.float32, 2.0 ** 24), (torch.float64, 2.0 ** 24), (torch.int64, 5)])
def test_step_counts_of_other_dtypes_count_as_torchs(dtype, start):
    """A loaded state's step tensor in another dtype, or a float32 count past 2**24 (where +1 rounds
    back): the count and the bias corrections read from it are torch's."""
    def seed_state(opt, params):
        for p in params:
            opt.state[p] = {"step": torch.tensor(start, dtype=dtype), "exp_avg": torch.zeros_like(p),
                            "exp_avg_sq": torch.zeros_like(p)}
    a, b, oa, ob = _torch_result(lambda ps: torch.optim.AdamW(ps, weight_decay=0.1), steps=3,
                                 mutate=lambda opt: seed_state(opt, [p for g in opt.param_groups for p in g["params"]]))
    _assert_same(a, b, oa, ob)


@pytest.mark.parametrize("mode", ["ddp", "zero2", "zero3"])
def test_two_processes_take_the_kernel_and_match_torch_ddp(mode):
    """Several processes: DDP's gradients are the flat buffer's GradViews, read as plain tensors;
    ZeRO's optimizer steps the owned runs of the fp32 shards."""
    import shutil
    from timeouts import wait_s
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "ddp_fused_adam.py")
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    res = subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0", script, mode],
                         capture_output=True, text=True, timeout=wait_s(180), env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "rank 0: fused steps 4, equal to torch DDP: True" in res.stdout
    assert "rank 1: fused steps 4, equal to torch DDP: " + ("None" if mode == "zero3" else "True") in res.stdout
