"""Accelerator's constructor (errors, environment fallbacks, signature) and its public API on
one process, compared with plain torch and with accelerate 1.15."""
from __future__ import annotations

import copy
import inspect
import os

import pytest
import torch

import accelerate_c
from accelerate_c import (
    Accelerator,
    AutocastKwargs,
    DistributedType,
    GradientAccumulationPlugin,
    GradScalerKwargs,
)
from helpers import fresh_state, loss_function, make_loader, make_model  # noqa: F401


def _accelerate():
    return pytest.importorskip("accelerate")


# --------------------------------------------------------------------------------------------
# 7. bad input -> clear errors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["fp32", "bogus", "FP16 ", "float16"])
def test_unknown_mixed_precision_is_a_value_error_naming_it(value):
    with pytest.raises(ValueError, match=repr(value).replace("(", r"\(")) as e:
        Accelerator(mixed_precision=value)
    assert value in str(e.value)


def test_fp8_not_implemented():
    with pytest.raises(NotImplementedError, match="fp8"):
        Accelerator(mixed_precision="fp8")


@pytest.mark.parametrize("steps", [0, -1, 2.0, "2"])
def test_bad_gradient_accumulation_steps(steps):
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        Accelerator(gradient_accumulation_steps=steps)


def test_bad_plugin_num_steps():
    with pytest.raises(ValueError):
        Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=0))


def test_steps_and_plugin_together_is_a_value_error():
    with pytest.raises(ValueError, match="gradient_accumulation_plugin"):
        Accelerator(gradient_accumulation_steps=2,
                    gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2))


def test_plugin_alone_sets_steps():
    acc = Accelerator(gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    assert acc.gradient_accumulation_steps == 3
    assert acc.gradient_state.num_steps == 3


@pytest.mark.parametrize("name,value", [
    ("parallelism_config", object()),
    ("torch_tp_plugin", object()),
    ("megatron_lm_plugin", object()),
])
def test_unsupported_parameters_raise_not_implemented_naming_them(name, value):
    with pytest.raises(NotImplementedError, match=name):
        Accelerator(**{name: value})


@pytest.mark.parametrize("name", ["deepspeed_plugin", "deepspeed_plugins"])
def test_deepspeed_plugins_are_checked_then_refused(name):
    # the configuration is read first (tests/test_deepspeed_config.py); ZeRO stage 0 is not built
    with pytest.raises(TypeError, match=name):
        Accelerator(**{name: object()})
    with pytest.raises(NotImplementedError, match="ZeRO stage 0"):
        Accelerator(cpu=True, mixed_precision="fp16", **{name: accelerate_c.utils.DeepSpeedPlugin(zero_stage=0)})


@pytest.mark.parametrize("value", [None, "no", "NO"])
def test_dynamo_backend_no_is_accepted(value):
    assert Accelerator(dynamo_backend=value).mixed_precision == "no"


@pytest.mark.parametrize("handler", [GradScalerKwargs, AutocastKwargs])
def test_duplicate_kwargs_handler_type_is_a_value_error(handler):
    with pytest.raises(ValueError, match=handler.__name__):
        Accelerator(kwargs_handlers=[handler(), handler()])


def test_different_kwargs_handlers_are_accepted():
    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=8.0), AutocastKwargs()])
    assert acc.scaler.get_scale() == 8.0


