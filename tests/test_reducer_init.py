"""_C.Reducer is built once: a second __init__ on a live object is refused and changes nothing."""
import pytest
import torch

from accelerate_c import _C


def test_reinit_of_a_live_reducer_is_refused_and_keeps_its_plan():
    sizes = [10, 300, 5]
    r = _C.Reducer(sizes, [2, 1, 0], 4, 64, 1024, 32)
    r.set_buffer(_C.Buffer(torch.zeros(400)))
    count, total, ranges = r.count(), r.total(), [r.range(b) for b in range(r.count())]
    # a plan for 100000 elements under the 400-element buffer: what re-init used to install
    with pytest.raises(RuntimeError, match="already initialised"):
        r.__init__([100000], [0], 4, 64, 1024, 32)
    assert (r.count(), r.total(), [r.range(b) for b in range(r.count())]) == (count, total, ranges)
    assert total >= sum(sizes)  # still the plan for the three gradients, not for 100000 elements


def test_a_reducer_whose_first_init_failed_can_be_initialised():
    r = _C.Reducer.__new__(_C.Reducer)
    with pytest.raises(ValueError):
        r.__init__([1, 2], [0], 4, 64, 1024, 32)  # 2 sizes, an order of 1
    r.__init__([1, 2], [1, 0], 4, 64, 1024, 32)
    assert r.count() >= 1


def test_a_deferred_reducer_launches_nothing_from_its_hooks():
    """Reducer.defer (join_uneven_inputs on a model with several buffers): complete buckets do
    not reach the glue's launch function from the hooks; clearing it restores the launches."""
    from accelerate_c import _C

    launches = []
    r = _C.Reducer([4, 4], [1, 0], 4, 16, 16, 1, on_first=lambda: None,
                   launch=lambda a, b: launches.append((a, b)), slow=lambda i, p: True)
    flat = torch.zeros(r.total())
    offsets, _ = r.layout()
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    hooks = []
    for i, (o, p) in enumerate(zip(offsets, params)):
        p.grad = flat[o:o + 4]
        hooks.append(r.hook(i, p.grad))
    r.launching, r.defer = True, True
    for i in (1, 0):
        hooks[i](params[i])
    assert launches == [] and r.pending() == []
    r.reset()
    r.defer = False
    for i in (1, 0):
        hooks[i](params[i])
    assert launches == [(0, 1), (1, 2)]
