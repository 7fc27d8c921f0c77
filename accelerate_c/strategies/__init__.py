"""Gradient strategies: what is done with the flat gradient buffers beyond the local work every
strategy shares (base.GradStrategy, the interface and the single-process strategy; ddp.DDPStrategy,
torch DDP's replicated training). docs/architecture.md, "Strategies"."""
from .base import GradStrategy

__all__ = ["GradStrategy"]
