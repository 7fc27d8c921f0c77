"""`accelerate-c env` (CUDA / NCCL lines), `accelerate-c test` (the self-check through the real
launcher, with config files) and `accelerate-c estimate-memory` (numbers checked against the
parameter counts torch reports)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from accelerate_c.commands.main import main
from timeouts import wait_s

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODELS = os.path.join(HERE, "scripts", "trainer_estimate_model.py")
SUCCESS = "Test is a success! You are ready for your distributed training!"


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no default config file
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_env_reports_cuda_and_nccl(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = {l.split(":", 1)[0].strip("- "): l.split(":", 1)[1].strip() for l in out.splitlines() if ": " in l}
    assert lines["PyTorch CUDA devices"] == str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    usable = lines["CUDA usable by accelerate_c"]
    assert usable == "yes" if torch.cuda.is_available() and torch.cuda.device_count() else usable.startswith("no (")
    nccl = lines["NCCL usable"]
    assert nccl.startswith("yes (") or (nccl.startswith("no (") and len(nccl) > len("no ()")), nccl
    if not torch.cuda.is_available():
        assert nccl.startswith("no (") and "NCCL" in nccl  # the loader's error text


def _cli(args, env=None, cwd=None, timeout=wait_s(180)):
    full = dict(os.environ, **(env or {}))
    full.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "accelerate_c.commands.main", *args], capture_output=True,
                          text=True, timeout=timeout, env=full, cwd=cwd)


def test_test_command_on_two_cpu_processes_from_a_config_file(tmp_path):
    cfg = tmp_path / "multi_cpu.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_CPU\nnum_processes: 2\n"
                   "num_machines: 1\nmachine_rank: 0\nmain_process_port: 0\nuse_cpu: true\nmixed_precision: 'no'\n")
    res = _cli(["test", "--config_file", str(cfg)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert SUCCESS in res.stdout and "self-check on 2 process(es)" in res.stdout


def test_test_command_one_process_bf16_and_failures(tmp_path):
    cfg = tmp_path / "one.yaml"
    cfg.write_text("distributed_type: 'NO'\nmixed_precision: bf16\nuse_cpu: true\n")
    res = _cli(["test", "--config_file", str(cfg)])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert SUCCESS in res.stdout and "mixed_precision=bf16" in res.stdout
    # a config accelerate_c cannot run, and a run that fails inside: non-zero, no success line
    bad = tmp_path / "megatron.yaml"
    bad.write_text("distributed_type: MEGATRON_LM\nnum_processes: 2\n")
    res = _cli(["test", "--config_file", str(bad)])
    assert res.returncode != 0 and SUCCESS not in res.stdout and "not supported" in res.stderr
    res = _cli(["test", "--config_file", str(cfg)], env={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "x"})
    assert res.returncode != 0 and SUCCESS not in res.stdout and "Test failed" in res.stderr


def _estimate(capsys, *args):
    assert main(["estimate-memory", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _expected(P, T, size, n):
    """Independent arithmetic: bytes per rank per strategy (see the command's docstring)."""
    shard = lambda k: -(-k // n)  # noqa: E731
    opt = 8 + (4 if size == 2 else 0)
    return {"DDP": size * P + size * T + opt * T,
            "ZeRO-1": size * P + size * T + opt * shard(T),
            "ZeRO-2": size * P + size * shard(T) + opt * shard(T),
            "ZeRO-3": size * (P - T) + size * shard(T) + size * shard(T) + opt * shard(T)}


@pytest.mark.parametrize("factory,n", [("mlp", 1), ("mlp", 3), ("half_frozen", 4)])
def test_estimate_memory_numbers(capsys, factory, n):
    import importlib.util

    spec = importlib.util.spec_from_file_location("m", MODELS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = getattr(mod, factory)()
    P = sum(p.numel() for p in model.parameters())
    T = sum(p.numel() for p in model.parameters() if p.requires_grad)
    r = _estimate(capsys, f"{MODELS}:{factory}", "--num_processes", str(n))
    assert r["params"] == P == 22210 and r["trainable"] == T and r["built_on_meta"]
    assert r["largest_layer"] == "0" and r["largest_layer_params"] == 20200
    assert set(r["dtypes"]) == {"float32", "float16", "bfloat16"}
    for dtype, size in (("float32", 4), ("float16", 2), ("bfloat16", 2)):
        d = r["dtypes"][dtype]
        assert d["largest_layer_bytes"] == 20200 * size and d["model_bytes"] == P * size
        assert {k: d[k]["total"] for k in ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")} == _expected(P, T, size, n)
    if n == 1 and factory == "mlp":
        assert r["dtypes"]["float32"]["DDP"]["total"] == 16 * P  # 4 + 4 + 8 bytes per parameter


def test_estimate_memory_import_paths_and_table(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    r = _estimate(capsys, "examples.train_gpt:TinyGPT", "--model_kwargs", '{"vocab": 65, "seq_len": 64}',
                  "--dtypes", "bfloat16")
    sys.path.insert(0, REPO)
    from examples.train_gpt import TinyGPT

    assert r["params"] == sum(p.numel() for p in TinyGPT(vocab=65, seq_len=64).parameters())
    assert list(r["dtypes"]) == ["bfloat16"]
    r = _estimate(capsys, f"{MODELS}:NeedsRealTensors")
    assert not r["built_on_meta"] and r["params"] == 16 * 16 + 16
    assert main(["estimate-memory", f"{MODELS}:mlp", "--num_processes", "8"]) == 0
    out = capsys.readouterr().out
    for word in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "DDP", "Largest layer", "float32", "bfloat16", "22,210 parameters"):
        assert word in out


@pytest.mark.parametrize("args,match", [
    (["no_colon_here"], "must look like"),
    (["no_such_module_xyz:Model"], "cannot import"),
    ([f"{MODELS}:missing"], "has no attribute"),
    ([f"{MODELS}:NOT_A_MODEL"], "not a class or a function"),
    (["examples.train_gpt:TinyGPT"], "--model_kwargs"),
    ([f"{MODELS}:mlp", "--dtypes", "int3"], "unknown dtype"),
    ([f"{MODELS}:mlp", "--num_processes", "0"], "must be >= 1"),
    ([f"{MODELS}:mlp", "--model_kwargs", "[1]"], "JSON object"),
])
def test_estimate_memory_errors(args, match, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit, match=match):
        main(["estimate-memory", *args])
