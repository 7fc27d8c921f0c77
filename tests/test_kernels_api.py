"""The controls of accelerate_c._C (thread count, kernel instruction set and its environment
variable, CUDA presence) and the argument validation every kernel does before it touches memory:
non-contiguous, wrong dtype, requires_grad, non-tensors, arity, factor type, cast_ sizes."""
import os
import sys

import pytest
import torch

import accelerate_c
from accelerate_c import _C

from conftest import AVAILABLE_ISAS, STARTUP_ISA
from timeouts import wait_s

pytestmark = pytest.mark.usefixtures("torch_single_thread", "restore_core_state")


# ---------------------------------------------------------------------------------------------
# controls: threads, ISA, CUDA presence


def test_num_threads_roundtrip():
    for k in (1, 2, 3, 7):
        _C.set_num_threads(k)
        assert _C.get_num_threads() == k
    _C.set_num_threads(1000)  # capped at 64 (pool.h)
    assert _C.get_num_threads() == 64


@pytest.mark.parametrize("bad", [0, -1, 2**21])
def test_set_num_threads_rejects_out_of_range(bad):
    _C.set_num_threads(3)
    with pytest.raises(ValueError, match="set_num_threads"):
        _C.set_num_threads(bad)
    assert _C.get_num_threads() == 3


def test_set_num_threads_type_and_arity():
    with pytest.raises(TypeError):
        _C.set_num_threads("2")
    with pytest.raises(TypeError):
        _C.set_num_threads()
    with pytest.raises(TypeError):
        _C.set_num_threads(1, 2)
    with pytest.raises(TypeError):
        _C.get_num_threads(1)


def test_kernel_isa_controls():
    assert _C.kernel_isa() in ("scalar", "avx2")
    _C.set_kernel_isa("scalar")
    assert _C.kernel_isa() == "scalar"
    with pytest.raises(accelerate_c.CoreError) as ei:
        _C.set_kernel_isa("bogus")
    assert isinstance(ei.value, RuntimeError)
    assert ei.value.code == "AC_ERR_INVALID_ARG"
    assert "bogus" in str(ei.value)
    assert _C.kernel_isa() == "scalar"  # unchanged by the failed call
    with pytest.raises(TypeError):
        _C.set_kernel_isa(1)
    with pytest.raises(TypeError):
        _C.kernel_isa("scalar")
    if "avx2" not in AVAILABLE_ISAS:
        with pytest.raises(accelerate_c.CoreError) as ei:
            _C.set_kernel_isa("avx2")
        assert ei.value.code == "AC_ERR_UNSUPPORTED"


def test_core_error_is_exported():
    assert accelerate_c.CoreError is _C.CoreError
    assert issubclass(accelerate_c.CoreError, RuntimeError)


def test_cuda_presence():
    assert isinstance(_C.has_cuda, bool)
    # a CPU-only build, or no usable GPU, reports 0 devices
    expected = torch.cuda.device_count() if (_C.has_cuda and torch.cuda.is_available()) else 0
    assert _C.cuda_device_count() == expected


def test_cuda_kernels_reject_cpu_tensors():
    t = torch.ones(8)
    out = torch.zeros(3)
    calls = [
        lambda: _C.cuda_stats_(t, out, 0),
        lambda: _C.cuda_scale_(t, 2.0, None, 0),
        lambda: _C.cuda_unscale_check_(t, torch.ones(1), torch.zeros(1), None, 0),
        lambda: _C.cuda_cast_(torch.zeros(8, dtype=torch.float16), t, 0),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="CUDA"):
            call()
    assert torch.equal(t, torch.ones(8)) and torch.equal(out, torch.zeros(3))
    with pytest.raises(TypeError, match="stream"):
        _C.cuda_scale_(t, 2.0, None, "stream")
    with pytest.raises(TypeError):
        _C.cuda_stats_(t, out)  # arity


# ---------------------------------------------------------------------------------------------
# bad input


