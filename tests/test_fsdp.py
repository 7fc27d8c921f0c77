"""Full sharding (FSDP / ZeRO stage 3: strategies/fsdp.py, fsdp_units.py) turned on the way a
user does: accelerate's FullyShardedDataParallelPlugin, or a config file with distributed_type
FSDP. The training itself is held to torch DDP (fp32) and to FSDP2's bf16 policy written out in
torch (tests/scripts/fsdp_train.py); here: that script over the axes, and what is refused."""
from __future__ import annotations

import os

import pytest
import torch

from accelerate_c import Accelerator
from accelerate_c.fsdp_plugin import FullyShardedDataParallelPlugin, fsdp_settings
from helpers import fresh_state  # noqa: F401  (an autouse fixture: fresh accelerator states)
from test_launch import SCRIPTS, launch
from timeouts import wait_s


def _script_passes(world, script, *args, says):
    res = launch(["--num_processes", str(world), "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, script), *args], timeout=wait_s(120))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert says in res.stdout


@pytest.mark.parametrize("world,mp,reshard,wrap,ckpt,tied", [
    (2, "fp32", "1", "TRANSFORMER_BASED_WRAP", "reentrant", "tied"),
    (3, "fp32", "0", "SIZE_BASED_WRAP", "none", "tied"),
    (2, "bf16", "1", "TRANSFORMER_BASED_WRAP", "none", "tied"),
    (4, "bf16", "0", "TRANSFORMER_BASED_WRAP", "ac", "tied"),
    (2, "bf16", "1", "TRANSFORMER_BASED_WRAP", "none", "untied"),
])
def test_fsdp_trains_as_torch_with_everything_sharded(world, mp, reshard, wrap, ckpt, tied):
    """Parameters after every step, norms and learning rates against torch (DDP, or the bf16
    policy written out), 1/N of the parameters and optimizer state per process between steps,
    no full gradient in p.grad, model.state_dict() refused, eval under no_grad/inference_mode;
    with FSDP's activation_checkpointing (each unit recomputed in backward) or the model's own
    reentrant checkpointing (a nested backward per block); with an untied output layer (the
    root unit's gradients first and last in backward)."""
    _script_passes(world, "fsdp_train.py", mp, reshard, wrap, ckpt, tied,
                   says=f"fsdp {mp} reshard={reshard} {wrap} {ckpt} OK on {world} processes")


def test_plugin_reads_accelerates_fields_and_variables(monkeypatch):
    """Our plugin's fields left unset come from the FSDP_* variables accelerate's launcher
    exports; accelerate's own plugin reads the same; both give the same settings."""
    from accelerate.utils import FullyShardedDataParallelPlugin as AccPlugin

    env = {"FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
           "FSDP_TRANSFORMER_LAYER_CLS_TO_WRAP": "Block", "FSDP_TRANSFORMER_CLS_TO_WRAP": "Block",
           "FSDP_STATE_DICT_TYPE": "SHARDED_STATE_DICT", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ours = fsdp_settings(FullyShardedDataParallelPlugin(), "bf16")
    theirs = fsdp_settings(AccPlugin(), "bf16")
    assert ours == theirs
    assert ours.version == 2 and ours.reshard_after_forward is False
    assert ours.wrap_policy == "TRANSFORMER_BASED_WRAP" and ours.wrap_classes == ("Block",)
    assert ours.param_dtype == torch.bfloat16 and ours.state_dict_type == "SHARDED_STATE_DICT"


@pytest.mark.parametrize("kwargs,says", [
    ({"sharding_strategy": "HYBRID_SHARD"}, "HYBRID_SHARD"),
    ({"sharding_strategy": "NO_SHARD"}, "NO_SHARD"),
    ({"fsdp_version": 2, "auto_wrap_policy": lambda m: True}, "auto_wrap_policy"),
    ({"fsdp_version": 2, "state_dict_type": "LOCAL_STATE_DICT"}, "LOCAL_STATE_DICT"),
    ({"fsdp_version": 2, "mixed_precision_policy": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}, "reduce_dtype"),
])
def test_what_is_not_built_is_refused_by_name(kwargs, says):
    with pytest.raises((NotImplementedError, ValueError), match=says):
        fsdp_settings(FullyShardedDataParallelPlugin(**kwargs), "no")


def test_fp16_under_fsdp_scales_the_loss_as_torchs_sharded_grad_scaler():
    """accelerate's scaler under FSDP is torch's ShardedGradScaler (GradScaler's rule, the found
    inf agreed across processes): the same rule and defaults, and FSDP2's fp16 policy (the
    training itself is held to it by the differential harness, reference_fsdp.py)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    acc = Accelerator(cpu=True, mixed_precision="fp16", fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    theirs = ShardedGradScaler(device="cpu")
    assert (acc.scaler.get_scale(), acc.scaler.get_growth_factor(), acc.scaler.get_backoff_factor(),
            acc.scaler.get_growth_interval()) == (theirs.get_scale(), theirs.get_growth_factor(),
                                                  theirs.get_backoff_factor(), theirs.get_growth_interval())
    assert acc.distributed_type == "FSDP" and acc.mixed_precision == "fp16"


def test_one_process_reports_fsdp():
    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    assert acc.distributed_type == "FSDP" and acc.is_fsdp2
    assert acc.state.fsdp_plugin is not None


SEED_CONFIG = os.path.join(os.path.dirname(__file__), "data", "fsdp_seed_config.yaml")


def test_the_seed_fsdp_config_trains_llama_on_4_processes(tmp_path):
    """The transformers Trainer page's FSDP config file, verbatim (tests/data/fsdp_seed_config.yaml),
    through `accelerate-c launch --config_file`: a LlamaForCausalLM loaded with from_pretrained
    from a local folder on the main process and built on the meta device on processes 1-3 (the
    config's cpu_ram_efficient_loading), against the unsharded same-policy run (1e-3) and the autocast run
    (3e-2) computed in the script; ~1/4 of the elements per process; generate() as the unsharded
    model's."""
    res = launch(["--config_file", SEED_CONFIG, "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fsdp_seed_llama.py"), str(tmp_path / "llama")], timeout=wait_s(240))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "fsdp seed llama OK on 4 processes" in res.stdout


def test_transformers_trainer_on_the_seed_config_saves_sharded_and_resumes(tmp_path):
    """accelerate_c.transformers.Trainer (transformers' own Trainer) under the seed FSDP config on 4
    processes (tests/scripts/hf_trainer_llama.py, bf16): trains with eval and save_steps; every
    process writes its own optimizer shard and its shard of the weights in each checkpoint
    (SHARDED_STATE_DICT); resumed in new processes on 4 it
    ends bit for bit where the uninterrupted run ended, and on 2 it continues to the last step;
    trainer.save_model() writes what LlamaForCausalLM.from_pretrained loads equal to the
    trained weights."""
    import json

    import torch

    script = os.path.join(SCRIPTS, "hf_trainer_llama.py")
    out = tmp_path / "out"

    def run(world, *args, out=out):
        res = launch(["--config_file", SEED_CONFIG, "--num_processes", str(world), "--cpu", "--main_process_port", "0",
                      script, str(out), str(tmp_path / f"r{world}.json"), "--backend", "accelerate_c", *args],
                     timeout=wait_s(300))
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return json.loads((tmp_path / f"r{world}.json").read_text())

    first = run(4, "--mp", "bf16", "--part", "bf16", "--save-model")
    assert first["bf16"]["num_processes"] == 4 and first["bf16"]["global_step"] == 8
    assert first["bf16"]["saved_model_reloads"] is True
    ckpt = out / "bf16-part" / "checkpoint-4"
    assert sorted(p.name for p in ckpt.glob("zero_optimizer_rank?.safetensors")) == \
        [f"zero_optimizer_rank{r}.safetensors" for r in range(4)]
    # SHARDED_STATE_DICT (the seed config's): the weights too, each process its shard; nobody the whole
    shards = sorted(ckpt.glob("model_shard_rank?.safetensors"))
    assert [p.name for p in shards] == [f"model_shard_rank{r}.safetensors" for r in range(4)]
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "config.json").exists()
    sizes = [p.stat().st_size for p in shards]
    assert max(sizes) < 0.5 * sum(sizes), sizes
    import shutil

    shutil.copytree(out / "bf16-part", tmp_path / "out2" / "bf16-part")  # for the resume on 2 below
    resumed = run(4, "--resume", "bf16")["bf16-resumed"]
    assert resumed["global_step"] == 8
    a, b = torch.load(out / "bf16" / "final.pt"), torch.load(out / "bf16-part" / "final.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # on 2 processes: the saved shards resharded; training continues from step 4 to 8
    on2 = run(2, "--resume", "bf16", out=tmp_path / "out2")["bf16-resumed"]
    assert on2["num_processes"] == 2 and on2["global_step"] == 8
    # the history saved at step 4 and the steps trained after it, each once
    assert [h["step"] for h in on2["log_history"] if "loss" in h] == list(range(1, 9))


@pytest.mark.parametrize("fsdp,cfg", [
    ("full_shard auto_wrap", {"transformer_layer_cls_to_wrap": ["Block"]}),
    ("shard_grad_op", {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100}),
    (True, {"activation_checkpointing": True, "reshard_after_forward": False, "state_dict_type": "SHARDED_STATE_DICT"}),
])  # (FSDP1: accelerate's plugin then needs a GPU to be built, so it cannot be the reference here)
def test_training_args_fsdp_gives_what_transformers_gives_accelerate(tmp_path, monkeypatch, fsdp, cfg):
    """TrainingArguments(fsdp=..., fsdp_config=...): the plugin transformers builds for accelerate
    (its fsdp_plugin_args into accelerate's own plugin) and ours, from transformers' arguments
    (accelerate_c.transformers.Trainer) and from accelerate_c's own TrainingArguments, run the
    same settings."""
    import transformers
    from accelerate.utils import FullyShardedDataParallelPlugin as AccPlugin

    from accelerate_c.fsdp_plugin import plugin_from_training_args

    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # transformers sets it; restored after
    args = transformers.TrainingArguments(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config=dict(cfg), use_cpu=True,
                                          report_to="none")
    theirs = fsdp_settings(AccPlugin(**args.fsdp_plugin_args), "bf16")
    assert fsdp_settings(FullyShardedDataParallelPlugin(**args.fsdp_plugin_args), "bf16") == theirs
    assert fsdp_settings(plugin_from_training_args(fsdp, dict(cfg)), "bf16") == theirs


def test_a_collective_called_on_one_process_names_the_unit_within_the_timeout():
    """get_state_dict under `if is_main_process` (tests/scripts/fsdp_one_rank.py, timeout 5 s): a
    RuntimeError naming the unit whose gather did not complete, not a hang."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fsdp_one_rank.py")], timeout=wait_s(120),
                 env={"FSDP_TIMEOUT_S": str(wait_s(5 / 3))})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "one-rank get_state_dict refused after" in res.stdout and "unit 'a' (Linear)" in res.stdout


@pytest.mark.parametrize("comm", ["shm", "gloo"])
def test_a_unit_skipped_on_one_process_names_a_unit_on_every_process(comm):
    """A forward whose path depends on the rank (tests/scripts/fsdp_one_rank.py skip, timeout 5 s):
    the processes' gathers no longer pair up; each gets a RuntimeError naming a unit (shared
    memory sees the mismatch at once, gloo at the timeout), never a hang or a silent result."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fsdp_one_rank.py"), "skip"], timeout=wait_s(120),
                 env={"ACCELERATE_C_COMM": comm, "FSDP_TIMEOUT_S": str(wait_s(5 / 3))})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: a skipped unit refused after" in res.stdout, res.stdout[-3000:]


