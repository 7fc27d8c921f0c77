"""Seeding every random number generator a training loop touches."""
import random

import numpy as np
import torch

from .. import collectives


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False):
    """Seeds python, numpy and torch (CPU and all CUDA devices).

    device_specific adds the process index to the seed, so ranks draw different numbers;
    deterministic asks torch for deterministic algorithms.
    """
    if device_specific:
        from ..state import PartialState

        seed += PartialState().process_index
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: str, generator=None):
    """Makes this process's RNG of `rng_type` ("torch", "cuda" or "generator") equal to rank 0's,
    so shuffling draws the same order on every process (a no-op on one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    rng_type = str(rng_type)
    if rng_type == "torch":
        state = torch.get_rng_state()
    elif rng_type == "cuda":
        state = torch.cuda.get_rng_state()
    elif rng_type == "generator":
        if generator is None:
            return
        state = generator.get_state()
    else:
        raise ValueError(f"unknown rng type {rng_type!r}: use 'torch', 'cuda' or 'generator'")
    # NCCL moves CUDA tensors only
    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    state = state.to(on)
    collectives.broadcast(state, src=0)
    state = state.cpu()
    if rng_type == "torch":
        torch.set_rng_state(state)
    elif rng_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        generator.set_state(state)


def synchronize_rng_states(rng_types, generator=None):
    for rng_type in rng_types or []:
        synchronize_rng_state(rng_type, generator=generator)
