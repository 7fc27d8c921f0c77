"""Seeding every random number generator a training loop touches."""
import random

import numpy as np
import torch


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
