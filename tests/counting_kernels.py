"""A counting stand-in for the C kernels accelerate_c.grads calls, shared by
tests/test_clip_hook_sums.py and tests/scripts/reducer.py: whether clip_grad_norm_ read the
gradient buffer again, or used the sums of squares the gradient hooks took, shows only in how
many whole-buffer read passes it made."""
import contextlib

from accelerate_c import grad_layout as layout_mod
from accelerate_c import grads as grads_mod
from accelerate_c import loose_grads as loose_mod


class CountingKernels:
    """Stands in for grads._C and grad_layout._C: counts the whole-buffer read passes (sumsq,
    sumsq_segments, stats) clip makes."""

    def __init__(self, real):
        self.real, self.reads = real, 0

    def __getattr__(self, name):
        fn = getattr(self.real, name)
        if name in ("sumsq", "sumsq_segments", "stats"):
            def counted(*a, **k):
                self.reads += 1
                return fn(*a, **k)
            return counted
        return fn


@contextlib.contextmanager
def counting_reads():
    """grads._C, grad_layout._C and loose_grads._C are one CountingKernels inside the block; the real module
    is put back however the block ends, so a failing check cannot leave later code counting."""
    counting = CountingKernels(grads_mod._C)
    grads_mod._C = layout_mod._C = loose_mod._C = counting
    try:
        yield counting
    finally:
        grads_mod._C = layout_mod._C = loose_mod._C = counting.real
