"""The layout of one flat gradient buffer: which range of it each parameter's gradient owns.

Every trainable parameter of a prepared model gets a range of one flat buffer per (dtype,
device) (docs/architecture.md, "Gradient buffers"). This module holds what that takes and
nothing about what is done with the gradients: the C bucket plan (_C.Reducer: ranges in the
order gradients are expected to arrive, cut into buckets), the buffer, its views, the alignment
gaps kept at zero, the parameters' post-accumulate-grad hooks, and the `.grad` bookkeeping
(assignments made outside backward brought in, a parameter cast or moved after prepare()
detected). What runs when a hook fires or a backward ends (unscaling, reduction, sharding) is
the subclass's and the gradient strategy's (grads.GradGroup, strategies/).

`.grad` behaves as in torch: None until a backward gives the parameter a gradient, None again
after zero_grad() (set_to_none). Whether a parameter has a gradient is never stored apart:
after resync() it is exactly `p.grad is view`. A hook copies the gradient that backward produced
into the range and points `.grad` at it (what torch DDP's reducer does): one copy, cheaper than
zeroing the buffer and accumulating into zeros; later micro-batches accumulate in place. For a
plain CPU gradient the copy is made in C, measured for clip on the way (_C.Reducer.bump);
_copy_in is the path for the rest.
"""
from __future__ import annotations

import math
from array import array

import torch
from torch.autograd.graph import increment_version

from . import _C

ALIGN = 32  # elements; each range starts on a 64-byte boundary or better


def _version_bump():
    """torch's version-counter increment as the C hooks call it, with a 1-tuple of tensors:
    torch._C._increment_version takes one since torch 2.5; before, only a single tensor."""
    probe = torch.zeros(1)
    try:
        torch._C._increment_version((probe,))
        return torch._C._increment_version
    except TypeError:
        return lambda views: torch._C._increment_version(views[0])


_BUMP = _version_bump()
HUGE_PAGE = 2 << 20


