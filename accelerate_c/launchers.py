"""`notebook_launcher` and `debug_launcher`: a training function run on several CPU processes
from inside a Python session (a notebook, a test), as accelerate.launchers' are.

Each process is forked from the caller, so the function need not be importable or picklable,
and gets the environment `accelerate-c launch` gives a process (commands/launch.py:
ACCELERATE_USE_CPU, ACCELERATE_MIXED_PRECISION, the dynamo variables, its share of the CPU
threads) plus the rank variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). The caller's own environment and threads are left as they were: only
the children change theirs. A child starts with fresh Accelerator/Gradient states (an
Accelerator the caller built is not inherited) and destroys its process group when the
function returns. An exception in any process is raised in the caller with that process's
traceback (torch.multiprocessing's ProcessRaisedException).

Differences from accelerate: the processes are CPU processes (gloo) whatever the machine has
(accelerate runs GPUs through torch's elastic agent; on GPUs use `accelerate-c launch`); rendezvous backends other than static and restarts are not
built; an Accelerator that exists in the caller is not an error (it is not inherited);
debug_launcher's processes get LOCAL_RANK like any launched process (accelerate's get none, so
each of them takes itself for its machine's local main process).
"""
from __future__ import annotations

import os
import tempfile

import torch

from .state import AcceleratorState, GradientState
from .utils.dataclasses import PrecisionType


def _child_env(rank: int, local_rank: int, world: int, local_world: int, mixed_precision: str, master_addr: str,
               master_port) -> dict:
    """The variables a process of `accelerate-c launch --cpu` sees (the same names and values
    commands/launch.py's build_env sets for a CPU run without a config file), plus torchrun's."""
    env = {
        "ACCELERATE_USE_CPU": "True",
        "ACCELERATE_MIXED_PRECISION": mixed_precision,
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "ACCELERATE_DYNAMO_MODE": "default",
        "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
        "ACCELERATE_DYNAMO_USE_DYNAMIC": "False",
        "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False",
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    }
    if local_world > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local_world))
    return env


class _Child:
    """What each forked process runs: its environment, fresh states, the function, then its
    process group destroyed."""

    def __init__(self, function, env_of, store_path: str | None):
        self.function, self.env_of, self.store_path = function, env_of, store_path

    def __call__(self, index: int, *args):
        import torch.distributed as dist

        env = self.env_of(index)
        os.environ.update(env)
        if "OMP_NUM_THREADS" in env:  # read by torch at start-up only: this process is already running
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        AcceleratorState._reset_state()
        GradientState._reset_state()
        if self.store_path is not None:  # debug_launcher: rendezvous through a file, no port
            world = int(env["WORLD_SIZE"])
            dist.init_process_group("gloo", rank=int(env["RANK"]), world_size=world,
                                    store=dist.FileStore(self.store_path, world))
        try:
            self.function(*args)
        finally:
            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()


def _refuse_live_parent(what: str):
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError(f"{what}: this process already has a torch.distributed process group, which forked "
                           "processes cannot share; call it before any Accelerator is made on several processes")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise RuntimeError(f"{what}: CUDA is already initialised in this process and a forked process cannot use "
                           "it; make no CUDA call before launching (keep them inside the training function)")


def _fork(function, args, nprocs: int, env_of, store_path=None):
    from torch.multiprocessing import start_processes

    start_processes(_Child(function, env_of, store_path), args=tuple(args), nprocs=nprocs, join=True,
                    start_method="fork")


def debug_launcher(function, args=(), num_processes: int = 2):
    """Runs `function(*args)` on `num_processes` CPU processes (gloo, no mixed precision), for
    trying distributed code from a test or a notebook."""
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"debug_launcher(num_processes={num_processes!r}): expected an integer >= 1")
    _refuse_live_parent("debug_launcher")
    with tempfile.TemporaryDirectory(prefix="accelerate_c_debug_") as tmp:
        store = os.path.join(tmp, "rendezvous")
        _fork(function, args, num_processes,
              lambda i: _child_env(i, i, num_processes, num_processes, "no", "127.0.0.1", 29500), store)


def notebook_launcher(function, args=(), num_processes: int | None = None, mixed_precision: str = "no",
                      use_port: str = "29500", master_addr: str = "127.0.0.1", node_rank: int = 0, num_nodes: int = 1,
                      rdzv_backend: str = "static", rdzv_endpoint: str = "", rdzv_conf=None, rdzv_id: str = "none",
                      max_restarts: int = 0, monitor_interval: float = 0.1, log_line_prefix_template=None):
    """Runs `function(*args)` on `num_processes` processes of this machine (`num_nodes`
    machines: each runs the same call with its own `node_rank`; ranks meet at
    master_addr:use_port). One process: the function runs here, in this process."""
    try:
        mixed_precision = str(PrecisionType(str(mixed_precision).lower()))
    except ValueError:
        raise ValueError(f"notebook_launcher(mixed_precision={mixed_precision!r}): choose from "
                         f"{PrecisionType.list()}") from None
    if num_processes is None:
        raise ValueError("notebook_launcher: give num_processes=... (the processes to start on this machine)")
    if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
        raise ValueError(f"notebook_launcher(num_processes={num_processes!r}): expected an integer >= 1")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(f"notebook_launcher: node_rank={node_rank} must be in [0, num_nodes={num_nodes})")
    if rdzv_backend != "static" or max_restarts:
        raise NotImplementedError(f"notebook_launcher(rdzv_backend={rdzv_backend!r}, max_restarts={max_restarts}): "
                                  "accelerate_c forks the processes itself; only the static rendezvous without "
                                  "restarts is built (use accelerate-c launch for the others)")
    if num_processes == 1 and num_nodes == 1:
        print("Launching training on CPU." if not torch.cuda.is_available() else "Launching training on one GPU.")
        return function(*args)
    _refuse_live_parent("notebook_launcher")
    addr, port = master_addr, use_port
    if rdzv_endpoint:  # host:port, as torchrun takes it
        addr, _, port = rdzv_endpoint.rpartition(":")
    world = num_nodes * num_processes
    print(f"Launching training on {num_processes} CPUs.")
    _fork(function, args, num_processes,
          lambda i: _child_env(node_rank * num_processes + i, i, world, num_processes, mixed_precision, addr, port))
