"""ZeRO stages 1 and 2 (strategies/zero.py, zero2.py) turned on the way a user does: accelerate's
DeepSpeedPlugin. The training itself is held to torch DDP in tests/scripts/zero_train.py and to
DeepSpeed's 16-bit policy in torch in tests/scripts/zero_16bit.py (and in the differential
harness's sharding axis); here: those scripts on 2, 3 and 4 processes, and what the plugin refuses."""
from __future__ import annotations

import os

import pytest
import torch
from accelerate.utils import DeepSpeedPlugin

from accelerate_c import Accelerator
from helpers import fresh_state  # noqa: F401  (an autouse fixture: fresh accelerator states)
from test_launch import SCRIPTS, launch
from timeouts import wait_s


def _script_passes(world, script, *args, says):
    res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, script), *args], timeout=wait_s(120))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert says in res.stdout


# every (kind, stage) on 2 processes; on 4 (15 s a launch: this tests have a time
# budget) each kind once, each stage once
@pytest.mark.parametrize("kind,world,stage", [("bf16", 2, 1), ("bf16", 2, 2), ("fp16", 2, 1), ("fp16", 2, 2),
                                              ("bf16", 4, 2), ("fp16", 4, 1)])
def test_zero_16bit_is_deepspeeds_policy(kind, world, stage):
    """A 16-bit model with fp32 masters sharded (fp16: DeepSpeed's loss scaler, overflows
    skipped everywhere): against the same policy in torch, one process under autocast, and the
    bytes of 4Ψ + 12Ψ/N (stage 1) or 2Ψ + 14Ψ/N (stage 2) (tests/scripts/zero_16bit.py)."""
    _script_passes(world, "zero_16bit.py", kind, str(stage), says=f"zero{stage} {kind} OK on {world} processes")


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world", [2, 3])
def test_zero_trains_as_torch_ddp_with_the_state_sharded(world, stage):
    """The optimizer state (stage 1), and the gradients too (stage 2), sharded: against torch DDP
    (tests/scripts/zero_train.py)."""
    _script_passes(world, "zero_train.py", str(stage), says=f"zero{stage} OK on {world} processes")


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_edge_loops_match_torch_ddp(stage):
    """free_memory() and prepare again, model.zero_grad(), a failed backward, reentrant
    checkpointing (tests/scripts/zero_edges.py): what a review found wrong, against torch DDP."""
    _script_passes(2, "zero_edges.py", str(stage), says=f"zero{stage} edges OK")


def test_what_is_not_built_is_refused_by_name():
    for stage in (1, 3):  # fp16 at every stage: DeepSpeed's loss scaler, 2**16 to start with
        acc = Accelerator(cpu=True, mixed_precision="fp16", deepspeed_plugin=DeepSpeedPlugin(zero_stage=stage))
        assert type(acc.scaler).__name__ == "DeepSpeedScaler" and acc.scaler.get_scale() == 2.0 ** 16
    # on CPU processes the optimizer state is on the CPU already: the offload is what runs
    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=1, offload_optimizer_device="cpu"))
    assert acc.sharding.offload_optimizer == "cpu"
    with pytest.raises(RuntimeError, match="clip_grad_value_ is not supported under DeepSpeed"):
        acc.clip_grad_value_(torch.nn.Linear(2, 2).parameters(), 1.0)


def test_a_plugin_that_is_not_one_is_a_type_error():
    with pytest.raises(TypeError, match="deepspeed_plugin"):
        Accelerator(cpu=True, deepspeed_plugin=object())


def test_the_plugins_accumulation_and_precision_win():
    """As in accelerate: the DeepSpeed configuration's accumulation count wins over the
    Accelerator's (with a warning), and its bf16 section sets the mixed precision."""
    with pytest.warns(UserWarning, match="using the DeepSpeed config's 2"):
        acc = Accelerator(cpu=True, gradient_accumulation_steps=3,
                          deepspeed_plugin=DeepSpeedPlugin(zero_stage=1, gradient_accumulation_steps=2))
    assert acc.gradient_accumulation_steps == 2
    acc = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(
        hf_ds_config={"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
                      "train_micro_batch_size_per_gpu": 2}))
    assert acc.mixed_precision == "bf16" and not acc.native_amp  # DeepSpeed's bf16: no autocast
    with pytest.raises(NotImplementedError, match="one process"):
        acc.prepare(torch.nn.Linear(2, 2))