# --------------------------------------------------------------------------------------------
# environment fallbacks
# --------------------------------------------------------------------------------------------
def test_env_mixed_precision(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator().mixed_precision == "bf16"


def test_env_mixed_precision_argument_wins(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert Accelerator(mixed_precision="no").mixed_precision == "no"


def test_env_mixed_precision_bad_value(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        Accelerator()


def test_env_gradient_accumulation_steps(monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    acc = Accelerator()
    assert acc.gradient_accumulation_steps == 4
    assert acc.gradient_state.num_steps == 4


def test_env_use_cpu(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    acc = Accelerator()
    assert acc.device == torch.device("cpu")
    assert acc.state.device.type == "cpu"


def test_env_left_behind_by_a_test():
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"  # left behind on purpose: the fixture must clear it
    assert Accelerator().mixed_precision == "bf16"


def test_env_left_behind_was_cleared():
    # runs after the previous test (file order): the autouse fixture restored the environment
    assert "ACCELERATE_MIXED_PRECISION" not in os.environ or os.environ["ACCELERATE_MIXED_PRECISION"] != "bf16"
    assert Accelerator().mixed_precision in ("no", os.environ.get("ACCELERATE_MIXED_PRECISION"))


# --------------------------------------------------------------------------------------------
# signature and positional binding
# --------------------------------------------------------------------------------------------
def test_signature_matches_accelerate():
    accelerate = _accelerate()
    ours = list(inspect.signature(Accelerator.__init__).parameters)
    theirs = list(inspect.signature(accelerate.Accelerator.__init__).parameters)
    assert ours == theirs


def test_positional_binding():
    acc = Accelerator(True, False, "bf16", 2)
    assert acc.device_placement is True
    assert acc.split_batches is False
    assert acc.mixed_precision == "bf16"
    assert acc.gradient_accumulation_steps == 2


def test_positional_binding_matches_accelerate():
    accelerate = _accelerate()
    theirs = accelerate.Accelerator(True, False, "bf16", 2, True)
    t = (theirs.device_placement, theirs.split_batches, theirs.mixed_precision, theirs.gradient_accumulation_steps,
         str(theirs.device))
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    ours = Accelerator(True, False, "bf16", 2, True)
    assert (ours.device_placement, ours.split_batches, ours.mixed_precision, ours.gradient_accumulation_steps,
            str(ours.device)) == t


# --------------------------------------------------------------------------------------------
# 9. the API surface on one process
# --------------------------------------------------------------------------------------------
PROPS = ["device", "distributed_type", "num_processes", "process_index", "local_process_index",
         "is_main_process", "is_local_main_process", "is_last_process", "use_distributed", "mixed_precision",
         "sync_gradients", "gradient_accumulation_steps", "step", "project_dir", "logging_dir", "split_batches",
         "even_batches", "use_seedable_sampler", "non_blocking", "device_placement", "optimizer_step_was_skipped"]


def test_properties_on_one_process(tmp_path):
    acc = Accelerator(project_dir=str(tmp_path))
    assert acc.device == torch.device("cpu")
    assert acc.distributed_type == DistributedType.NO and acc.distributed_type == "NO"
    assert acc.num_processes == 1 and acc.process_index == 0 and acc.local_process_index == 0
    assert acc.is_main_process and acc.is_local_main_process and acc.is_last_process
    assert acc.use_distributed is False
    assert acc.mixed_precision == "no"
    assert acc.sync_gradients is True
    assert acc.gradient_accumulation_steps == 1
    assert acc.state is accelerate_c.AcceleratorState() or acc.state.__dict__ is accelerate_c.AcceleratorState().__dict__
    assert acc.gradient_state.__dict__ is accelerate_c.GradientState().__dict__
    assert acc.scaler is None
    assert acc.step == 0
    assert acc.project_dir == str(tmp_path)
    assert acc.logging_dir == str(tmp_path)
    assert acc.optimizer_step_was_skipped is False


@pytest.mark.parametrize("mp", ["no", "bf16", "fp16"])
def test_scaler_only_under_fp16(mp):
    acc = Accelerator(mixed_precision=mp)
    assert (acc.scaler is not None) == (mp == "fp16")
    if mp == "fp16":
        assert acc.scaler.get_scale() == torch.amp.GradScaler("cpu").get_scale()
        assert acc.scaler.state_dict() == torch.amp.GradScaler("cpu").state_dict()


@pytest.mark.parametrize("kw", [dict(), dict(gradient_accumulation_steps=3), dict(mixed_precision="bf16"),
                                dict(project_dir="PROJECT")])
def test_properties_match_accelerate(kw, tmp_path):
    accelerate = _accelerate()
    if "project_dir" in kw:
        kw = dict(project_dir=str(tmp_path))
    theirs = accelerate.Accelerator(cpu=True, **kw)
    t = {p: getattr(theirs, p) for p in PROPS}
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    ours = Accelerator(cpu=True, **kw)
    o = {p: getattr(ours, p) for p in PROPS}
    for p in PROPS:
        a, b = o[p], t[p]
        if p == "distributed_type":  # the same member by value, printed alike
            assert a.value == b.value and str(a) == str(b), (a, b)
            continue
        assert a == b, f"{p}: ours {a!r}, accelerate {b!r}"


def test_prepare_returns_objects_in_order_and_passes_unknown_types_through():
    acc = Accelerator()
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    dl = make_loader(n=8, batch_size=4)
    d = {"a": 1}
    out = acc.prepare(d, sched, 3, dl, opt, "s", model, None)
    assert len(out) == 8
    assert out[0] is d and out[2] == 3 and out[5] == "s" and out[7] is None
    assert out[6] is model
    assert isinstance(out[4], torch.optim.Optimizer) and out[4].optimizer is opt
    assert out[1].scheduler is sched
    assert isinstance(out[3], torch.utils.data.DataLoader) and len(out[3]) == len(dl)
    # a single object comes back alone
    assert acc.prepare(d) is d
    assert acc.prepare(model) is model
    # already-prepared objects are not wrapped twice
    again = acc.prepare(out[4], out[1])
    assert again[0] is out[4] and again[1] is out[1]


def test_prepare_order_matches_accelerate():
    accelerate = _accelerate()

    def kinds(acc):
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        out = acc.prepare({"a": 1}, sched, 3, make_loader(n=8, batch_size=4), opt, model)
        return [type(o).__name__ for o in out]

    theirs = kinds(accelerate.Accelerator(cpu=True))
    ours = kinds(Accelerator())
    assert ours == theirs


def test_collectives_trivial_on_one_process():
    acc = Accelerator()
    t = torch.arange(6.0).view(2, 3)
    nested = {"a": t, "b": [t + 1, (t + 2,)]}
    assert torch.equal(acc.gather(t), t)
    g = acc.gather(nested)
    assert torch.equal(g["a"], t) and torch.equal(g["b"][1][0], t + 2)
    assert torch.equal(acc.gather(torch.tensor(3.0)), torch.tensor(3.0))
    for red in ("sum", "mean", "none"):
        r = acc.reduce(t, red)
        assert torch.equal(r, t)
        assert r is not t  # a copy, as in accelerate
    r = acc.reduce(nested, "mean")
    assert torch.equal(r["b"][0], t + 1)
    assert torch.equal(acc.pad_across_processes(t), t)
    assert torch.equal(acc.pad_across_processes(t, dim=1, pad_index=-1, pad_first=True), t)
    assert torch.equal(acc.gather_for_metrics(t), t)
    p = acc.pad_across_processes(nested)
    assert torch.equal(p["b"][0], t + 1)


def test_reduce_max_accepted():
    acc = Accelerator()
    t = torch.arange(6.0)
    assert torch.equal(acc.reduce(t, "max"), t)


def test_reduce_scale_matches_accelerate():
    accelerate = _accelerate()
    t = torch.arange(6.0)
    theirs = accelerate.Accelerator(cpu=True).reduce(t, "sum", scale=2.0)
    assert torch.equal(Accelerator().reduce(t, "sum", scale=2.0), theirs)


def test_collectives_match_accelerate():
    accelerate = _accelerate()
    t = torch.arange(6.0).view(2, 3)
    ref = accelerate.Accelerator(cpu=True)
    expected = [ref.gather(t), ref.reduce(t, "sum"), ref.reduce(t, "mean"), ref.pad_across_processes(t, dim=1),
                ref.gather_for_metrics(t)]
    acc = Accelerator()
    got = [acc.gather(t), acc.reduce(t, "sum"), acc.reduce(t, "mean"), acc.pad_across_processes(t, dim=1),
           acc.gather_for_metrics(t)]
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_on_main_process_decorators_run(capsys):
    acc = Accelerator()
    calls = []

    @acc.on_main_process
    def f(x):
        calls.append(("main", x))
        return x * 2

    @acc.on_local_main_process
    def g():
        calls.append("local")

    @acc.on_last_process
    def h():
        calls.append("last")

    @acc.on_process(process_index=0)
    def i():
        calls.append("p0")

    @acc.on_process(process_index=1)
    def j():
        calls.append("p1")

    assert f(3) == 6
    g(), h(), i(), j()
    assert calls == [("main", 3), "local", "last", "p0"]
    assert f.__name__ == "f"
    acc.print("hello", 1, sep="-")
    assert capsys.readouterr().out == "hello-1\n"
    acc.wait_for_everyone()
    with acc.main_process_first():
        pass
    with acc.local_main_process_first():
        pass
    with acc.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]


def test_mixed_precision_outputs_fp32_and_equal_torch_autocast():
    for mp, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        accelerate_c.AcceleratorState._reset_state()
        accelerate_c.GradientState._reset_state()
        model = make_model(0)
        ref = copy.deepcopy(model)
        acc = Accelerator(mixed_precision=mp)
        model = acc.prepare(model)
        x = torch.randn(5, 8)
        out = model(x)
        assert out.dtype == torch.float32
        with torch.autocast("cpu", dtype=dtype):
            ref_out = ref(x)
        assert ref_out.dtype == dtype
        assert torch.equal(out, ref_out.float())
        assert not torch.equal(out, ref(x))  # really computed in low precision


def test_unwrap_model_keep_fp32_wrapper_false_restores_original_forward():
    model = make_model(0)
    ref = copy.deepcopy(model)
    acc = Accelerator(mixed_precision="bf16")
    model = acc.prepare(model)
    x = torch.randn(5, 8)
    wrapped = acc.unwrap_model(model)
    assert wrapped is model
    assert model(x).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x).dtype == torch.float32  # the fp32 wrapper converts the outputs
    plain = acc.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain is model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain(x).dtype == torch.bfloat16  # no fp32 conversion any more
    # and without autocast, the forward is the plain fp32 one
    assert torch.equal(plain(x), ref(x))
    assert "forward" not in plain.__dict__ or plain.forward.__func__ is type(plain).forward


def test_unwrap_model_matches_accelerate_dtypes():
    accelerate = _accelerate()
    x = torch.randn(5, 8)

    def dtypes(acc):
        m = acc.prepare(make_model(0))
        a = m(x).dtype
        u = acc.unwrap_model(m, keep_fp32_wrapper=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = u(x).dtype
        return a, b, u(x)

    theirs = dtypes(accelerate.Accelerator(cpu=True, mixed_precision="bf16"))
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    ours = dtypes(Accelerator(mixed_precision="bf16"))
    assert ours[:2] == theirs[:2]
    assert torch.equal(ours[2], theirs[2])


@pytest.mark.parametrize("mp", ["no", "bf16", "fp16"])
def test_autocast_context(mp):
    acc = Accelerator(mixed_precision=mp)
    assert not torch.is_autocast_enabled("cpu")
    with acc.autocast():
        enabled = torch.is_autocast_enabled("cpu")
        dtype = torch.get_autocast_dtype("cpu")
        y = torch.nn.functional.linear(torch.randn(2, 3), torch.randn(4, 3))
    assert enabled == (mp != "no")
    if mp != "no":
        assert dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[mp]
        assert y.dtype == dtype
    else:
        assert y.dtype == torch.float32
    assert not torch.is_autocast_enabled("cpu")
    with acc.autocast(autocast_handler=AutocastKwargs(enabled=False)):
        assert not torch.is_autocast_enabled("cpu")


def test_set_and_check_trigger():
    acc = Accelerator()
    assert acc.check_trigger() is False
    acc.set_trigger()
    assert acc.check_trigger() is True
    assert acc.check_trigger() is False  # reset after firing


def test_free_memory_return_values_and_state():
    acc = Accelerator()
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    a, b = acc.free_memory(model, opt)
    assert a is None and b is None
    assert acc.step == 0
    # a fresh prepare works after free_memory
    m2 = make_model(1)
    m2 = acc.prepare(m2)
    x, y = next(iter(make_loader(n=4, batch_size=4)))
    ref = copy.deepcopy(make_model(1))
    acc.backward(loss_function(m2(x), y))
    loss_function(ref(x), y).backward()
    for p, q in zip(m2.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_prepared_objects_prepared_again_after_free_memory_are_registered_again_as_in_accelerate():
    """accelerate's find_executable_batch_size loop (and transformers' Trainer) hand the prepared
    optimizer, scheduler and loader back to prepare() after free_memory(): accelerate registers
    them again (so save_state includes them) and returns them as they are; so must we."""
    accelerate = _accelerate()

    def run(acc):
        model = make_model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        model, opt, sched, dl = acc.prepare(model, opt, sched, make_loader(n=8, batch_size=4))
        acc.free_memory()
        again = acc.prepare(model, opt, sched, dl)
        same = [a is b for a, b in zip(again[1:], (opt, sched, dl))]
        counts = [len(acc._optimizers), len(acc._schedulers), len(acc._dataloaders)]
        # prepare() passes a prepared scheduler through unregistered (it is no LRScheduler);
        # prepare_scheduler registers it again
        direct = acc.prepare_scheduler(sched) is sched
        return same, counts, direct, len(acc._schedulers)

    theirs = run(accelerate.Accelerator(cpu=True))
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    ours = run(Accelerator())
    assert ours == theirs, (ours, theirs)
    assert ours[0] == [True, True, True] and ours[1][0] == 1 and ours[1][2] == 1 and ours[3] == 1


def test_backward_divides_by_accumulation_steps_like_accelerate():
    accelerate = _accelerate()

    def grads(acc):
        model = acc.prepare(make_model(0))
        x, y = next(iter(make_loader(n=4, batch_size=4)))
        acc.backward(loss_function(model(x), y))
        return [p.grad.clone() for p in model.parameters()]

    theirs = grads(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=4))
    from accelerate.state import AcceleratorState as A

    A._reset_state(True)
    ours = grads(Accelerator(gradient_accumulation_steps=4))
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_repr_and_state_repr_do_not_fail():
    acc = Accelerator(mixed_precision="bf16")
    assert "bf16" in repr(acc)
    assert "Num processes: 1" in repr(acc.state)
    assert "Sync Gradients" in repr(acc.gradient_state)


def test_autocast_kwargs_disabled_gives_fp32_forward():
    model = make_model(0)
    ref = copy.deepcopy(model)
    acc = Accelerator(mixed_precision="bf16", kwargs_handlers=[AutocastKwargs(enabled=False)])
    model = acc.prepare(model)
    x = torch.randn(5, 8)
    assert torch.equal(model(x), ref(x))
    with acc.autocast():
        assert not torch.is_autocast_enabled("cpu")
