"""Config files: schema errors, YAML/JSON, files shared with accelerate, `accelerate-c config`,
launch precedence (flags > config > defaults) and the default location. HF_HOME always points at
a temporary directory."""
import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from accelerate_c.commands import launch as launch_cmd
from accelerate_c.commands.main import build_parser, main
from accelerate_c.utils.config import (
    ConfigError,
    default_config_file,
    load_config_from_file,
    write_config_file,
)
from timeouts import wait_s

VENV_BIN = os.path.dirname(sys.executable)

FSDP_DOCS = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config: {fsdp_version: 2, fsdp_reshard_after_forward: true, fsdp_cpu_offload: false, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, fsdp_cpu_ram_efficient_loading: true, fsdp_activation_checkpointing: false, fsdp_state_dict_type: SHARDED_STATE_DICT, fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer}
mixed_precision: bf16
num_machines: 1
num_processes: 4
"""

SHOW_ENV = ("import os, json\n"
            "print('ENV=' + json.dumps({k: v for k, v in os.environ.items() if k.startswith('ACCELERATE_') "
            "or k in ('CUDA_VISIBLE_DEVICES', 'OMP_NUM_THREADS')}))\n")


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return home


def test_accelerate_spellings(tmp_path):
    path = tmp_path / "c.yaml"
    # keys without the prefix accelerate's launcher adds, lower-case choices, unquoted NO
    path.write_text("distributed_type: fsdp\nfsdp_config: {version: 2, auto_wrap_policy: no_wrap}\n"
                    "dynamo_config: {backend: inductor}\nfp8_config: {override_linear_precision: [true, false, true]}\n")
    c = load_config_from_file(str(path))
    assert c.distributed_type == "FSDP" and c.fsdp_config == {"version": 2, "auto_wrap_policy": "NO_WRAP"}
    assert c.dynamo_config == {"backend": "INDUCTOR"}
    assert not any("dynamo" in p for p in c.unsupported())  # prepare() compiles (accelerate_c/compilation.py)


# Expected values come from accelerate 1.15's own reader (accelerate.commands.config) and from
# the literal cases below, never from accelerate_c's schema (utils/config_schema.py).
def _accelerate():
    return pytest.importorskip("accelerate.commands.config.config_args")


def _accelerate_fields():
    import dataclasses

    return [f.name for f in dataclasses.fields(_accelerate().ClusterConfig)]


def _plain(v):
    return getattr(v, "value", v)  # accelerate keeps compute_environment/distributed_type as enums


def test_missing_keys_get_accelerates_defaults(tmp_path):
    """A minimal file: every key of accelerate's ClusterConfig reads as accelerate reads it."""
    path = tmp_path / "c.yaml"
    # ('NO' quoted: unquoted, YAML 1.1 reads false, which accelerate keeps and accelerate_c reads as NO)
    for text in ("distributed_type: MULTI_CPU\n", "distributed_type: 'NO'\n",
                 "distributed_type: MULTI_GPU\nfp16: true\n"):
        path.write_text(text)
        theirs = _accelerate().load_config_from_file(str(path))
        ours = load_config_from_file(str(path)).values
        for name in _accelerate_fields():
            assert name in ours, f"{text!r}: key {name!r} of accelerate's ClusterConfig is unknown to accelerate_c"
            assert ours[name] == _plain(getattr(theirs, name)), (text, name, ours[name], getattr(theirs, name))


# one valid value per key of accelerate's ClusterConfig, written by hand (not its default)
SAMPLES = {
    "compute_environment": "LOCAL_MACHINE", "mixed_precision": "bf16", "use_cpu": True, "debug": True,
    "num_processes": 3, "machine_rank": 1, "num_machines": 2, "gpu_ids": "0,1", "main_process_ip": "10.0.0.1",
    "main_process_port": 29501, "rdzv_backend": "c10d", "same_network": True, "main_training_function": "train",
    "enable_cpu_affinity": True, "fp8_config": {"fp8_backend": "TE", "fp8_margin": 2},
    "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu"},
    "fsdp_config": {"fsdp_version": 2, "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
    "parallelism_config": {"parallelism_config_tp_size": 2},
    "megatron_lm_config": {"megatron_lm_tp_degree": 2}, "mpirun_config": {"mpirun_hostfile": "/etc/hosts"},
    "downcast_bf16": "yes", "tpu_name": "pod", "tpu_zone": "us-central1-a", "tpu_use_cluster": True,
    "tpu_use_sudo": True, "command_file": "start.sh", "commands": ["ls", "pwd"], "tpu_vm": ["vm-1"],
    "tpu_env": ["A=1"], "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune"},
    "distributed_type": "MULTI_CPU",
}