def alloc_flat(numel: int, dtype, device) -> torch.Tensor:
    """A zeroed flat buffer. On the CPU, one of 2 MiB or more starts on a 2 MiB boundary and
    is advised onto transparent huge pages before it is first touched: every whole-buffer pass
    (backward's copy-in, the fused unscale/norm/clip, the optimizer's reads) then runs with
    512x fewer TLB misses (8-10% faster on a 55 MB buffer here; benchmarks/bench_step.py).
    The advice is a hint: where the kernel ignores it the buffer is the same, on 4 KiB pages."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < HUGE_PAGE:
        return torch.zeros(numel, dtype=dtype, device=device)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is mapped yet
    start = (-raw.data_ptr()) % HUGE_PAGE
    flat = raw[start:start + nbytes].view(dtype)
    _C.advise_hugepages(flat)
    return flat.zero_()


def _segments(offsets, numels, start: int, length: int) -> array:
    """The (offset, length) pairs, relative to `start`, of the ranges that begin inside
    [start, start + length): native size_t pairs, as _C.sumsq_segments reads them."""
    out = array("Q")
    assert out.itemsize == 8, "sumsq_segments reads 64-bit size_t"
    for o, n in sorted(zip(offsets, numels)):
        if start <= o < start + length:
            out.extend((o - start, n))
    return out


class GradView(torch.Tensor):
    """A parameter's range of the flat buffer, as its `.grad`: a plain tensor in every respect
    (torch functions are not intercepted; what they return is a plain tensor) except `.data`.
    torch's `.data` is an alias with a version counter of its own, so a write through
    `p.grad.data` (older training code scales or clips that way) would leave the buffer's
    version as it was, and the sums of squares clip reuses (measured in the hooks, or after
    each bucket's all-reduce, and keyed on that version) would go stale unseen. Here `.data`
    is the alias `.detach()` gives, which shares the version counter: its writes count, also
    through a handle kept across steps, and reads cost nothing. (Unlike torch's `.data`, its
    sizes cannot be changed in place. Assigning `.data` is torch's: it swaps the memory under
    the view, which the next step's `.grad` walk notices and rebuilds the buffer for, dropping
    every cached sum.) Pickled and deep-copied as a plain tensor. CPU buffers only
    (GradLayout.build)."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def data(self):
        return torch.Tensor.detach(self)

    @data.setter
    def data(self, value):
        torch.Tensor.data.__set__(self, value)
        # torch's assignment keeps the version; the memory it brings may sit where the old one
        # was (a cache keyed on the version and the address would take it for the same data)
        increment_version(self)

    def __reduce_ex__(self, proto):
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        return self.as_subclass(torch.Tensor).__deepcopy__(memo)


class GradLayout:
    """The flat buffer of the gradients of parameters sharing a dtype and device, and their
    hooks. Subclasses say what the hooks do: on_first() (the first gradient of a backward),
    on_buckets(first, last) (buckets [first, last) became complete on a backward that reduces)."""

    def __init__(self, params, dtype, device, bucket_caps, order=None):
        self.params = list(params)
        self.dtype = dtype
        self.device = device
        self.bucket_caps = bucket_caps
        self.is_cuda = torch.device(device).type == "cuda"
        # what param.get_device() says for this buffer's device (-1: CPU)
        self.device_index = -1 if not self.is_cuda else (
            torch.device(device).index if torch.device(device).index is not None else self.params[0].get_device())
        # a parameter was cast or moved after prepare(): the buffer is rebuilt at the next step
        self.broken = False
        self.hooks = []
        self.build(list(range(len(self.params)))[::-1] if order is None else order)
        for i, p in enumerate(self.params):
            if p.grad is not None:  # a gradient from before prepare() or a rebuild: bring it in
                with torch.no_grad():
                    self.views[i].copy_(p.grad)
                p.grad = self.views[i]

    def build(self, order):
        """Lays the buffer out with the C bucket plan (gradients in `order`, the order they are
        expected to arrive in backward) and hooks every parameter to its range."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        first_cap, cap = self.bucket_caps
        self.order = list(order)
        self.reducer = _C.Reducer([p.numel() for p in self.params], self.order, esize, first_cap, cap, ALIGN,
                                  self.on_first, self.on_buckets, self._copy_in)
        # the hooks copy plain CPU gradients in C (and measure them on the way), bumping the
        # view's version with torch's own counter as copy_ would; _copy_in takes the rest
        self.reducer.bump = _BUMP
        offsets, _ = self.reducer.layout()
        self.offsets = offsets
        self.flat = self.alloc_buffer(self.reducer.total())
        # CPU views are GradViews, whose `.data` shares their version counter: the sums of
        # squares clip reuses are taken on CPU buffers only. CUDA views stay plain tensors, so
        # torch's own multi-tensor paths (clip_grad_norm_'s foreach check wants the exact
        # type) keep taking them there
        views = [self.flat[o:o + p.numel()].view(p.shape) for o, p in zip(offsets, self.params)]
        self.views = views if self.is_cuda else [v.as_subclass(GradView) for v in views]
        # the alignment gaps between ranges: zero, and kept zero (see scale_), so that
        # whole-buffer passes and bucket all-reduces read zeros there
        spans = sorted((o, o + p.numel()) for o, p in zip(offsets, self.params))
        ends = [0] + [e for _, e in spans]
        starts = [st for st, _ in spans] + [self.reducer.total()]
        self.gaps = [(e, st) for e, st in zip(ends, starts) if st > e]
        self.gap_index = None
        if self.is_cuda and self.gaps:
            self.gap_index = torch.cat([torch.arange(e, st) for e, st in self.gaps]).to(self.device)
        self.ptrs = [v.data_ptr() for v in self.views]
        # pointers are taken once here; per-step kernel calls pass this object, not a tensor
        self.buf = _C.Buffer(self.flat)
        self.reducer.set_buffer(self.buf)
        # each bucket's range, as a tensor for the collectives and a Buffer for the C kernels:
        # made once per layout, not per step
        spans = [self.reducer.range(b) for b in range(self.reducer.count())]
        self.buckets = [self.flat[s:s + n] for s, n in spans]
        self.bucket_bufs = [_C.Buffer(t) for t in self.buckets]
        # 16-bit buffers: each parameter's (offset, length), in the whole buffer and in each
        # bucket, for the per-parameter norms torch's clip_grad_norm_ rounds (_C.sumsq_segments)
        self.segs = self.bucket_segs = None
        if self.dtype in (torch.float16, torch.bfloat16):
            numels = [p.numel() for p in self.params]
            self.segs = _segments(offsets, numels, 0, self.reducer.total())
            self.bucket_segs = [_segments(offsets, numels, s, n) for s, n in spans]
        for h in self.hooks:
            h.remove()
        # the hooks are C callables (_C.GradHook): a gradient that already is its view is
        # marked ready without running Python; the rest goes to _copy_in
        self.hooks = [p.register_post_accumulate_grad_hook(self.reducer.hook(i, v))
                      for i, (p, v) in enumerate(zip(self.params, self.views))]

    def sums(self, bucket: int | None = None, scale: float = 1.0):
        """(sum of squares, the sum of the squares of each gradient's 2-norm times `scale` rounded
        to the buffer's dtype, non-finite) of the whole buffer or of one bucket (CPU). The second
        is what torch's clip_grad_norm_ squares and adds, as it takes one norm per gradient in the
        gradient's dtype, of gradients already unscaled (`scale`: the inverse loss scale). For
        fp32 buffers the exact sum stands for it, unscaled (torch's fp32 rounding of each norm
        moves its total by about an fp32 ulp, as its own summation order does)."""
        buf = self.buf if bucket is None else self.bucket_bufs[bucket]
        if self.segs is None:
            sumsq, nonfinite = _C.sumsq(buf)
            return sumsq, sumsq, nonfinite
        return _C.sumsq_segments(buf, self.segs if bucket is None else self.bucket_segs[bucket], scale)

    def has_gradients(self) -> bool:
        """Whether any parameter of the buffer holds a gradient (after the step's `.grad` walk)."""
        return any(p.grad is not None for p in self.params)

    def alloc_buffer(self, numel: int) -> torch.Tensor:
        """The zeroed flat buffer (grads.GradGroup lets its strategy place it: shared memory)."""
        return alloc_flat(numel, self.dtype, self.device)

    @torch.no_grad()
    def relayout(self, order):
        """Re-lays the buffer in `order`, keeping every parameter's gradient and `.grad` state.
        Whoever calls it owns what depended on the old buffer (a strategy re-attaches)."""
        old_views = self.views
        had = [p.grad is v for p, v in zip(self.params, old_views)]
        self.build(order)
        for p, old, new, h in zip(self.params, old_views, self.views, had):
            new.copy_(old)
            if h:
                p.grad = new

    # ---- what the hooks call ------------------------------------------------------------
    def on_first(self):
        raise NotImplementedError

    def on_buckets(self, first, last):
        raise NotImplementedError

    def _copy_in(self, i, p) -> bool:
        """A gradient that is not the parameter's view (the first backward after zero_grad
        set it to None, or .grad was assigned): copy it in and re-point `.grad`, as torch DDP's
        reducer does. Returns False when the parameter was cast or moved after prepare()."""
        if p.dtype != self.dtype or p.device != self.device:
            self.broken = True  # rebuilt at the next step
            return False
        g = p.grad
        if g.requires_grad:
            # backward(create_graph=True): the gradient carries a graph; it stays as it is until
            # resync() at the step. Buckets cannot be reduced without it.
            if self.reducer.launching:
                raise RuntimeError("backward(create_graph=True) is not supported with several processes: the "
                                   "gradient of a parameter carries a graph and cannot be reduced in its bucket")
            return True
        view = self.views[i]
        with torch.no_grad():
            f = self.reducer.prescale  # 1.0 unless the strategy divides as gradients arrive
            if f != 1.0:
                torch.mul(g, f, out=view)  # the copy-in that also averages (torch DDP's trick)
            else:
                view.copy_(g)
        p.grad = view
        return True

    # ---- `.grad` bookkeeping --------------------------------------------------------------
    def unsynced(self):
        """None when the buffer is broken: a parameter was cast or moved after prepare()
        (model.to(...) swaps `.grad.data` under the view, so the range would silently stop
        being used). Else the indices whose `.grad` is not its view, for resync(). One C walk
        over the parameters, run once per step (GradManager.prepare_step)."""
        if self.broken:
            return None
        return _C.grad_views(self.params, self.views, self.ptrs, self.dtype, self.device_index)

    @torch.no_grad()
    def resync(self, indices):
        """Brings the `.grad` assignments made outside backward (params `indices`, from
        unsynced) into the buffer; zeroes the ranges of params without a gradient (their
        `.grad` stays None), so whole-buffer passes see zeros there. When the hooks keep sums
        of squares for clip (reducer.measure), each range written here is measured as a hook
        would, right after its write, so a parameter without a gradient in this backward (or
        an assigned `.grad`) does not cost clip a read of the whole buffer."""
        measure = self.reducer.measure
        for i in indices:
            p, v = self.params[i], self.views[i]
            g = p.grad
            if g is v:
                continue
            if g is None:
                v.zero_()  # stale since the last zero_grad; whole-buffer passes must see zeros
            else:
                if g.shape != v.shape:
                    raise ValueError(f"a gradient of shape {tuple(g.shape)} was assigned to a parameter of shape "
                                     f"{tuple(v.shape)}")
                v.copy_(g)
                p.grad = v
            if measure:
                self.reducer.measure_now(i, v)

    def remove(self):
        """Unhooks the parameters; a `.grad` that was a view becomes a tensor of its own."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for p, v in zip(self.params, self.views):
            if p.grad is v:
                p.grad = v.clone()

    # ---- whole-buffer writes ------------------------------------------------------------
    def stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def wrote(self):
        """The C kernels wrote the buffer through DLPack, which torch cannot see: bump the
        version counter (shared by every view, so `.grad` readers and cached norms see the
        change) as torch's own in-place ops would."""
        increment_version(self.flat)

    def scale_(self, factor: float):
        if factor == 1.0:
            return
        if self.is_cuda:
            _C.cuda_scale_(self.buf, factor, None, self.stream())
        else:
            _C.scale_(self.buf, factor)
        if math.isnan(factor):  # torch's clip of a NaN norm: 0 x NaN would poison the gaps
            self.zero_gaps()
        self.wrote()

    def zero_gaps(self):
        """Zeroes the gaps between the ranges after a pass that may have written non-finite
        values there (a NaN factor): otherwise every later step's norm and overflow check, and
        every rank's all-reduce, would see them."""
        if self.gap_index is not None:
            self.flat.index_fill_(0, self.gap_index, 0)
        elif not self.is_cuda:
            for start, end in self.gaps:
                self.flat[start:end].zero_()
