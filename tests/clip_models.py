"""Small models the clip tests share (tests/test_clip_hook_sums.py for the flat buffers,
tests/test_loose_grads.py for one process without them)."""
import torch
from torch import nn


class HalfAndFull(nn.Module):
    """A bf16 layer and an fp32 layer: two buffers, each measured in its own hooks."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16).to(torch.bfloat16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.to(torch.bfloat16))).float())


class WithBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, use_branch=True):
        h = torch.relu(self.fc1(x))
        if use_branch:
            h = h + torch.relu(self.branch(h))
        return self.fc2(h)


class Checkpointed(nn.Module):
    """A reentrant-checkpointed segment whose weight is also used outside it: its gradient is
    accumulated twice in one backward (two hooks), by two graph tasks."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.relu(self.fc1(t)), x, use_reentrant=True)
        return self.fc2(self.fc1(h))
