"""accelerate_c: Hugging Face accelerate's Accelerator, with a C core."""
from . import _C
from ._C import CoreError

__version__ = "0.1.0"

__all__ = ["CoreError", "__version__"]
