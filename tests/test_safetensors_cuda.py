"""CUDA tensors in the C safetensors engine: save_file / load_file / load_into on a GPU (skipped
without one), and, checkable without a GPU, CUDA DLPack tensors reaching the C writer (ready
events checked first, the device checked before anything is created) and refused as load
targets."""
import ctypes

import pytest
import torch

import safetensors.torch as st_pkg

from accelerate_c import CoreError, _C
from accelerate_c.safetensors_io import load_file, load_into, save_file

from safetensors_helpers import DIRECT_ENV, sorted_listdir


# ---- CUDA tensors on a GPU ----------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_tensors(tmp_path):
    t = torch.randn(1000, device="cuda")
    save_file({"g": t}, tmp_path / "g.safetensors")
    back = load_file(tmp_path / "g.safetensors", device="cuda")
    assert back["g"].device.type == "cuda" and torch.equal(back["g"], t)
    dst = torch.zeros(1000, device="cuda")
    load_into(tmp_path / "g.safetensors", {"g": dst})
    assert torch.equal(dst, t)


# ---- CUDA tensors through DLPack (checkable without a GPU) ---------------------------------------

_CapsuleGetPointer = ctypes.pythonapi.PyCapsule_GetPointer
_CapsuleGetPointer.restype = ctypes.c_void_p
_CapsuleGetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
# DLManagedTensorVersioned: version (2 x u32), manager_ctx, deleter, flags (u64), then the
# DLTensor: data pointer, then DLDevice {int32 device_type, int32 device_id}
_DEVICE_OFFSET = 8 + 8 + 8 + 8 + 8
_KDLCUDA = 2


def _as_cuda_capsule(t, device_id=0):
    """A real DLPack capsule of CPU tensor `t` whose DLDevice says CUDA device `device_id`: what
    the C writer receives for a CUDA tensor (only the device field differs; torch's deleter still
    frees it). The writer must never touch its memory from the host: here it must refuse it
    before that (no GPU on this machine)."""
    cap = t.__dlpack__(max_version=(1, 0))
    base = _CapsuleGetPointer(cap, b"dltensor_versioned")
    ctypes.c_int32.from_address(base + _DEVICE_OFFSET).value = _KDLCUDA
    ctypes.c_int32.from_address(base + _DEVICE_OFFSET + 4).value = device_id
    return cap


def test_st_save_ready_events_are_checked_before_anything_is_written(tmp_path):
    """st_save's `ready` ({CUDA device: cudaEvent_t handle}, what save_file passes so the
    writer's copies wait for the producing stream) must name an event for the device of every
    CUDA tensor: a missing or NULL one is a ValueError naming the device and the tensor, raised
    before the core runs (no file); host tensors need none."""
    path = tmp_path / "r.safetensors"
    host = torch.randn(100)
    cases = [({}, ValueError, "st_save: ready has no event for CUDA device 3 (tensor 'layer.gpu')"),
             ({3: 0}, ValueError, "the event for CUDA device 3 (tensor 'layer.gpu') is a NULL handle"),
             ([1], TypeError, "ready must be a dict of CUDA device index to event handle, or None")]
    for ready, exc, msg in cases:
        with pytest.raises(exc) as ei:
            _C.st_save(str(path), ["cpu", "layer.gpu"], [torch.zeros(4), _as_cuda_capsule(host, 3)], None, 0, ready)
        assert msg in str(ei.value)
    assert sorted_listdir(tmp_path) == []
    _C.st_save(str(path), ["cpu"], [torch.arange(4.0)], None, 0, {})  # host tensors: no event needed
    assert torch.equal(load_file(path)["cpu"], torch.arange(4.0))


def test_st_save_takes_dlpack_capsules(tmp_path):
    a, b = torch.arange(10, dtype=torch.int32), torch.randn(3, 4)
    _C.st_save(str(tmp_path / "c.safetensors"), ["a", "b"], [a.__dlpack__(), b.__dlpack__(max_version=(1, 0))],
               None, 0)
    st_pkg.save_file({"a": a, "b": b}, tmp_path / "ref.safetensors")
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    used = a.__dlpack__()
    _C.st_save(str(tmp_path / "d.safetensors"), ["a"], [used], None, 0)
    with pytest.raises(ValueError, match="'a': this DLPack capsule was already consumed"):
        _C.st_save(str(tmp_path / "e.safetensors"), ["a"], [used], None, 0)
    assert sorted(sorted_listdir(tmp_path)) == ["c.safetensors", "d.safetensors", "ref.safetensors"]


@pytest.mark.parametrize("direct_io", ["0", "1", "auto"])
def test_cuda_dlpack_tensor_reaches_the_core(tmp_path, monkeypatch, direct_io):
    """st_save hands a CUDA DLPack tensor to the C writer, which checks the device before it
    creates anything: a CPU-only build says it was built without CUDA; a CUDA build says no
    device 1000 can be used (on a GPU machine too: that device cannot exist, so the check, not
    a copy from the host memory behind this capsule, is what answers). The old file stays; no
    temp file is left."""
    monkeypatch.setenv(DIRECT_ENV, direct_io)
    path = tmp_path / "g.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    host = torch.randn(1000)
    with pytest.raises(CoreError) as ei:
        _C.st_save(str(path), ["cpu", "layer.gpu"], [torch.zeros(4), _as_cuda_capsule(host, 1000)], None, 0)
    msg = str(ei.value)
    assert "g.safetensors: tensor 'layer.gpu' is on CUDA device 1000" in msg
    if _C.has_cuda:
        assert ei.value.code in ("AC_ERR_CUDA", "AC_ERR_INVALID_ARG")
    else:
        assert ei.value.code == "AC_ERR_UNSUPPORTED"
        assert "built without CUDA" in msg and "nvcc" in msg
    assert _C.st_last_write_mode() == "none"
    assert path.read_bytes() == before
    assert sorted_listdir(tmp_path) == ["g.safetensors"]


def test_cuda_dlpack_tensor_refused_as_load_target(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(5)}, path)
    with pytest.raises(ValueError, match="'w' is on DLPack device type 2; copy it to the CPU first"):
        _C.st_load_into(str(path), {"w": _as_cuda_capsule(torch.zeros(5))}, 0)