def test_every_accelerate_key_has_a_sample():
    # a key accelerate adds must be added here (and to the loader) before this passes
    assert sorted(_accelerate_fields()) == sorted(SAMPLES)


@pytest.mark.parametrize("name", sorted(set(SAMPLES) - {"distributed_type"}))
def test_each_key_is_read_as_accelerate_reads_it(tmp_path, name):
    path = tmp_path / "c.yaml"
    data = {"distributed_type": "MULTI_CPU", name: SAMPLES[name]}
    if name == "machine_rank":
        data["num_machines"] = 2  # a rank needs a machine to be on
    path.write_text(yaml.safe_dump(data))
    theirs = _accelerate().load_config_from_file(str(path))
    ours = load_config_from_file(str(path))
    assert ours.values[name] == _plain(getattr(theirs, name)) == SAMPLES[name]
    assert ours.to_dict() == theirs.to_dict()


def test_a_file_with_every_key_reads_as_accelerate_reads_it(tmp_path):
    for fname, dump in (("c.yaml", yaml.safe_dump), ("c.json", json.dumps)):
        path = tmp_path / fname
        path.write_text(dump(SAMPLES))
        theirs = _accelerate().load_config_from_file(str(path))
        assert load_config_from_file(str(path)).to_dict() == theirs.to_dict()


# (key, bad value), by hand: wrong types, values outside the allowed set or range
BAD_CASES = [
    ("compute_environment", "CLOUD"), ("compute_environment", 1),
    ("distributed_type", "MULTI_TPU"), ("distributed_type", None), ("distributed_type", 2),
    ("mixed_precision", "fp32"), ("mixed_precision", 16), ("mixed_precision", ["bf16"]),
    ("use_cpu", "maybe"), ("use_cpu", None), ("use_cpu", 1),
    ("debug", "verbose"),
    ("num_processes", "four"), ("num_processes", 1.5), ("num_processes", -2), ("num_processes", None),
    ("machine_rank", -1), ("machine_rank", "0"),
    ("num_machines", 0), ("num_machines", True),
    ("gpu_ids", "0;1"), ("gpu_ids", "gpu0"), ("gpu_ids", [0, 1]),
    ("main_process_ip", 10), ("main_process_ip", ["a"]),
    ("main_process_port", 65536), ("main_process_port", -1), ("main_process_port", "29500x"),
    ("rdzv_backend", "zmq"), ("rdzv_backend", 3),
    ("same_network", "sometimes"),
    ("main_training_function", 7),
    ("enable_cpu_affinity", "numa"),
    ("downcast_bf16", "maybe"), ("downcast_bf16", 1),
    ("tpu_name", 5), ("tpu_use_cluster", "yes please"),
    ("commands", "ls"), ("commands", [1, 2]), ("tpu_vm", {"a": 1}), ("tpu_env", 3),
    ("fp8_config", "TE"), ("fp8_config", ["fp8_backend"]),
    ("fp8_config.fp8_backend", "CUDA"), ("fp8_config.fp8_format", "E3M4"), ("fp8_config.fp8_margin", -1),
    ("fp8_config.fp8_interval", 0), ("fp8_config.fp8_override_linear_precision", ["yes"]),
    ("deepspeed_config", 2),
    ("deepspeed_config.zero_stage", 4), ("deepspeed_config.zero_stage", -1),
    ("deepspeed_config.offload_optimizer_device", "gpu"), ("deepspeed_config.gradient_accumulation_steps", 0),
    ("deepspeed_config.gradient_accumulation_steps", "sometimes"), ("deepspeed_config.zero3_init_flag", "on"),
    ("deepspeed_config.deepspeed_multinode_launcher", "ssh"),
    ("fsdp_config", True),
    ("fsdp_config.fsdp_version", 3), ("fsdp_config.fsdp_version", "two"),
    ("fsdp_config.fsdp_sharding_strategy", "HALF_SHARD"), ("fsdp_config.fsdp_sharding_strategy", 9),
    ("fsdp_config.fsdp_min_num_params", -1), ("fsdp_config.fsdp_auto_wrap_policy", "ALWAYS"),
    ("fsdp_config.fsdp_backward_prefetch", "EARLY"), ("fsdp_config.fsdp_state_dict_type", "PICKLE"),
    ("fsdp_config.fsdp_offload_params", "cpu"), ("fsdp_config.fsdp_transformer_layer_cls_to_wrap", 12),
    ("parallelism_config.parallelism_config_tp_size", 0), ("parallelism_config.parallelism_config_cp_backend", "nccl"),
    ("megatron_lm_config.megatron_lm_tp_degree", 0), ("megatron_lm_config.megatron_lm_sequence_parallelism", "on"),
    ("megatron_lm_config.megatron_lm_hidden_dropout", -0.5),
    ("mpirun_config.mpirun_ccl", -1), ("mpirun_config.mpirun_hostfile", 3),
    ("dynamo_config", "inductor"),
    ("dynamo_config.dynamo_backend", "turbo"), ("dynamo_config.dynamo_backend", 1),
    ("dynamo_config.dynamo_mode", "fast"), ("dynamo_config.dynamo_use_fullgraph", "always"),
    ("dynamo_config.dynamo_use_dynamic", 0.5),
]


