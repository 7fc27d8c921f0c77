"""Gradients left where autograd puts them: the one-process CPU path without flat buffers.

On several processes the flat buffers (grad_layout.py) are what the bucketed all-reduce reads;
on one process they only serve the fused clip and unscale, and cost a copy of every gradient
into them after backward, the buffer held through the forward beside autograd's fresh
gradients, and a different pattern of frees (docs/performance.md measured the Trainer 4-5%
slower with them on one process). Here each gradient stays autograd's tensor and keeps what made
the buffers' clip cheap: once clip_grad_norm_ asked for a 2-norm, a hook measures each gradient
as it lands (on a backward that ends an accumulation window), and clip is then one scaling pass
over the list, by torch's coefficient (clip_math). A gradient replaced or written since its
measurement is measured again at the clip; what the kernels do not cover (float64, a
non-contiguous gradient, a gradient with a graph, another norm) goes to torch's own clip.

fp16's loss-scale bookkeeping is the manager's for parameters outside the buffers
(GradManager.outside): the hooks here also mark a gradient as carrying the scale.
"""
from __future__ import annotations

import math
import operator
import weakref
from array import array

import torch

from . import _C
from .clip_math import FINITE_MAX, clip_coef, norm_dtype
from .grad_layout import GradView

_SIXTEEN = (torch.float16, torch.bfloat16)


def _measure(g: torch.Tensor, scale: float = 1.0):
    """(exact sum of squares, the sum of squares of the norm times `scale` rounded to the
    gradient's dtype as torch's clip takes it, non-finite) of one contiguous CPU gradient. fp32:
    the exact sum stands for both (as for the flat buffers: GradLayout.sums)."""
    if g.dtype in _SIXTEEN:
        return _C.sumsq_segments(g, array("Q", (0, g.numel())), scale)
    sumsq, nonfinite = _C.sumsq(g)
    return sumsq, sumsq, nonfinite


def kernel_ok(g: torch.Tensor) -> bool:
    """Whether the C kernels take this gradient in place: CPU, a dtype they know, contiguous,
    without a graph."""
    return g.is_cpu and g.dtype in FINITE_MAX and g.is_contiguous() and not g.requires_grad