KERNEL_CALLS = {
    "stats": lambda x: _C.stats(x),
    "nonfinite": lambda x: _C.nonfinite(x),
    "scale_": lambda x: _C.scale_(x, 2.0),
    "scale_stats_": lambda x: _C.scale_stats_(x, 2.0),
    "cast_dst": lambda x: _C.cast_(x, torch.zeros(_numel(x), dtype=torch.float16)),
    "cast_src": lambda x: _C.cast_(torch.zeros(_numel(x), dtype=torch.float16), x),
}


def _numel(x):
    return x.numel() if isinstance(x, torch.Tensor) else 3


kernel_param = pytest.mark.parametrize("call", list(KERNEL_CALLS.values()), ids=list(KERNEL_CALLS))


@kernel_param
def test_non_contiguous_rejected(call):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    before = base.clone()
    for bad in (base.reshape(-1)[::2], base.t(), base[:, 1:3], base[:, 2:3], torch.ones(1).expand(5)):
        assert not bad.is_contiguous()
        with pytest.raises(ValueError, match="contiguous"):
            call(bad)
    assert torch.equal(base, before)


@kernel_param
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.int32, torch.uint8, torch.bool, torch.complex64])
def test_wrong_dtype_rejected(call, dtype):
    t = torch.zeros(3, dtype=dtype)
    name = str(dtype).replace("torch.", "")  # int64, float64, int32, uint8, bool, complex64
    with pytest.raises(TypeError, match=name):
        call(t)


@kernel_param
def test_requires_grad_rejected(call):
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(TypeError, match="detach"):
        call(t)
    assert torch.equal(t.detach(), torch.ones(3))
    call(t.detach())  # the detached view is fine


@kernel_param
@pytest.mark.parametrize("bad", [[1.0, 2.0, 3.0], None, 3.0, "abc", object()], ids=["list", "None", "float", "str", "object"])
def test_non_tensor_rejected(call, bad):
    with pytest.raises(TypeError, match="expected a tensor"):
        call(bad)


def test_wrong_arg_count():
    t = torch.ones(4)
    for fn, args in [
        (_C.stats, ()), (_C.stats, (t, t)), (_C.nonfinite, ()), (_C.scale_, (t,)),
        (_C.scale_, (t, 1.0, 2.0)), (_C.scale_stats_, (t,)), (_C.cast_, (t,)), (_C.cast_, (t, t, t)),
    ]:
        with pytest.raises(TypeError, match="positional argument"):
            fn(*args)
    with pytest.raises(TypeError):
        _C.stats(tensor=t)
    assert torch.equal(t, torch.ones(4))


def test_factor_must_be_a_number():
    t = torch.ones(4)
    for fn in (_C.scale_, _C.scale_stats_):
        with pytest.raises(TypeError, match="factor"):
            fn(t, "2")
        with pytest.raises(TypeError, match="factor"):
            fn(t, None)
    assert torch.equal(t, torch.ones(4))
    _C.scale_(t, 2)  # an int is a number
    assert torch.equal(t, torch.full((4,), 2.0))


def test_cast_size_mismatch():
    dst = torch.zeros(5, dtype=torch.float16)
    for src in (torch.ones(4), torch.ones(6), torch.ones(0)):
        with pytest.raises(ValueError, match="elements"):
            _C.cast_(dst, src)
    assert torch.equal(dst, torch.zeros(5, dtype=torch.float16))


def test_bad_second_argument_names_it():
    dst = torch.zeros(4)
    with pytest.raises(TypeError, match="src"):
        _C.cast_(dst, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="dst"):
        _C.cast_(torch.zeros(4, dtype=torch.int64), dst)
    with pytest.raises(ValueError, match="src.*contiguous"):
        _C.cast_(dst, torch.zeros(8)[::2])


# ---------------------------------------------------------------------------------------------
# the start-up instruction set


@pytest.mark.skipif("AC_KERNELS_ISA" in os.environ, reason="start-up ISA forced by the environment")
def test_default_isa_is_the_best_available():
    assert STARTUP_ISA == ("avx2" if "avx2" in AVAILABLE_ISAS else "scalar")


def test_isa_environment_variable_forces_scalar():
    import subprocess

    code = "from accelerate_c import _C; print(_C.kernel_isa())"
    env = dict(os.environ, AC_KERNELS_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=wait_s(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"