def test_a_layer_some_forwards_leave_out_needs_no_flag_as_in_fsdp2():
    """tests/scripts/fsdp_unused.py: a layer of the root unit left out of every other forward,
    no find_unused_parameters: within 1e-5 of torch DDP(find_unused_parameters=True)."""
    res = launch(["--num_processes", "2", "--cpu", "--main_process_port", "0",
                  os.path.join(SCRIPTS, "fsdp_unused.py")], timeout=wait_s(120))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "fsdp unused layer OK" in res.stdout


def test_meta_models_are_refused_by_name_where_they_cannot_be_loaded():
    """A model on the meta device on a process other than the main one: refused by data
    parallelism on every process (naming the process and the parameter), accepted by full
    sharding (which the seed-config test loads that way); the main process on meta: refused."""
    _script_passes(2, "meta_models.py", says="meta models refused OK on 2 processes")


def test_free_memory_keeps_a_model_prepared_again_and_frees_a_dropped_one():
    """tests/scripts/fsdp_free_memory.py: the same model and optimizer prepared again after
    free_memory() train as torch DDP; a model and optimizer dropped after it are freed (the
    strategy held every prepared model's units before)."""
    _script_passes(2, "fsdp_free_memory.py", says="fsdp free_memory OK")


def test_the_next_units_gather_is_launched_while_this_one_computes():
    """Prefetch (forward order, reverse in backward): launched before the current unit computes,
    at most one unit gathered ahead, a prefetched unit that a forward leaves out released; the
    parameters bitwise equal to prefetch off and within 1e-5 of torch DDP
    (tests/scripts/fsdp_prefetch.py)."""
    _script_passes(3, "fsdp_prefetch.py", says="prefetch OK")


def test_an_encoder_decoder_generates_as_the_unsharded_model():
    """T5's generate() runs its encoder outside the model's forward (get_encoder()), on the shared
    embedding of the root unit; tokens equal the unsharded model's before and after a step (the
    step against torch DDP), each process its own length (tests/scripts/fsdp_seq2seq_generate.py)."""
    _script_passes(2, "fsdp_seq2seq_generate.py", says="seq2seq generate OK on 2 processes")


@pytest.mark.parametrize("mode,says", [("window", "fsdp fp16 window refusal OK"), ("gan", "fsdp fp16 gan OK"),
                                       ("split", "fsdp fp16 split OK")])
def test_fp16_unscales_each_gradient_shard_once_per_update_as_gradscaler(mode, says):
    """tests/scripts/fsdp_fp16_unscale.py on 2 processes, against torch.amp.GradScaler: a second
    unscale after more backward in one accumulation window refused (torch refuses it), a GAN
    loop (two models, each clipped then stepped in turn) with the norms, parameters and loss
    scale torch's gives, and one model's shard under two optimizers, one overflowing (each
    optimizer skips on its own gradients)."""
    _script_passes(2, "fsdp_fp16_unscale.py", mode, says=f"rank 1: {says}")
