"""Models for tests/test_cli.py's estimate-memory checks (imported by path)."""
import torch
from torch import nn


def mlp():
    return nn.Sequential(nn.Linear(100, 200), nn.Linear(200, 10))


def half_frozen():
    model = mlp()
    model[0].requires_grad_(False)
    return model


class NeedsRealTensors(nn.Module):
    """Its constructor reads a value, which the meta device cannot give: built on the CPU instead."""

    def __init__(self, width=16):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = float(self.fc.weight.abs().sum().item() > 0)


NOT_A_MODEL = 3
