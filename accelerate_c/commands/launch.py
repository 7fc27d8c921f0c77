"""`accelerate-c launch`: runs a training script on one or several processes.

One process: the script runs directly. Several: torch.distributed.run (torchrun) starts them,
so rendezvous, failure handling (a rank that dies stops the job, non-zero exit) and the
RANK/LOCAL_RANK/WORLD_SIZE variables are torchrun's, as PyTorch users know them. Settings reach
the processes as the ACCELERATE_* variables the Accelerator reads, as with accelerate's
launcher. Unlike accelerate, `--cpu` with several processes runs that many gloo processes.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

from ..utils.dataclasses import PrecisionType


def free_port() -> int:
    """A TCP port that is free on this host now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_env(args) -> dict:
    env = os.environ.copy()
    env["ACCELERATE_USE_CPU"] = str(bool(args.cpu))
    if args.mixed_precision is not None:
        mp = args.mixed_precision.lower()
        if mp not in PrecisionType.list():
            raise SystemExit(f"accelerate-c launch: unknown --mixed_precision {args.mixed_precision!r}; "
                             f"choose from {PrecisionType.list()}")
        env["ACCELERATE_MIXED_PRECISION"] = mp
    if args.gradient_accumulation_steps is not None:
        if args.gradient_accumulation_steps < 1:
            raise SystemExit("accelerate-c launch: --gradient_accumulation_steps must be >= 1, got "
                             f"{args.gradient_accumulation_steps}")
        env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(args.gradient_accumulation_steps)
    if args.num_cpu_threads_per_process is not None:
        env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    elif args.num_processes > 1 and "OMP_NUM_THREADS" not in env:
        # N processes x all cores each oversubscribes the machine
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.num_processes))
    return env


def build_command(args) -> list:
    if args.no_python and args.module:
        raise SystemExit("accelerate-c launch: --module and --no_python cannot be used together")
    if args.num_processes < 1:
        raise SystemExit(f"accelerate-c launch: --num_processes must be >= 1, got {args.num_processes}")
    script = [args.training_script, *args.training_script_args]
    if args.num_processes == 1:
        if args.no_python:
            return script
        return [sys.executable, *(["-m"] if args.module else []), *script]
    port = args.main_process_port
    if port is None:
        port = 29500
    elif port == 0:
        port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.num_processes),
           "--nnodes", "1", "--master_addr", "127.0.0.1", "--master_port", str(port)]
    if args.module:
        cmd.append("--module")
    if args.no_python:
        cmd.append("--no-python")
    return cmd + script


def run(args) -> int:
    cmd = build_command(args)
    env = build_env(args)
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


def register(sub) -> None:
    p = sub.add_parser("launch", help="Launch a training script on one or several processes.")
    p.add_argument("--num_processes", type=int, default=1, help="processes on this machine (default 1)")
    p.add_argument("--cpu", action="store_true", help="train on CPU (gloo) even if GPUs are present")
    p.add_argument("--mixed_precision", default=None, help="no, fp16 or bf16")
    p.add_argument("--gradient_accumulation_steps", type=int, default=None)
    p.add_argument("--main_process_port", type=int, default=None, help="rendezvous port; 0 picks a free one")
    p.add_argument("--num_cpu_threads_per_process", type=int, default=None, help="OMP_NUM_THREADS per process")
    p.add_argument("-m", "--module", action="store_true", help="the script is a Python module name")
    p.add_argument("--no_python", action="store_true", help="run the script as an executable, not with python")
    p.add_argument("training_script", help="the script (or module, with -m) to run")
    p.add_argument("training_script_args", nargs="...", help="its arguments")
    p.set_defaults(func=run)