def _with(dotted, value):
    data = {"distributed_type": "NO"}
    if "." in dotted:
        outer, inner = dotted.split(".")
        data[outer] = {inner: value}
    else:
        data[dotted] = value
    return data


@pytest.mark.parametrize("dotted,value", BAD_CASES, ids=[f"{d}={v!r}" for d, v in BAD_CASES])
def test_bad_values_are_refused_naming_file_and_key(tmp_path, dotted, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(dotted, value)))
    with pytest.raises(ConfigError) as e:
        load_config_from_file(str(path))
    msg = str(e.value)
    assert str(path) in msg and f"'{dotted}'" in msg and "allowed:" in msg, msg


def test_bad_cases_cover_every_key_of_accelerates_cluster_config():
    covered = {d.split(".")[0] for d, _ in BAD_CASES}
    # free-form strings of accelerate's that anything but a string is wrong for are covered too
    assert set(_accelerate_fields()) - covered <= {"tpu_zone", "command_file", "tpu_use_sudo"}


@pytest.mark.parametrize("dotted,value", [("distributed_type", "MULTI_TPU"), ("compute_environment", "CLOUD")])
def test_values_accelerate_refuses_too(tmp_path, dotted, value):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(_with(dotted, value)))
    with pytest.raises(ValueError):
        _accelerate().load_config_from_file(str(path))
    with pytest.raises(ConfigError):
        load_config_from_file(str(path))


@pytest.mark.parametrize("data,dotted", [({"distributed_type": "NO", "num_gpus": 2}, "num_gpus"),
                                         ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding": 1}},
                                          "fsdp_config.fsdp_sharding")])
def test_unknown_key_names_file_and_key(tmp_path, data, dotted):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="unknown key") as e:
        load_config_from_file(str(path))
    assert str(path) in str(e.value) and f"'{dotted}'" in str(e.value)


@pytest.mark.parametrize("text,msg", [("", "must hold a mapping"), ("[1, 2]", "must hold a mapping"),
                                      ("a: [", "not valid YAML"), ("use_cpu: true\n", "'distributed_type' is missing"),
                                      ("distributed_type: NO\nmachine_rank: 2\n", "'machine_rank'"),
                                      ("distributed_type: yes\n", "got True")])
def test_bad_files(tmp_path, text, msg):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=msg):
        load_config_from_file(str(path))


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_from_file(str(tmp_path / "nope.yaml"))


def test_yaml_json_in_yaml_and_json_files_read_the_same(tmp_path):
    data = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 3,
            "mixed_precision": "bf16", "use_cpu": True, "fsdp_config": {}, "dynamo_config": {"dynamo_backend": "NO"}}
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "b.yaml").write_text(json.dumps(data, indent=2))  # as `accelerate config default` writes
    (tmp_path / "c.json").write_text(json.dumps(data))
    loaded = [load_config_from_file(str(tmp_path / n)).values for n in ("a.yaml", "b.yaml", "c.json")]
    assert loaded[0] == loaded[1] == loaded[2]
    assert loaded[0]["num_processes"] == 3 and loaded[0]["mixed_precision"] == "bf16"


