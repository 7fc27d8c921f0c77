"""`accelerate-c config`: writes an accelerate config file, by questions or (`config default`) by detection.

The questions are accelerate 1.15's for "This machine", in its order; the answers are written with
accelerate's keys, so `accelerate launch` reads the file too. Choices accelerate_c cannot run yet
(Megatron-LM, fp8, ...) are still written as accelerate would write them; `accelerate-c launch`
then refuses them with "not supported yet" (DeepSpeed and FSDP launch; their Accelerator checks
the configuration, docs/sharding.md; a dynamo backend makes prepare() compile the model). An existing file is only replaced
after the user says so (interactive), never by `config default`.
"""
from __future__ import annotations

import os
import sys

from ..utils.config import ConfigError, default_config_file, write_config_file
from ..utils.config_schema import (
    DEEPSPEED_LAUNCHERS,
    DYNAMO_BACKENDS,
    DYNAMO_MODES,
    FSDP_AUTO_WRAP_POLICIES,
    FSDP_BACKWARD_PREFETCH,
    FSDP_SHARDING_STRATEGIES,
    FSDP_STATE_DICT_TYPES,
    MIXED_PRECISIONS,
    OFFLOAD_DEVICES,
    RDZV_BACKENDS,
    SUPPORTED_DISTRIBUTED_TYPES,
)

MACHINE_TYPES = [("No distributed training", "NO"), ("multi-CPU", "MULTI_CPU"), ("multi-XPU", "MULTI_XPU"),
                 ("multi-HPU", "MULTI_HPU"), ("multi-GPU", "MULTI_GPU"), ("multi-NPU", "MULTI_NPU"),
                 ("multi-MLU", "MULTI_MLU"), ("multi-SDAA", "MULTI_SDAA"), ("multi-MUSA", "MULTI_MUSA"),
                 ("multi-NEURON", "MULTI_NEURON"), ("TPU", "XLA")]


class _NoAnswer(Exception):
    pass


def ask(text: str, convert=str, default=None, error: str = "Please enter a valid value."):
    """Asks until the answer converts; an empty answer takes `default` when there is one."""
    while True:
        try:
            answer = input(text).strip()
        except EOFError:
            raise _NoAnswer() from None
        if not answer and default is not None:
            return default
        try:
            return convert(answer)
        except (ValueError, KeyError):
            print(error)


def yes_no(text: str, default: bool) -> bool:
    return ask(text, lambda a: {"yes": True, "y": True, "no": False, "n": False}[a.lower()], default,
               "Please enter yes or no.")


def choose(text: str, options: list, default: int = 0):
    """Numbered options; the answer is the number (empty: the default). Returns the option."""
    print(text)
    for i, option in enumerate(options):
        print(f"  [{i}] {option}{'  (default)' if i == default else ''}")

    def convert(a):
        i = int(a)
        if not 0 <= i < len(options):
            raise ValueError(a)
        return options[i]

    return ask(f"Enter a number [{default}]: ", convert, options[default],
               f"Please enter a number from 0 to {len(options) - 1}.")


def _positive(a: str) -> int:
    v = int(a)
    if v < 1:
        raise ValueError(a)
    return v


def _port(a: str) -> int:
    v = int(a)
    if not 0 <= v <= 65535:
        raise ValueError(a)
    return v


