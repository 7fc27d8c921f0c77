"""`accelerate-c launch`: runs a training script on one or several processes, on one or several machines.

One process: the script runs directly. Several: torch.distributed.run (torchrun) starts them,
so rendezvous, failure handling (a rank that dies stops the job, non-zero exit) and the
RANK/LOCAL_RANK/WORLD_SIZE variables are torchrun's, as PyTorch users know them. Settings come
from the config file (`--config_file`, else accelerate's default one when it exists) with the
command-line flags taking precedence, and reach the processes as the ACCELERATE_* variables the
Accelerator reads, as with accelerate's launcher. Unlike accelerate, `--cpu` with several
processes runs that many gloo processes.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import uuid

from ..utils.config import ConfigError, config_in_effect, load_config_from_file, unsupported
from ..utils.config_schema import CLUSTER_KEYS, DEEPSPEED_KEYS, FSDP_KEYS
from ..utils.dataclasses import PrecisionType

# --flag -> (deepspeed_config key, the variable accelerate's launcher exports it as); None: not exported
_DEEPSPEED_FLAGS = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "gradient_accumulation_steps": "ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
    "gradient_clipping": "ACCELERATE_GRADIENT_CLIPPING",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "offload_optimizer_nvme_path": None,  # accelerate's launcher does not export the NVMe paths either
    "offload_param_nvme_path": None,
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
    "deepspeed_moe_layer_cls_names": "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES",
    "deepspeed_hostfile": None,
    "deepspeed_exclusion_filter": None,
    "deepspeed_inclusion_filter": None,
    "deepspeed_multinode_launcher": None,
}


def _fail(msg: str):
    raise SystemExit(f"accelerate-c launch: {msg}")


def resolve(args) -> dict:
    """The settings in effect: built-in defaults < config file < command-line flags. Validates
    them and refuses what accelerate_c cannot run yet. Sets args.config_path."""
    # accelerate's rule: with --cpu and no --config_file, the default config file is not read
    path = args.config_file if args.config_file is not None else (None if args.cpu else config_in_effect(None))
    args.config_path = path
    if path is not None:
        try:
            values = dict(load_config_from_file(path).values)
        except ConfigError as e:
            _fail(str(e))
    else:
        values = {name: key.default for name, key in CLUSTER_KEYS.items()}
        values.update(distributed_type="NO", num_processes=1)
        values.update({n: {} for n, k in CLUSTER_KEYS.items() if "dict" in k.types})

    # accelerate refuses a deepspeed_config_file next to a mixed_precision that came from the config file
    mp_from_file = args.mixed_precision is None and values["mixed_precision"] is not None
    if args.mixed_precision is not None:
        mp = args.mixed_precision.lower()
        if mp not in PrecisionType.list():
            _fail(f"unknown --mixed_precision {args.mixed_precision!r}; choose from {PrecisionType.list()}")
        values["mixed_precision"] = mp
    for name in ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                 "rdzv_backend", "gpu_ids"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    if args.same_network:
        values["same_network"] = True
    if args.cpu:
        values["use_cpu"] = True
    if values["mixed_precision"] is None:
        values["mixed_precision"] = "no"
    if args.use_deepspeed:
        values["distributed_type"] = "DEEPSPEED"
    if values["distributed_type"] == "DEEPSPEED":
        _deepspeed_settings(args, values, mp_from_file)

    problems = unsupported(values, path or "<command line>")
    if problems:
        where = f"config file {path}" if path else "settings"
        _fail(f"{where}: {problems[0]}" if len(problems) == 1 else f"{where}:\n  " + "\n  ".join(problems))

    src = f" (from {path})" if path else ""
    n, m, r = values["num_processes"], values["num_machines"], values["machine_rank"]
    if n == -1:
        _fail(f"num_processes is -1{src}: pass --num_processes")
    if n < 1:
        _fail(f"--num_processes must be >= 1, got {n}")
    if m < 1:
        _fail(f"--num_machines must be >= 1, got {m}")
    if not 0 <= r < m:
        _fail(f"--machine_rank must be in [0, num_machines - 1 = {m - 1}], got {r}")
    if n % m:
        _fail(f"num_processes ({n}) is the total over all machines and must be a multiple of num_machines ({m})")
    if args.gradient_accumulation_steps is not None and args.gradient_accumulation_steps < 1:
        _fail(f"--gradient_accumulation_steps must be >= 1, got {args.gradient_accumulation_steps}")
    port = values["main_process_port"]
    if port is not None and not 0 <= port <= 65535:
        _fail(f"--main_process_port must be in [0, 65535], got {port}")
    if values["rdzv_backend"] is None:
        values["rdzv_backend"] = "static"
    if values["rdzv_backend"] not in CLUSTER_KEYS["rdzv_backend"].choices:
        _fail(f"unknown --rdzv_backend {values['rdzv_backend']!r}; choose from "
              f"{list(CLUSTER_KEYS['rdzv_backend'].choices)}")
    if m > 1:
        if not values["main_process_ip"]:
            _fail(f"num_machines is {m}{src}: pass --main_process_ip (the address of the machine of rank 0)")
        if port is None:
            _fail(f"num_machines is {m}{src}: pass --main_process_port (the same on every machine)")
        if port == 0:
            _fail("--main_process_port 0 (a free port) only works on one machine: every machine must use the same "
                  "port")
    gpu_ids = values["gpu_ids"]
    if gpu_ids is not None:
        import re

        gpu_ids = str(gpu_ids).replace(" ", "")
        if not re.fullmatch(CLUSTER_KEYS["gpu_ids"].pattern, gpu_ids):
            _fail(f"--gpu_ids must be 'all' or a comma-separated list of GPU ids such as '0,1', got {gpu_ids!r}")
        values["gpu_ids"] = gpu_ids
    if values["distributed_type"] == "MULTI_CPU":
        values["use_cpu"] = True
    return values


def _deepspeed_settings(args, values: dict, mp_from_file: bool) -> None:
    """Under DEEPSPEED: the deepspeed_config in effect (the --flags over the config file's section,
    as accelerate's launcher merges them) and which of its keys came from the config file."""
    from_file = dict(values["deepspeed_config"])
    fields = list(from_file) + (["mixed_precision"] if mp_from_file else [])
    values["deepspeed_fields_from_config"] = ",".join(fields).lower()
    merged = dict(from_file)
    for name in _DEEPSPEED_FLAGS:
        flag = getattr(args, name, None)
        if flag is None:
            continue
        key = DEEPSPEED_KEYS[name]
        if name in ("zero3_init_flag", "zero3_save_16bit_model"):
            if str(flag).lower() not in ("true", "false"):
                _fail(f"--{name} takes true or false, got {flag!r}")
            flag = str(flag).lower() == "true"
        elif key.choices is not None:
            flag = str(flag).lower()
            if flag not in key.choices:
                _fail(f"unknown --{name} {flag!r}; choose from {list(key.choices)}")
        elif name == "zero_stage" and not 0 <= flag <= 3:
            _fail(f"--zero_stage must be 0, 1, 2 or 3, got {flag}")
        elif name == "gradient_clipping" and flag < 0:
            _fail(f"--gradient_clipping must be >= 0, got {flag}")
        merged[name] = flag
    values["deepspeed_config"] = merged
    stage = merged.get("zero_stage", DEEPSPEED_KEYS["zero_stage"].default)
    if str(merged.get("offload_param_device", "none")).lower() == "cpu" and \
            not merged.get("deepspeed_config_file") and stage < 3:
        # (a deepspeed_config_file holds the stage itself: its own check names the file)
        _fail(f"deepspeed_config.offload_param_device=cpu at zero_stage {stage}: parameter offload needs ZeRO "
              "stage 3; use offload_optimizer_device to offload at stages 1 and 2")
    launcher = merged.get("deepspeed_multinode_launcher")
    if values["num_machines"] > 1 and launcher != "standard":
        _fail(f"DeepSpeed on {values['num_machines']} machines: deepspeed_multinode_launcher "
              f"{launcher or 'pdsh (the default)'} starts the other machines through DeepSpeed's own launcher, which "
              "accelerate-c launch does not have; set deepspeed_multinode_launcher: standard (or pass "
              "--deepspeed_multinode_launcher standard) and run the same launch command on every machine")


# fsdp_config key -> the variable accelerate's launcher exports it as (Accelerator() builds its
# FullyShardedDataParallelPlugin from them: fsdp_plugin.py)
_FSDP_VARS = {
    "fsdp_version": "FSDP_VERSION", "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD", "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_min_num_params": "FSDP_MIN_NUM_PARAMS", "fsdp_auto_wrap_policy": "FSDP_AUTO_WRAP_POLICY",
    "fsdp_transformer_layer_cls_to_wrap": "FSDP_TRANSFORMER_CLS_TO_WRAP",
    "fsdp_backward_prefetch": "FSDP_BACKWARD_PREFETCH", "fsdp_state_dict_type": "FSDP_STATE_DICT_TYPE",
    "fsdp_forward_prefetch": "FSDP_FORWARD_PREFETCH", "fsdp_use_orig_params": "FSDP_USE_ORIG_PARAMS",
    "fsdp_cpu_ram_efficient_loading": "FSDP_CPU_RAM_EFFICIENT_LOADING",
    "fsdp_sync_module_states": "FSDP_SYNC_MODULE_STATES",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
    "fsdp_activation_checkpointing_offload": "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD",
    "fsdp_ignored_modules": "FSDP_IGNORED_MODULES",
}


def fsdp_env(config: dict) -> dict:
    """The variables accelerate's launcher exports under distributed_type FSDP, from a config
    file's fsdp_config (keys with or without their fsdp_ prefix; unset ones at their defaults)."""
    given = {(k if k.startswith("fsdp_") else "fsdp_" + k): v for k, v in (config or {}).items()}
    if "fsdp_cpu_offload" in given:  # the spelling of accelerate's FSDP2 examples
        given.setdefault("fsdp_offload_params", given.pop("fsdp_cpu_offload"))
    env = {"ACCELERATE_USE_FSDP": "true"}
    for key, var in _FSDP_VARS.items():
        value = given.get(key, FSDP_KEYS[key].default)
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        env[var] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def build_env(args, values: dict) -> dict:
    env = os.environ.copy()
    env["ACCELERATE_USE_CPU"] = str(bool(values["use_cpu"]))
    env["ACCELERATE_MIXED_PRECISION"] = values["mixed_precision"]
    if args.gradient_accumulation_steps is not None:
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(args.gradient_accumulation_steps)
    # as accelerate's launcher sets them; the script's Accelerator compiles in prepare() (compilation.py)
    dynamo = values["dynamo_config"]
    env["ACCELERATE_DYNAMO_BACKEND"] = str(dynamo.get("dynamo_backend", "NO")).upper()
    env["ACCELERATE_DYNAMO_MODE"] = str(dynamo.get("dynamo_mode", "default"))
    for flag in ("use_fullgraph", "use_dynamic", "use_regional_compilation"):
        env[f"ACCELERATE_DYNAMO_{flag.upper()}"] = str(bool(dynamo.get("dynamo_" + flag, False)))
    if values["distributed_type"] == "DEEPSPEED":
        # what accelerate's launcher exports; Accelerator() builds its DeepSpeedPlugin from these
        env["ACCELERATE_USE_DEEPSPEED"] = "true"
        env["ACCELERATE_CONFIG_DS_FIELDS"] = values["deepspeed_fields_from_config"]
        for name, var in _DEEPSPEED_FLAGS.items():
            value = values["deepspeed_config"].get(name)
            if var is not None and value is not None:
                env[var] = str(value) if name in ("deepspeed_config_file", "deepspeed_moe_layer_cls_names") \
                    else str(value).lower()
    if values["distributed_type"] == "FSDP":
        env.update(fsdp_env(values["fsdp_config"]))
    if values["gpu_ids"] not in (None, "all"):
        env["CUDA_VISIBLE_DEVICES"] = values["gpu_ids"]
    local = values["num_processes"] // values["num_machines"]
    if args.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    elif local > 1 and "OMP_NUM_THREADS" not in env:
        # N processes x all cores each oversubscribes the machine
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
    return env


def build_command(args, values: dict) -> list:
    if args.no_python and args.module:
        _fail("--module and --no_python cannot be used together")
    script = [args.training_script, *args.training_script_args]
    n, m = values["num_processes"], values["num_machines"]
    if n == 1 and m == 1:
        if args.no_python:
            return script
        return [sys.executable, *(["-m"] if args.module else []), *script]
    port = values["main_process_port"]
    if port is None:
        port = 29500
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n // m), "--nnodes", str(m)]
    backend, ip = values["rdzv_backend"], values["main_process_ip"]
    if m == 1 and port == 0:
        # a free port (one machine, checked in resolve): torchrun's own --standalone rendezvous,
        # whose store binds port 0 itself and hands the port it got to the workers. A port picked
        # here and passed on would be free only until torchrun bound it: another job on the host
        # (tests run side by side) can take it in between. torchrun's static rendezvous does not
        # take port 0 (it waits forever). is_host: this agent hosts the store whatever address it
        # is given (c10d would otherwise host only for loopback or the hostname's own addresses,
        # and wait as a client for a store no one runs); local_addr: the MASTER_ADDR the ranks get
        # (else the machine's fully qualified name, which need not resolve)
        addr = ip or "127.0.0.1"
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{addr}:0", "--rdzv_id", uuid.uuid4().hex,
                "--rdzv_conf", "is_host=1", "--local_addr", addr]
    elif m == 1:
        cmd += ["--master_addr", ip or "127.0.0.1", "--master_port", str(port)]
    elif backend == "static" and values["same_network"]:
        cmd += ["--node_rank", str(values["machine_rank"]), "--master_addr", ip, "--master_port", str(port)]
    else:
        # as accelerate: a rendezvous endpoint (static: node ranks as given; c10d/etcd: assigned on arrival)
        if backend == "static":
            cmd += ["--node_rank", str(values["machine_rank"])]
        cmd += ["--rdzv_backend", backend, "--rdzv_endpoint", f"{ip}:{port}"]
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no-python")
    return cmd + script