def test_legacy_keys_and_unquoted_no(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: NO\nfp16: true\ndynamo_backend: NO\n")
    c = load_config_from_file(str(path))
    assert c.mixed_precision == "fp16" and c.dynamo_config == {}
    path.write_text("distributed_type: NO\nmixed_precision: no\n")  # YAML 1.1: unquoted no is false
    assert load_config_from_file(str(path)).mixed_precision == "no"


def test_file_written_by_accelerate_is_read(tmp_path, hf_home):
    env = dict(os.environ, HF_HOME=str(hf_home))
    target = tmp_path / "acc.yaml"
    res = subprocess.run([os.path.join(VENV_BIN, "accelerate"), "config", "default", "--config_file", str(target),
                          "--mixed_precision", "bf16"], capture_output=True, text=True, env=env, timeout=wait_s(120))
    assert res.returncode == 0, res.stderr
    c = load_config_from_file(str(target))
    assert c.mixed_precision == "bf16" and c.distributed_type in ("NO", "MULTI_GPU") and c.unsupported() == []
    assert json.loads(target.read_text()) == c.raw  # accelerate writes JSON into the .yaml file
    # at accelerate's default location too
    res = subprocess.run([os.path.join(VENV_BIN, "accelerate"), "config", "default"], capture_output=True,
                         text=True, env=env, timeout=wait_s(120))
    assert res.returncode == 0, res.stderr
    assert os.path.isfile(default_config_file())
    v = load_config_from_file().values
    # what accelerate's `config default` writes on a CPU machine (its literal values, not our reading)
    assert (v["distributed_type"], v["mixed_precision"], v["num_processes"]) == ("NO", "no", 1)


def _accelerate_reads(path):
    from accelerate.commands.config.config_args import load_config_from_file as acc_load

    return acc_load(str(path)).to_dict()


def test_files_written_by_us_are_read_by_accelerate(tmp_path, capsys):
    assert main(["config", "default", "--config_file", str(tmp_path / "d.yaml"), "--mixed_precision", "fp16"]) == 0
    ours = load_config_from_file(str(tmp_path / "d.yaml"))
    assert _accelerate_reads(tmp_path / "d.yaml") == ours.to_dict()
    full = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_processes": 4,
            "num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.1", "main_process_port": 29501,
            "rdzv_backend": "c10d", "same_network": False, "use_cpu": True, "mixed_precision": "bf16",
            "gpu_ids": "0,1", "dynamo_config": {"dynamo_backend": "NO", "dynamo_mode": "default"}}
    for name in ("y.yaml", "j.json"):
        write_config_file(full, str(tmp_path / name))
        assert _accelerate_reads(tmp_path / name) == load_config_from_file(str(tmp_path / name)).to_dict()


def test_config_default_never_overwrites(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text("distributed_type: NO\n")
    assert main(["config", "default", "--config_file", str(path)]) != 0
    assert "already exists" in capsys.readouterr().err and path.read_text() == "distributed_type: NO\n"
    assert main(["config", "default"]) == 0 and os.path.isfile(default_config_file())
    before = open(default_config_file()).read()
    assert main(["config", "default", "--mixed_precision", "bf16"]) == 1
    assert open(default_config_file()).read() == before


MULTI_CPU_ANSWERS = ["0", "1", "", "", "", "", "3", "2"]
FSDP_ANSWERS = ["0", "4", "", "", "", "no", "yes", "", "", "", "", "", "LlamaDecoderLayer", "", "", "", "", "",
                "4", "", "2"]


def _interactive(monkeypatch, answers, argv):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(answers) + "\n"))
    return main(["config", *argv])


def test_interactive_config_multi_cpu(tmp_path, monkeypatch, capsys):
    assert _interactive(monkeypatch, MULTI_CPU_ANSWERS, []) == 0
    c = load_config_from_file()
    assert (c.distributed_type, c.num_processes, c.use_cpu, c.mixed_precision) == ("MULTI_CPU", 3, True, "bf16")
    assert c.unsupported() == [] and _accelerate_reads(default_config_file()) == c.to_dict()


