"""The C safetensors reader's validation: one crafted file per rule (each error names the file
and the fault), the `safetensors` package refusing the same files, length-prefix faults and a
truncated file."""
import json
import struct

import pytest
import torch

import safetensors.torch as st_pkg

from accelerate_c import CoreError, _C
from accelerate_c.safetensors_io import list_tensors, load_file, save_file


# ---- validation: one crafted file per rule ------------------------------------------------------

def _f32(begin, end, shape=None):
    shape = [(end - begin) // 4] if shape is None else shape
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


BAD_HEADERS = [
    # (id, header bytes (or dict), data bytes, expected message fragment)
    ("not_object", b"[1, 2]", 0, "must start with '{'"),
    ("leading_space", b' {"a":' + json.dumps(_f32(0, 4)).encode() + b"}", 4, "must start with '{'"),
    ("truncated_json", b'{"a": {"dtype": "F32", "shape": [1], "data_off', 4, "unterminated string"),
    ("trailing_comma", b'{"a":' + json.dumps(_f32(0, 4)).encode() + b",}", 4, "expected a string for a tensor name"),
    ("trailing_garbage", b'{"a":' + json.dumps(_f32(0, 4)).encode() + b"}xyz", 4, "unexpected content after"),
    ("bad_utf8", b'{"a\xff":' + json.dumps(_f32(0, 4)).encode() + b"}", 4, "invalid UTF-8"),
    ("dup_name", b'{"a":' + json.dumps(_f32(0, 4)).encode() + b',"a":' + json.dumps(_f32(4, 8)).encode() + b"}", 8,
     "tensor name 'a' appears twice"),
    ("dup_metadata", {"__metadata__": {"k": "v"}}, 0, None),  # replaced below by a raw duplicate
    ("metadata_not_str", {"__metadata__": {"format": 1}}, 0, "__metadata__ value of 'format' must be a string"),
    ("unknown_dtype", {"a": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, 16,
     "tensor 'a': unknown dtype 'F128'"),
    ("negative_shape", {"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4,
     "tensor 'a': shape must not be negative"),
    ("float_shape", {"a": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}}, 4, "must be integers"),
    ("missing_field", {"a": {"dtype": "F32", "shape": [1]}}, 4, "tensor 'a': missing field 'data_offsets'"),
    ("unknown_field", {"a": dict(_f32(0, 4), extra=1)}, 4, "tensor 'a': unknown field 'extra'"),
    ("three_offsets", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 8]}}, 8, "exactly two integers"),
    ("reversed_offsets", {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, 4, "end before they begin"),
    ("size_mismatch", {"a": _f32(0, 8, shape=[3])}, 8, "tensor 'a': data_offsets span 8 bytes but dtype F32"),
    ("shape_overflow", {"a": _f32(0, 4, shape=[2**40, 2**40])}, 4, "tensor 'a': shape is too large"),
    ("past_end", {"a": _f32(0, 16)}, 8, "tensor 'a': data_offsets [0, 16] run past the end of the data region"),
    ("overlap", {"a": _f32(0, 8), "b": _f32(4, 12)}, 12, "tensors 'a' [0, 8) and 'b' [4, 12) overlap"),
    ("hole", {"a": _f32(0, 4), "b": _f32(8, 12)}, 12, "hole at bytes [4, 8) of the data region between tensors 'a' and 'b'"),
    ("hole_at_start", {"a": _f32(4, 8)}, 8, "hole at bytes [0, 4)"),
    ("trailing_data", {"a": _f32(0, 4)}, 12, "the data region is 12 bytes but the tensors cover only [0, 4)"),
]


def _write_image(path, header, data_size, length=None):
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(hb) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + hb + b"\0" * data_size)


@pytest.mark.parametrize("case", BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS])
def test_every_validation_error(tmp_path, case):
    name, header, data, fragment = case
    if name == "dup_metadata":
        header, fragment = b'{"__metadata__":{"k":"v","k":"w"}}', "__metadata__ key 'k' appears twice"
    path = tmp_path / f"{name}.safetensors"
    _write_image(path, header, data)
    for call in (lambda: load_file(path), lambda: list_tensors(path), lambda: _C.st_header(str(path))):
        with pytest.raises(CoreError) as ei:
            call()
        assert ei.value.code == "AC_ERR_FORMAT"
        msg = str(ei.value)
        assert fragment in msg, msg
        assert str(path) in msg, msg


@pytest.mark.parametrize("name", ["overlap", "hole", "past_end", "dup_name", "size_mismatch", "trailing_data",
                                  "not_object", "unknown_dtype"])
def test_package_rejects_the_same_files(tmp_path, name):
    """Our rules are at least as strict as the package's on these faults: it refuses them too."""
    _, header, data, _ = next(c for c in BAD_HEADERS if c[0] == name)
    path = tmp_path / "bad.safetensors"
    _write_image(path, header, data)
    with pytest.raises(Exception):
        st_pkg.load_file(str(path))


def test_length_prefix_faults(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CoreError, match="too short for the 8-byte header length") as ei:
        load_file(p)
    assert ei.value.code == "AC_ERR_FORMAT"
    p = tmp_path / "huge.safetensors"
    _write_image(p, b"{}", 0, length=200_000_000)
    with pytest.raises(CoreError, match="header length 200000000 exceeds the 100000000-byte limit"):
        load_file(p)
    p = tmp_path / "past.safetensors"
    _write_image(p, b"{}", 0, length=64)
    with pytest.raises(CoreError, match="header length 64 runs past the end of the file"):
        load_file(p)
    with pytest.raises(CoreError, match="cannot open") as ei:
        load_file(tmp_path / "missing.safetensors")
    assert ei.value.code == "AC_ERR_IO"
    with pytest.raises(CoreError, match="not a regular file"):
        list_tensors(tmp_path)


def test_truncated_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.randn(100), "b": torch.randn(100)}, path)
    raw = path.read_bytes()
    path.write_bytes(raw[:-10])
    with pytest.raises(CoreError, match="run past the end of the data region"):
        load_file(path)