def test_one_process_trains_as_without_the_plugin():
    """On one process there is nothing to shard: the same numbers as a plain Accelerator."""
    def run(**kw):
        acc = Accelerator(cpu=True, **kw)
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        for i in range(4):
            x = torch.full((2, 5), float(i))
            with acc.accumulate(model):
                acc.backward(model(x).square().mean())
                opt.step()
                opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    from accelerate_c.state import AcceleratorState, GradientState
    plain = run()
    AcceleratorState._reset_state()
    GradientState._reset_state()
    plugin = DeepSpeedPlugin(zero_stage=1, gradient_accumulation_steps=1, gradient_clipping=0.0)
    plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 2
    zero = run(deepspeed_plugin=plugin)
    assert all(torch.equal(a, b) for a, b in zip(plain, zero))


def _ds(extra):
    cfg = {"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0}
    cfg.update(extra)
    return DeepSpeedPlugin(hf_ds_config=cfg)


_BLOCKS = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 4}}}


def test_a_scheduler_block_is_never_dropped():
    """DeepSpeed's engine would build and step the block's scheduler; without a DummyScheduler
    to step it through, prepare() says so instead of training at a constant lr."""
    from accelerate.utils.deepspeed import DummyOptim

    acc = Accelerator(cpu=True, deepspeed_plugin=_ds(_BLOCKS))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="scheduler block .*WarmupLR.* no scheduler"):
        acc.prepare(model, DummyOptim(model.parameters()))


def test_the_callable_wins_over_the_block():
    """As DeepSpeed's engine: a DummyScheduler's lr_scheduler_callable is preferred to the block."""
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    acc = Accelerator(cpu=True, deepspeed_plugin=_ds(_BLOCKS))
    model = torch.nn.Linear(2, 2)
    dopt = DummyOptim(model.parameters())
    made = []

    def build(opt):
        made.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5))
        return made[-1]

    _, opt, sched = acc.prepare(model, dopt, DummyScheduler(dopt, lr_scheduler_callable=build))
    assert made and sched.scheduler is made[0] and isinstance(opt.optimizer, torch.optim.SGD)
    assert sched.once_per_step  # the engine's: once per optimizer step


def test_evaluation_models_keep_their_dtype():
    """accelerate's prepare_model(evaluation_mode=True) under DeepSpeed leaves the model alone."""
    acc = Accelerator(cpu=True, deepspeed_plugin=_ds({"bf16": {"enabled": True}}))
    teacher = acc.prepare_model(torch.nn.Linear(2, 2), evaluation_mode=True)
    assert all(p.dtype == torch.float32 for p in teacher.parameters())


def test_stage3_state_dict_is_deepspeeds_consolidated_16bit_one():
    """The main process gets the bf16 weights (a tied weight one tensor), the others None, as
    DeepSpeed's consolidated state dict; without stage3_gather_16bit_weights_on_model_save an
    error naming it (tests/scripts/zero3_state_dict.py)."""
    _script_passes(2, "zero3_state_dict.py", says="zero3 state dict OK")


def test_stage3_persistent_parameters_are_those_of_at_most_the_threshold():
    """DeepSpeed's stage3_param_persistence_threshold: a parameter of at most that many elements
    stays gathered (DeepSpeed marks `ds_numel <= threshold` persistent; its engine is not installed
    here, so the rule is taken from its source). Sizes on both sides of the threshold and at it;
    one process (no collective: build_units without a source rank)."""
    from accelerate_c.fsdp_units import build_units, unit_modules

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 3))
    sizes = {n: p.numel() for n, p in model.named_parameters()}  # 16, 4, 8, 2, 6, 3
    threshold = 6
    units = build_units(model, unit_modules(model, "SIZE_BASED_WRAP", min_num_params=1), world=1, rank=0,
                        persist_below=threshold)
    names = {id(p): n for n, p in model.named_parameters()}
    in_root = {names[id(p)] for ug in units[-1].groups for p in ug.params}
    assert in_root == {n for n, k in sizes.items() if k <= threshold}, (in_root, sizes)
    assert "2.weight" in in_root  # exactly the threshold's size
