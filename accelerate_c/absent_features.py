"""accelerate's Accelerator names for two features accelerate_c does not build, FP8 training and
LOMO optimizers (which update the parameters inside backward), with accelerate 1.15's values
for a run without them, so that code reading them (transformers' Trainer reads
`fp8_backend`, `has_lomo_optimizer`) runs. mixed_precision="fp8" is refused at construction
(accelerator.py); a LOMO optimizer is refused at prepare(): its update inside backward would
run on each process's own gradients before any reduction, so several processes would train
apart without an error."""
from __future__ import annotations

from .utils.dataclasses import FP8BackendType, parse_choice_from_env

_LOMO_CLASSES = ("Lomo", "AdaLomo")


def is_lomo_optimizer(optimizer) -> bool:
    """Whether the optimizer is lomo_optim's Lomo or AdaLomo (recognised by class and module, so
    the package need not be importable)."""
    return any(cls.__name__ in _LOMO_CLASSES and cls.__module__.split(".")[0] == "lomo_optim"
               for cls in type(optimizer).__mro__)


def refuse_lomo(optimizer) -> None:
    if is_lomo_optimizer(optimizer):
        raise NotImplementedError(f"prepare({type(optimizer).__name__}): LOMO optimizers (lomo_optim) are not "
                                  "supported by accelerate_c; they update the parameters inside backward, before "
                                  "accelerate_c reduces the gradients across processes. Use a torch.optim optimizer")


class AbsentFeatureNames:
    """Mixed into the Accelerator: FP8 and LOMO as accelerate reports them when unused."""

    fp8_enabled = False
    has_fp8_handler = False
    delayed_fp8_autocast = False
    fp8_recipe_handler = None
    ao_recipe_handler = None
    te_recipe_handler = None
    msamp_recipe_handler = None
    has_lomo_optimizer = False

    @property
    def fp8_backend(self) -> FP8BackendType:
        """Without an FP8 recipe, accelerate reads ACCELERATE_FP8_BACKEND (default NO)."""
        value = parse_choice_from_env("ACCELERATE_FP8_BACKEND", "NO")
        try:
            return FP8BackendType(value)
        except ValueError:
            raise ValueError(f"ACCELERATE_FP8_BACKEND={value!r}: expected one of "
                             f"{[b.value for b in FP8BackendType]}") from None

    def lomo_backward(self, loss, learning_rate: float) -> None:
        """accelerate's errors: no learning rate, or no LOMO optimizer prepared (none can be)."""
        if learning_rate is None:
            raise ValueError("A learning rate must be passed in order to call backward pass with LOMO optimizers.")
        raise ValueError("lomo_backward: no LOMO optimizer was prepared (accelerate_c refuses them at prepare(); "
                         "call accelerator.backward(loss) instead)")