def run(args) -> int:
    values = resolve(args)
    cmd = build_command(args, values)
    env = build_env(args, values)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def _hyphens_too(parser) -> None:
    """accelerate's launcher takes --num-processes as well as --num_processes: every option
    added to `parser` from here on gets its hyphenated spelling too (same destination)."""
    add = parser.add_argument

    def add_argument(*names, **kw):
        extra = [n.replace("_", "-") for n in names if n.startswith("--") and "_" in n[2:]]
        return add(*names, *extra, **kw)

    parser.add_argument = add_argument


def register(sub) -> None:
    p = sub.add_parser("launch", help="Launch a training script on one or several processes.", allow_abbrev=False,
                       description="Flags override the config file (--config_file, else accelerate's default "
                                   "config file when it exists and --cpu is not given). Options take hyphens "
                                   "or underscores (--num-processes or --num_processes), as accelerate's do.")
    _hyphens_too(p)
    p.add_argument("--config_file", default=None, help="config file to read the settings from")
    p.add_argument("--num_processes", type=int, default=None,
                   help="processes in total, over all machines (default: config file, else 1)")
    p.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even if GPUs are present")
    p.add_argument("--mixed_precision", default=None, help="no, fp16 or bf16")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None)
    p.add_argument("--num_cpu_threads_per_process", type=int, default=None, help="OMP_NUM_THREADS per process")
    p.add_argument("--gpu_ids", default=None, help="GPUs to use on this machine: 'all' or a list such as 0,1")
    multi = p.add_argument_group("several machines")
    _hyphens_too(multi)  # a group adds its options through its own add_argument
    multi.add_argument("--num_machines", type=int, default=None, help="machines taking part (default 1)")
    multi.add_argument("--machine_rank", type=int, default=None, help="rank of this machine, 0 to num_machines-1")
    multi.add_argument("--main_process_ip", default=None, help="address of the machine of rank 0")
    multi.add_argument("--main_process_port", type=int, default=None,
                       help="rendezvous port (default 29500); 0 picks a free one (one machine only)")
    multi.add_argument("--rdzv_backend", default=None, help="torchrun rendezvous backend: static (default) or c10d")
    multi.add_argument("--same_network", action="store_true",
                       help="the machines share a local network: static rendezvous through master_addr/port")
    ds = p.add_argument_group("DeepSpeed", "ZeRO through accelerate's DeepSpeed settings (docs/sharding.md); they "
                                           "override the config file's deepspeed_config")
    _hyphens_too(ds)
    ds.add_argument("--use_deepspeed", action="store_true", help="use DeepSpeed (distributed_type DEEPSPEED)")
    ds.add_argument("--deepspeed_config_file", default=None, help="DeepSpeed JSON config file")
    ds.add_argument("--zero_stage", type=int, default=None, help="ZeRO stage (default 2)")
    ds.add_argument("--offload_optimizer_device", default=None, help="none or cpu (nvme is not supported)")
    ds.add_argument("--offload_param_device", default=None, help="none or cpu (cpu at --zero_stage 3 only)")
    ds.add_argument("--offload_optimizer_nvme_path", default=None, help=argparse.SUPPRESS)
    ds.add_argument("--offload_param_nvme_path", default=None, help=argparse.SUPPRESS)
    ds.add_argument("--gradient_clipping", type=float, default=None, help="max gradient norm (DeepSpeed's "
                                                                           "gradient_clipping)")
    ds.add_argument("--zero3_init_flag", default=None, help="true or false (ZeRO-3 only)")
    ds.add_argument("--zero3_save_16bit_model", default=None, help="true or false (ZeRO-3 only)")
    ds.add_argument("--deepspeed_hostfile", default=None, help=argparse.SUPPRESS)
    ds.add_argument("--deepspeed_exclusion_filter", default=None, help=argparse.SUPPRESS)
    ds.add_argument("--deepspeed_inclusion_filter", default=None, help=argparse.SUPPRESS)
    ds.add_argument("--deepspeed_multinode_launcher", default=None,
                    help="several machines: standard (torchrun on each machine) is the one accelerate-c runs")
    ds.add_argument("--deepspeed_moe_layer_cls_names", default=None, help=argparse.SUPPRESS)
    p.add_argument("-m", "--module", action="store_true", help="the script is a Python module name")
    p.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    p.add_argument("training_script", help="the script (or module, with -m) to run")
    p.add_argument("training_script_args", nargs="...", help="its arguments")
    p.set_defaults(func=run)
