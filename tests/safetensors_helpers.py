"""Shared by the safetensors tests (test_safetensors_*.py)."""
import os

import torch

DIRECT_ENV = "ACCELERATE_C_DIRECT_IO"


def as_bytes(t):
    """Bitwise view (NaN payloads, -0.0 and bool bytes compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def random_tensor(dtype, shape, gen):
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def sorted_listdir(d):
    return sorted(os.listdir(d))