def _ask_fsdp() -> dict:
    cfg = {"fsdp_version": choose("What should be your FSDP version?", [1, 2], default=1)}
    v1 = cfg["fsdp_version"] == 1
    if v1:
        cfg["fsdp_reshard_after_forward"] = choose("What should be your sharding strategy?",
                                                   list(FSDP_SHARDING_STRATEGIES))
    else:
        cfg["fsdp_reshard_after_forward"] = yes_no("Do you want to enable resharding after forward? [YES/no]: ", True)
    cfg["fsdp_offload_params"] = yes_no("Do you want to offload parameters and gradients to CPU? [yes/NO]: ", False)
    cfg["fsdp_auto_wrap_policy"] = choose("What should be your auto wrap policy?", list(FSDP_AUTO_WRAP_POLICIES))
    if cfg["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP":
        if not yes_no("Do you want to use the model's `_no_split_modules` to wrap. Only applicable for Transformers "
                      "[yes/NO]: ", False):
            cfg["fsdp_transformer_layer_cls_to_wrap"] = ask(
                "Specify the comma-separated list of transformer layer class names (case-sensitive) to wrap, e.g. "
                "`BertLayer`, `GPTJBlock`, `T5Block`: ")
    elif cfg["fsdp_auto_wrap_policy"] == "SIZE_BASED_WRAP":
        cfg["fsdp_min_num_params"] = ask("What should be your FSDP's minimum number of parameters for Default Auto "
                                         "Wrapping Policy? [1e8]: ", _positive, 100_000_000)
    if v1:
        cfg["fsdp_backward_prefetch"] = choose("What should be your FSDP's backward prefetch policy?",
                                               list(FSDP_BACKWARD_PREFETCH))
    cfg["fsdp_state_dict_type"] = choose("What should be your FSDP's state dict type?", list(FSDP_STATE_DICT_TYPES)
                                         if v1 else ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    if v1:
        cfg["fsdp_forward_prefetch"] = yes_no("Do you want to enable FSDP's forward prefetch policy? [yes/NO]: ",
                                              False)
        cfg["fsdp_use_orig_params"] = yes_no("Do you want to enable FSDP's `use_orig_params` feature? [YES/no]: ",
                                             True)
    cfg["fsdp_cpu_ram_efficient_loading"] = yes_no("Do you want to enable CPU RAM efficient model loading? Only "
                                                   "applicable for Transformers models. [YES/no]: ", True)
    if v1:
        cfg["fsdp_sync_module_states"] = True if cfg["fsdp_cpu_ram_efficient_loading"] else yes_no(
            "Do you want each individually wrapped FSDP unit to broadcast module parameters from rank 0 at the "
            "start? [YES/no]: ", True)
    cfg["fsdp_activation_checkpointing"] = yes_no("Do you want to enable FSDP activation checkpointing? [yes/NO]: ",
                                                  False)
    return cfg


def _ask_deepspeed(num_machines: int) -> dict:
    cfg = {}
    use_file = yes_no("Do you want to specify a json file to a DeepSpeed config? [yes/NO]: ", False)
    if use_file:
        cfg["deepspeed_config_file"] = ask("Please enter the path to the json DeepSpeed config file: ", str, "none")
    else:
        cfg["zero_stage"] = choose("What should be your DeepSpeed's ZeRO optimization stage?", [0, 1, 2, 3], 2)
        if cfg["zero_stage"] >= 2:
            devices = list(OFFLOAD_DEVICES)
            cfg["offload_optimizer_device"] = choose("Where to offload optimizer states?", devices)
            cfg["offload_param_device"] = choose("Where to offload parameters?", devices)
            if cfg["offload_param_device"] == "nvme":
                cfg["offload_param_nvme_path"] = ask("Nvme Path to offload parameters? [/nvme]: ", str, "/nvme")
            if cfg["offload_optimizer_device"] == "nvme":
                cfg["offload_optimizer_nvme_path"] = ask("Nvme Path to offload optimizer states? [/nvme]: ", str,
                                                         "/nvme")
        cfg["gradient_accumulation_steps"] = ask("How many gradient accumulation steps you're passing in your "
                                                 "script? [1]: ", _positive, 1)
        if yes_no("Do you want to use gradient clipping? [yes/NO]: ", False):
            cfg["gradient_clipping"] = ask("What is the gradient clipping value? [1.0]: ", float, 1.0)
        if cfg["zero_stage"] == 3:
            cfg["zero3_save_16bit_model"] = yes_no("Do you want to save 16-bit model weights when using ZeRO "
                                                   "Stage-3? [yes/NO]: ", False)
    cfg["zero3_init_flag"] = yes_no("Do you want to enable `deepspeed.zero.Init` when using ZeRO Stage-3 for "
                                    "constructing massive models? [yes/NO]: ", False)
    if num_machines > 1:
        cfg["deepspeed_multinode_launcher"] = choose("Which Type of launcher do you want to use?",
                                                     list(DEEPSPEED_LAUNCHERS))
    return cfg, use_file


def get_user_input() -> dict:
    """The questions; returns the config as accelerate's keys."""
    env = choose("In which compute environment are you running?", ["This machine", "AWS (Amazon SageMaker)"])
    if env != "This machine":
        raise ConfigError("Amazon SageMaker is not supported yet by accelerate_c")
    label = choose("Which type of machine are you using?", [m[0] for m in MACHINE_TYPES])
    dt = dict(MACHINE_TYPES)[label]
    if dt not in SUPPORTED_DISTRIBUTED_TYPES:
        raise ConfigError(f"{label} is not supported by accelerate_c, which runs on CPUs and CUDA GPUs "
                          "(choose 'No distributed training', 'multi-CPU' or 'multi-GPU')")
    c = dict(compute_environment="LOCAL_MACHINE", machine_rank=0, num_machines=1, num_processes=1, gpu_ids=None,
             main_process_ip=None, main_process_port=None, rdzv_backend="static", same_network=True, debug=False,
             mpirun_config={}, dynamo_config={}, deepspeed_config={}, fsdp_config={}, parallelism_config={},
             megatron_lm_config={}, downcast_bf16="no", tpu_env=[], tpu_use_sudo=False, tpu_use_cluster=False,
             main_training_function="main", enable_cpu_affinity=False)
    if dt != "NO":
        c["num_machines"] = ask("How many different machines will you use (use more than 1 for multi-node "
                                "training)? [1]: ", _positive, 1, "Please enter an integer >= 1.")
        if c["num_machines"] > 1:
            c["machine_rank"] = choose("What is the rank of this machine?", list(range(c["num_machines"])))
            c["main_process_ip"] = ask("What is the IP address of the machine that will host the main process? ")
            c["main_process_port"] = ask("What is the port you will use to communicate with the main process? ",
                                         _port, error="Please enter a port number (0-65535).")
            c["same_network"] = yes_no("Are all the machines on the same local network? Answer `no` if nodes are on "
                                       "the cloud and/or on different network hosts [YES/no]: ", True)
            if not c["same_network"]:
                c["rdzv_backend"] = ask("What rendezvous backend will you use? ('static', 'c10d', ...): ",
                                        lambda a: {b: b for b in RDZV_BACKENDS}[a], "static",
                                        f"Please enter {', '.join(RDZV_BACKENDS)}.")
        c["debug"] = yes_no("Should distributed operations be checked while running for errors? This can avoid "
                            "timeout issues but will be slower. [yes/NO]: ", False)
    if dt == "NO":
        c["use_cpu"] = yes_no("Do you want to run your training on CPU only (even if a GPU is available)? "
                              "[yes/NO]: ", False)
    else:
        c["use_cpu"] = dt == "MULTI_CPU"
    if dt == "MULTI_CPU" and yes_no("Do you want accelerate to launch mpirun? [yes/NO]: ", False):
        hostfile = ask("Please enter the path to the hostfile to use with mpirun [~/hostfile]: ", str, "~/hostfile")
        c["mpirun_config"] = {"mpirun_hostfile": os.path.expanduser(hostfile)}
    if yes_no("Do you wish to optimize your script with torch dynamo?[yes/NO]: ", False):
        dyn = {"dynamo_backend": choose("Which dynamo backend would you like to use?",
                                        [b.lower() for b in DYNAMO_BACKENDS[1:14]], default=2).upper()}
        if yes_no("Do you want to customize the defaults sent to torch.compile? [yes/NO]: ", False):
            dyn["dynamo_mode"] = choose("Which mode do you want to use?", list(DYNAMO_MODES))
            dyn["dynamo_use_fullgraph"] = yes_no("Do you want the fullgraph mode or it is ok to break model into "
                                                 "several subgraphs? [yes/NO]: ", False)
            dyn["dynamo_use_dynamic"] = yes_no("Do you want to enable dynamic shape tracing? [yes/NO]: ", False)
            dyn["dynamo_use_regional_compilation"] = yes_no("Do you want to enable regional compilation? [yes/NO]: ",
                                                            False)
        c["dynamo_config"] = dyn
    ds_file = False
    if dt in ("NO", "MULTI_GPU") and yes_no("Do you want to use DeepSpeed? [yes/NO]: ", False):
        dt = "DEEPSPEED"
        c["deepspeed_config"], ds_file = _ask_deepspeed(c["num_machines"])
    if dt == "MULTI_GPU" and yes_no("Do you want to use FullyShardedDataParallel? [yes/NO]: ", False):
        dt = "FSDP"
        c["fsdp_config"] = _ask_fsdp()
    if c["fsdp_config"].get("fsdp_version", 1) == 2 and yes_no("Do you want to use the parallelism config? "
                                                               "[yes/NO]: ", False):
        pc = {}
        for name, text in (("dp_replicate_size", "data parallelism replicate size"),
                           ("dp_shard_size", "FSDP shard size"), ("tp_size", "tensor parallelism size"),
                           ("cp_size", "context parallelism size")):
            pc["parallelism_config_" + name] = ask(f"What is the {text}? [1]: ", _positive, 1)
        if pc["parallelism_config_cp_size"] > 1:
            pc["parallelism_config_cp_comm_strategy"] = choose(
                "What is the compute parallelism communication strategy?", ["allgather", "alltoall"])
        c["parallelism_config"] = pc
    if dt == "MULTI_GPU" and yes_no("Do you want to use Megatron-LM ? [yes/NO]: ", False):
        dt = "MEGATRON_LM"
        c["megatron_lm_config"] = {
            "megatron_lm_tp_degree": ask("What is the Tensor Parallelism degree/size? [1]: ", _positive, 1),
            "megatron_lm_pp_degree": ask("What is the Pipeline Parallelism degree/size? [1]: ", _positive, 1),
            "megatron_lm_gradient_clipping": ask("What is the gradient clipping value based on global L2 Norm (0 to "
                                                 "disable)? [1.0]: ", float, 1.0)}
    if dt == "MULTI_CPU":
        c["num_processes"] = ask("How many processes should be used for distributed training? [1]: ", _positive, 1,
                                 "Please enter an integer >= 1.")
    elif dt != "NO":
        c["num_processes"] = ask("How many GPU(s) should be used for distributed training? [1]: ", _positive, 1,
                                 "Please enter an integer >= 1.")
    if dt == "MULTI_GPU" and c["num_machines"] == 1 and c["num_processes"] == 1:
        raise ConfigError("Specified distributed type MULTI_GPU but only using 1 GPU on a single machine. Please "
                          "select `No distributed training` for the type of machine you are using.")
    if dt in ("NO", "MULTI_GPU", "DEEPSPEED", "FSDP", "MEGATRON_LM") and not c["use_cpu"]:
        c["gpu_ids"] = ask("What GPU(s) (by id) should be used for training on this machine as a comma-separated "
                           "list? [all]: ", _gpu_ids, "all", "Please enter 'all' or ids such as 0,1.")
    if dt in ("NO", "MULTI_GPU") and not c["use_cpu"]:
        c["enable_cpu_affinity"] = yes_no("Would you like to enable numa efficiency? (Currently only supported on "
                                          "NVIDIA hardware). [yes/NO]: ", False)
    if dt == "DEEPSPEED" and ds_file:
        c["mixed_precision"] = None
    else:
        c["mixed_precision"] = choose("Do you wish to use mixed precision?", list(MIXED_PRECISIONS))
    c["distributed_type"] = dt
    return c


def _gpu_ids(a: str) -> str:
    a = a.replace(" ", "")
    if a != "all" and not all(part.isdigit() for part in a.split(",")):
        raise ValueError(a)
    return a


def config_command(args) -> int:
    path = args.config_file or default_config_file()
    overwrite = False
    try:
        if os.path.exists(path):
            overwrite = yes_no(f"A configuration file already exists at {path}. Replace it? [yes/NO]: ", False)
            if not overwrite:
                print(f"accelerate-c config: {path} exists and was kept; nothing was written (answer yes to replace "
                      "it, or pass another --config_file)", file=sys.stderr)
                return 1
        config = get_user_input()
    except _NoAnswer:
        print("\naccelerate-c config: the input ended before all questions were answered; nothing was written",
              file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"accelerate-c config: {e}; nothing was written", file=sys.stderr)
        return 1
    try:
        write_config_file(config, path, overwrite=overwrite)
    except FileExistsError:
        print(f"accelerate-c config: {path} was created meanwhile; it was kept", file=sys.stderr)
        return 1
    except (ConfigError, OSError) as e:
        print(f"accelerate-c config: {e}", file=sys.stderr)
        return 1
    print(f"accelerate configuration saved at {path}")
    unsupported_note(config, path)
    return 0


def unsupported_note(values: dict, path: str) -> None:
    from ..utils.config import unsupported, validate

    problems = unsupported(validate(values, path), path)
    if problems:
        print("Note: `accelerate-c launch` will refuse this configuration until these are supported:\n  "
              + "\n  ".join(problems))


def basic_config(mixed_precision: str = "no") -> dict:
    """What `accelerate config default` writes: one process per CUDA GPU, else one CPU process."""
    import torch

    config = {"compute_environment": "LOCAL_MACHINE", "mixed_precision": mixed_precision, "debug": False,
              "enable_cpu_affinity": False}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        config.update(num_processes=n, use_cpu=False, distributed_type="MULTI_GPU" if n > 1 else "NO")
    else:
        config.update(num_processes=1, use_cpu=True, distributed_type="NO")
    from ..utils.config import validate

    return validate(config, "<default>")


def default_command(args) -> int:
    path = args.config_file or default_config_file()
    if os.path.exists(path):
        print(f"accelerate-c config default: a configuration already exists at {path}; it was not overwritten. "
              "Run `accelerate-c config` (which asks before replacing it), delete it, or pass another --config_file.",
              file=sys.stderr)
        return 1
    try:
        # JSON inside default_config.yaml, as accelerate writes it (YAML readers read it too)
        write_config_file(basic_config(args.mixed_precision), path, as_json=True)
    except FileExistsError:
        print(f"accelerate-c config default: {path} was created meanwhile; it was kept", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"accelerate-c config default: cannot write {path}: {e}", file=sys.stderr)
        return 1
    print(f"accelerate configuration saved at {path}")
    return 0


def register(sub) -> None:
    help_file = ("where to write the config file (default: $HF_HOME/accelerate/default_config.yaml, HF_HOME "
                 "defaulting to $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface)")
    p = sub.add_parser("config", help="Write a config file for `accelerate-c launch` (accelerate's format).",
                       description="Asks questions and writes the answers as an accelerate config file.")
    p.add_argument("--config_file", default=None, help=help_file)
    p.set_defaults(func=config_command)
    cmds = p.add_subparsers(dest="config_command", metavar="{default}")
    d = cmds.add_parser("default", help="Write a basic config without questions (one process per GPU, else CPU).")
    d.add_argument("--config_file", default=None, help=help_file)
    d.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    d.set_defaults(func=default_command)