def test_interactive_config_asks_before_replacing(tmp_path, monkeypatch, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: NO\n")
    assert _interactive(monkeypatch, ["no"], ["--config_file", str(path)]) == 1
    assert "kept" in capsys.readouterr().err and path.read_text() == "distributed_type: NO\n"
    assert _interactive(monkeypatch, ["yes"] + MULTI_CPU_ANSWERS, ["--config_file", str(path)]) == 0
    assert load_config_from_file(str(path)).num_processes == 3


def test_interactive_config_end_of_input_writes_nothing(monkeypatch, capsys):
    assert _interactive(monkeypatch, ["0", "1"], []) == 1
    assert not os.path.exists(default_config_file())


def _accelerates_fsdp_env(path):
    """The FSDP variables accelerate's own launcher computes for this config file."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    env = prepare_multi_gpu_env(args)
    return {k: v for k, v in env.items() if k.startswith("FSDP_") or k == "ACCELERATE_USE_FSDP"}


def test_interactive_fsdp_config_is_written_then_exported_as_accelerate_does(tmp_path, monkeypatch, capsys):
    path = tmp_path / "fsdp.yaml"
    assert _interactive(monkeypatch, FSDP_ANSWERS, ["--config_file", str(path)]) == 0
    c = load_config_from_file(str(path))
    assert c.distributed_type == "FSDP" and c.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "LlamaDecoderLayer"
    assert _accelerate_reads(path) == c.to_dict()
    assert launch_cmd.fsdp_env(c.fsdp_config) == _accelerates_fsdp_env(path)


def test_fsdp_docs_file_loads_and_launch_exports_what_accelerate_exports(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text(FSDP_DOCS)
    c = load_config_from_file(str(path))
    assert c.fsdp_config["fsdp_version"] == 2 and c.num_processes == 4
    assert launch_cmd.fsdp_env(c.fsdp_config) == _accelerates_fsdp_env(path)


def _resolve(argv):
    args = build_parser().parse_args(["launch", *argv, "script.py"])
    return launch_cmd.resolve(args), args


@pytest.mark.parametrize("extra,msg", [
    ("debug: true", "debug mode"), ("enable_cpu_affinity: true", "CPU affinity"),
    ("mixed_precision: fp8", "fp8"),
    ("tpu_name: pod", "TPU"), ("downcast_bf16: yes", "downcast_bf16"), ("main_training_function: train", "TPU"),
    ("mpirun_config: {mpirun_hostfile: h}", "mpirun"),
    ("megatron_lm_config: {megatron_lm_tp_degree: 2}", "Megatron-LM"),
    ("parallelism_config: {parallelism_config_tp_size: 2}", "parallelism_config"),
    ("fp8_config: {backend: TE}", "fp8"), ("commands: [ls]", "TPU"),
])
def test_unbuilt_features_are_refused_at_launch(tmp_path, extra, msg):
    path = tmp_path / "c.yaml"
    path.write_text(f"distributed_type: NO\n{extra}\n")
    load_config_from_file(str(path))  # valid...
    with pytest.raises(SystemExit, match="not supported yet") as e:  # ...but not runnable yet
        _resolve(["--config_file", str(path)])
    assert msg in str(e.value)


# DEEPSPEED and FSDP launch; their settings are tested in tests/test_deepspeed_config.py and above
@pytest.mark.parametrize("dt", ["MEGATRON_LM", "XLA", "MULTI_XPU", "MULTI_NPU", "MULTI_HPU"])
def test_unsupported_distributed_types_are_refused(tmp_path, dt):
    path = tmp_path / "c.yaml"
    path.write_text(f"distributed_type: {dt}\nnum_processes: 2\n")
    with pytest.raises(SystemExit, match=f"distributed_type {dt}: .*not supported"):
        _resolve(["--config_file", str(path)])


def test_a_flag_overriding_an_unsupported_value_runs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: NO\nmixed_precision: fp8\n")
    values, _ = _resolve(["--config_file", str(path), "--mixed_precision", "bf16"])
    assert values["mixed_precision"] == "bf16"


@pytest.mark.parametrize("argv,msg", [
    (["--num_machines", "2", "--num_processes", "2", "--main_process_port", "1234"], "pass --main_process_ip"),
    (["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "h"], "pass --main_process_port"),
    (["--num_machines", "2", "--num_processes", "2", "--main_process_ip", "h", "--main_process_port", "0"],
     "only works on one machine"),
    (["--num_machines", "2", "--machine_rank", "2"], "--machine_rank must be in"),
    (["--num_machines", "2", "--num_processes", "3"], "must be a multiple of num_machines"),
    (["--num_machines", "0"], "--num_machines must be >= 1"),
    (["--rdzv_backend", "zmq"], "unknown --rdzv_backend"),
    (["--gpu_ids", "0;1"], "--gpu_ids must be"),
])
def test_bad_multi_machine_flags(argv, msg):
    with pytest.raises(SystemExit, match=msg):
        _resolve(argv)


def test_num_processes_minus_one_needs_the_flag(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: MULTI_GPU\n")  # accelerate's default num_processes: -1
    with pytest.raises(SystemExit, match="pass --num_processes"):
        _resolve(["--config_file", str(path)])
    assert _resolve(["--config_file", str(path), "--num_processes", "2"])[0]["num_processes"] == 2


def test_multi_machine_command_maps_onto_torchrun(tmp_path):
    base = ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.1.2.3",
            "--main_process_port", "29600"]
    values, args = _resolve(base + ["--same_network"])
    cmd = launch_cmd.build_command(args, values)
    i = cmd.index("torch.distributed.run")
    assert cmd[i + 1:i + 11] == ["--nproc_per_node", "2", "--nnodes", "2", "--node_rank", "1", "--master_addr",
                                 "10.1.2.3", "--master_port", "29600"]
    values, args = _resolve(base + ["--rdzv_backend", "c10d"])
    cmd = launch_cmd.build_command(args, values)
    assert "--rdzv_endpoint" in cmd and cmd[cmd.index("--rdzv_endpoint") + 1] == "10.1.2.3:29600"
    assert cmd[cmd.index("--rdzv_backend") + 1] == "c10d" and "--master_addr" not in cmd


def test_a_free_port_is_bound_by_torchrun_itself(tmp_path):
    """--main_process_port 0 on one machine: no port is picked here and handed on (another job
    on the host could take it before torchrun binds it); torchrun's standalone rendezvous binds
    port 0 itself, and every rank is told the port it got."""
    values, args = _resolve(["--num_processes", "2", "--cpu", "--main_process_port", "0", "x.py"])
    cmd = launch_cmd.build_command(args, values)
    assert "--master_port" not in cmd and cmd[cmd.index("--rdzv_backend") + 1] == "c10d"
    assert cmd[cmd.index("--rdzv_endpoint") + 1] == "127.0.0.1:0" and cmd[cmd.index("--local_addr") + 1] == "127.0.0.1"
    script = tmp_path / "port.py"
    # each rank writes its report to its own file: the ranks share one output pipe, unbuffered
    # under torchrun, and print's pieces from two ranks have interleaved there ("portsports  10 ...")
    script.write_text("import os, sys, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "t = [None, None]\n"
                      "dist.all_gather_object(t, os.environ['MASTER_ADDR'] + ':' + os.environ['MASTER_PORT'])\n"
                      "r = dist.get_rank()\n"
                      "open(os.path.join(sys.argv[1], f'ports{r}.txt'), 'w').write(' '.join(['ports', str(r), *t]))\n"
                      "dist.barrier()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_PORT", "MASTER_ADDR")}
    exe = os.path.join(os.path.dirname(sys.executable), "accelerate-c")
    res = subprocess.run([exe, "launch", "--num_processes", "2", "--cpu", "--main_process_port", "0", str(script),
                          str(tmp_path)], capture_output=True, text=True, timeout=wait_s(120), env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    reports = [(tmp_path / f"ports{r}.txt").read_text().split() for r in (0, 1)]
    lines = [(r, a, b) for _, r, a, b in reports]
    assert [r for r, *_ in lines] == ["0", "1"], res.stdout[-2000:] + res.stderr[-2000:]
    ports = {p for _, *ps in lines for p in ps}
    assert len(ports) == 1
    addr, port = ports.pop().rsplit(":", 1)
    assert addr == "127.0.0.1" and int(port) > 0


def _child_env(tmp_path, argv, env=None):
    script = tmp_path / "show_env.py"
    script.write_text(SHOW_ENV)
    full = dict(os.environ, **(env or {}))
    res = subprocess.run([os.path.join(VENV_BIN, "accelerate-c"), "launch", *argv, str(script)],
                         capture_output=True, text=True, timeout=wait_s(120), env=full)
    assert res.returncode == 0, res.stderr
    line = next(line for line in res.stdout.splitlines() if line.startswith("ENV="))
    return json.loads(line[4:])


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: NO\nmixed_precision: bf16\nuse_cpu: false\ngpu_ids: '1'\n"
                    "dynamo_config: {dynamo_backend: NO, dynamo_mode: max-autotune}\n")
    from_config = _child_env(tmp_path, ["--config_file", str(path)])
    assert from_config["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert from_config["ACCELERATE_USE_CPU"] == "False"
    assert from_config["CUDA_VISIBLE_DEVICES"] == "1"
    assert from_config["ACCELERATE_DYNAMO_BACKEND"] == "NO"
    assert from_config["ACCELERATE_DYNAMO_MODE"] == "max-autotune"
    from_flags = _child_env(tmp_path, ["--config_file", str(path), "--mixed_precision", "fp16", "--cpu",
                                       "--gpu_ids", "0", "--gradient_accumulation_steps", "4"])
    assert from_flags["ACCELERATE_MIXED_PRECISION"] == "fp16"
    assert from_flags["ACCELERATE_USE_CPU"] == "True"
    assert from_flags["CUDA_VISIBLE_DEVICES"] == "0"
    assert from_flags["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"


def test_launch_reads_the_default_file_unless_cpu(tmp_path, hf_home):
    os.makedirs(hf_home / "accelerate")
    (hf_home / "accelerate" / "default_config.yaml").write_text("distributed_type: NO\nmixed_precision: bf16\n")
    assert _child_env(tmp_path, [])["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # as accelerate: --cpu without --config_file does not read the default file
    assert _child_env(tmp_path, ["--cpu"])["ACCELERATE_MIXED_PRECISION"] == "no"


def test_use_cpu_config_with_several_processes_runs_that_many_gloo_processes(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("distributed_type: MULTI_CPU\nuse_cpu: true\nnum_processes: 2\nmain_process_port: 0\n")
    script = tmp_path / "ws.py"
    # one os.write per rank: a line is atomic on the shared pipe (print's separate writes of the
    # text and the newline could interleave across the two ranks)
    script.write_text("import os\nfrom accelerate_c import Accelerator\na = Accelerator()\n"
                      "os.write(1, f'WS {a.num_processes} {a.process_index} {a.device} {a.state.backend}\\n'.encode())\n"
                      "a.wait_for_everyone()\n")
    res = subprocess.run([os.path.join(VENV_BIN, "accelerate-c"), "launch", "--config_file", str(path), str(script)],
                         capture_output=True, text=True, timeout=wait_s(180))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line for line in res.stdout.splitlines() if line.startswith("WS")) == \
        ["WS 2 0 cpu gloo", "WS 2 1 cpu gloo"]


def test_default_location(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "h"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_config_file() == str(tmp_path / "h" / "accelerate" / "default_config.yaml")
    monkeypatch.delenv("HF_HOME")
    assert default_config_file() == str(tmp_path / "x" / "huggingface" / "accelerate" / "default_config.yaml")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_config_file() == str(tmp_path / "home" / ".cache" / "huggingface" / "accelerate" /
                                        "default_config.yaml")
    # the same rule as accelerate's
    code = ("from accelerate.commands.config.config_args import default_config_file as f; print(f)")
    for env in ({"HF_HOME": str(tmp_path / "h")}, {"XDG_CACHE_HOME": str(tmp_path / "x")}, {}):
        full = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "XDG_CACHE_HOME")}
        full.update(env)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=wait_s(120))
        monkeypatch.delenv("HF_HOME", raising=False)
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        assert out.stdout.strip() == default_config_file(), out.stderr


def test_env_prints_the_config_in_effect(tmp_path, capsys):
    assert main(["env"]) == 0
    assert "accelerate_c config: none" in capsys.readouterr().out
    path = tmp_path / "c.yaml"
    path.write_text(FSDP_DOCS)
    assert main(["env", "--config_file", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"accelerate_c config: {path}" in out and "- distributed_type: FSDP" in out
    main(["config", "default"])
    capsys.readouterr()
    assert main(["env"]) == 0
    assert f"accelerate_c config: {default_config_file()}" in capsys.readouterr().out
