"""Every example of examples/ launched for a few steps on 2 processes through the real launcher
(tests/scripts/run_examples.py runs them one after the other in the same processes, to pay the
start-up once), and what each prints checked."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))


def _launch(*args, timeout=wait_s(180), config_file=None):
    exe = shutil.which("accelerate-c", path=os.path.dirname(sys.executable))
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    config = ["--config_file", config_file] if config_file else []
    return subprocess.run([exe, "launch", *config, "--num_processes", "2", "--cpu", "--main_process_port", "0", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_every_example_runs_a_few_steps_on_two_processes(tmp_path):
    res = _launch(os.path.join(HERE, "scripts", "run_examples.py"), str(tmp_path))
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"examples_{r}.json")) for r in range(2)]
    assert ranks[0] == ranks[1]  # every metric is computed over the gathered whole, the same everywhere
    rows = [json.loads(x) for x in open(tmp_path / "tracking" / "tracking_example" / "metrics.jsonl")]
    assert [r["_step"] for r in rows] == [1, 2, 3, 3] and "eval_accuracy" in rows[-1]
    assert sorted(os.listdir(tmp_path / "ckpts")) == ["step_2", "step_4"]
    # each example's first docstring line says what it shows and how to launch it
    examples = os.path.join(os.path.dirname(HERE), "examples")
    for folder in (examples, os.path.join(examples, "by_feature")):
        for name in os.listdir(folder):
            if name.endswith(".py") and name not in ("text_task.py", "tiny_corpus.py", "llama_task.py"):
                first = open(os.path.join(folder, name)).readline()
                assert first.startswith('"""') and "Launch: " in first or "make demo" in first, name


SEED_CONFIG = os.path.join(HERE, "data", "fsdp_seed_config.yaml")


def _eval_loss_bf16(folder, samples):
    """The mean token loss over `samples` of the model saved in `folder`, read by transformers'
    own from_pretrained and computed in plain torch with the weights in bf16 (the seed config's
    compute precision)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder).to(torch.bfloat16).eval()
    ids = torch.stack([s["input_ids"] for s in samples])
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.float().item()


def test_fsdp_and_trainer_examples_run_on_the_seed_config(tmp_path):
    """examples/by_feature/fsdp.py and trainer.py under the seed FSDP config file (the one
    tests/test_fsdp.py uses, tests/data/fsdp_seed_config.yaml) on 2 processes instead of its 4
    (tests/scripts/run_llama_examples.py): both run FSDP in bf16 on accelerate_c's Accelerator,
    each process holds half the parameters, and the weights each writes, read back by
    from_pretrained and evaluated in plain torch here, give the evaluation loss the example
    reported (every evaluation sample counted once across the processes)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
    import llama_task

    res = _launch(os.path.join(HERE, "scripts", "run_llama_examples.py"), str(tmp_path), config_file=SEED_CONFIG)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    ranks = [json.load(open(tmp_path / f"llama_examples_{r}.json")) for r in range(2)]
    fsdp, trainer = ranks[0]["fsdp"], ranks[0]["trainer"]
    for key in ("first_eval_loss", "eval_loss"):
        assert ranks[1]["fsdp"][key] == fsdp[key]
    assert ranks[1]["trainer"]["eval_loss"] == trainer["eval_loss"]
    for got in (fsdp, trainer):
        assert got["distributed_type"] == "FSDP" and got["num_processes"] == 2, got
    assert fsdp["mixed_precision"] == "bf16" and fsdp["steps"] == 3
    assert {r["fsdp"]["held"] for r in ranks} == {fsdp["total"] // 2}  # half of every (even-sized) tensor
    evals = llama_task.make_samples(20, seed=2)
    expect = _eval_loss_bf16(tmp_path / "fsdp_model", evals)
    assert abs(fsdp["eval_loss"] - expect) <= 2e-2 * expect, (fsdp["eval_loss"], expect)
    assert trainer["accelerator"] == "accelerate_c.accelerator" and trainer["global_step"] == 4
    assert trainer["checkpoints"] == ["checkpoint-4"]  # save_steps 2, save_total_limit 1
    # the seed config's SHARDED_STATE_DICT: the checkpoint holds each process's shard of the weights
    # (as transformers on accelerate writes none whole there); accelerate-c merge-weights assembles them
    ckpt, merged = tmp_path / "trainer" / "checkpoint-4", tmp_path / "trainer_merged"
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "model_shard_rank1.safetensors").exists()
    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    done = subprocess.run([exe, "merge-weights", str(ckpt), str(merged)], capture_output=True, text=True,
                          timeout=wait_s(120))
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copy(ckpt / "config.json", merged / "config.json")
    expect = _eval_loss_bf16(merged, evals)
    assert abs(trainer["eval_loss"] - expect) <= 2e-2 * expect, (trainer["eval_loss"], expect)
    assert [e["step"] for e in trainer["log_history"] if "loss" in e] == [1, 2, 3, 4]