class LooseGrads:
    """The trainable parameters of the prepared models on one CPU process, their gradients left
    as autograd's tensors; clip over them from sums measured in their hooks."""

    def __init__(self, manager):
        self.manager = manager
        self.params: dict[int, torch.nn.Parameter] = {}  # id -> param
        self.measure = False  # set by the first 2-norm clip: the hooks measure from then on
        self._cover_cache = None

    def add(self, params, model_key) -> None:
        for p in params:
            if not p.requires_grad or id(p) in self.params:
                continue
            self.params[id(p)] = p
            old = self.manager.outside.get(id(p))  # unscaled before it was prepared: hooked already
            if old is not None:
                old[1].remove()
            entry = [True, None, False]  # the manager's outside entry: [carries the loss scale, hook, found]
            entry[1] = p.register_post_accumulate_grad_hook(self._hook(entry, model_key))
            self.manager.outside[id(p)] = entry
        self._cover_cache = None

    def _hook(self, entry, model_key):
        ref = weakref.ref(self)

        def hook(p):
            entry[0], entry[2] = True, False  # a new (scaled) gradient: unscaled once at the step
            me = ref()
            if me is not None and me.measure and me.manager.sync_now(model_key):
                LooseGrads._remember(p)
        return hook

    @staticmethod
    def _remember(p) -> None:
        """Measures p's gradient and keeps the sums on the tensor itself (a replaced gradient is
        another object, without them). A plain tensor becomes a GradView in place (the same
        object: not a view, no weak reference), whose `.data` writes and assignments move its
        version (torch's `.data` has a counter of its own: grad_layout.GradView)."""
        g = p.grad
        if g is None:
            return
        if type(g) is torch.Tensor and kernel_ok(g):
            g.__class__ = GradView
        if type(g) is GradView and kernel_ok(g):
            g._ac_sums = (g._version, g.data_ptr(), *_measure(g))

    @staticmethod
    def _cached(g):
        """The hook's (exact, rounded, non-finite) of `g` if nothing wrote it since it was
        measured (its version; its memory, checked too)."""
        c = getattr(g, "_ac_sums", None)
        if c is not None and c[0] == g._version and c[1] == g.data_ptr():
            return c[2:]
        return None

    def cover(self, params):
        """The loose parameters among `params` when the rest hold no gradient (frozen ones, say),
        each once (a repeated one torch counts twice: left to torch's clip); else None. Loops
        pass the same list every step: the split is cached on identities."""
        c = self._cover_cache
        if c is None or len(c[0]) != len(params) or not all(map(operator.is_, params, c[0])):
            mine = [p for p in params if id(p) in self.params]
            rest = [p for p in params if id(p) not in self.params]
            ok = bool(mine) and len({id(p) for p in params}) == len(params)
            c = self._cover_cache = (tuple(params), mine if ok else None, rest)
        if c[1] is None or any(p.grad is not None for p in c[2]):
            return None
        return c[1]

    def clip(self, params, max_norm: float, inv_scale: float | None, outside: dict, stepped: set = frozenset()):
        """torch.nn.utils.clip_grad_norm_(params, max_norm) (2-norm) over loose gradients, those
        still carrying the loss scale unscaled in the same pass (inv_scale; `outside`: the
        manager's entries) if an optimizer steps them (`stepped`: their ids), as accelerate's
        clip unscales every optimizer's gradients first and GradScaler only those. Returns the
        norm as torch's (a 0-dim tensor of the gradients' dtype), or None for torch's own clip
        to do it (a gradient the kernels do not cover, a loss scale below 1)."""
        self.measure = True
        per = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            if not kernel_ok(g):
                return None
            carries = inv_scale is not None and outside[id(p)][0] and id(p) in stepped
            inv = inv_scale if carries else 1.0
            if inv > 1.0:  # unscaling could overflow: torch's path checks it
                return None
            per.append((p, g, inv))
        sumsq, nonfinite, found = 0.0, False, []
        for p, g, inv in per:
            rounds = g.dtype in _SIXTEEN
            c = None if (rounds and inv != 1.0) else self._cached(g)
            if c is not None:
                ex, ro, nf = c  # measured in its hook, unchanged since (at scale 1)
                s = (ro if rounds else ex) * inv * inv
            else:  # replaced or written since its hook, or measured before clip first asked
                ex, ro, nf = _measure(g, inv)
                # torch unscales before it takes each norm: a 16-bit one is rounded unscaled
                s = ro if rounds else ex * inv * inv
            sumsq += s
            nonfinite = nonfinite or bool(nf)
            found.append(bool(nf))
        total = math.sqrt(sumsq)
        if nonfinite:  # squares are >= 0: only a NaN gradient makes their sum NaN
            total = math.nan if math.isnan(sumsq) else math.inf
        norm, coef = clip_coef(total, max_norm, norm_dtype(g.dtype for _, g, _ in per))
        by_factor: dict = {}
        for (p, g, inv), nf in zip(per, found):
            f = inv * coef
            if f != 1.0:
                by_factor.setdefault(f, []).append(g)
            if inv != 1.0:  # unscaled here: what the step skips on (GradManager.unscale)
                outside[id(p)][0], outside[id(p)][2] = False, nf
        # torch's multi-tensor multiply: each element times f computed in fp32 and rounded once,
        # as a C kernel would, at the speed of one pass over memory scattered in many tensors
        # (per-tensor C calls paid their conversion on each); the versions move as torch's do
        for f, grads in by_factor.items():
            torch._foreach_mul_(grads, f)
        return norm

    def clear(self) -> None:
        self.params = {}
        self.measure = False
        self._cover_cache = None
