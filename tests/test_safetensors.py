"""The C safetensors engine through accelerate_c.safetensors_io and accelerate_c.model_io:
roundtrips of every dtype against the tensors themselves, compatibility both ways with the
`safetensors` package, one crafted file per validation rule, atomic writes under injected
failures, the O_DIRECT write path (ACCELERATE_C_DIRECT_IO), and Hugging Face sharded
checkpoints (index, tied weights, stale shards)."""
import ctypes
import json
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import safetensors
import safetensors.torch as st_pkg

from accelerate_c import CoreError, _C
from accelerate_c import model_io
from accelerate_c.model_io import load_model_weights, parse_size, save_model
from accelerate_c.safetensors_io import DTYPES, list_tensors, load_file, load_into, read_metadata, save_file
from timeouts import wait_s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bits(t):
    """Bitwise view (NaN payloads, -0.0 and bool bytes compare exactly)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _random(dtype, shape, gen):
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _listdir(d):
    return sorted(os.listdir(d))


# ---- roundtrips and compatibility --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_roundtrip_every_dtype(tmp_path, name):
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(1)
    tensors = {f"{name}_{i}": _random(dtype, shape, gen)
               for i, shape in enumerate([(), (0,), (7,), (3, 5), (2, 3, 4), (1, 1000)])}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert list(back) == sorted(back, key=lambda k: list_tensors(path)[k].data_offsets)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(_bits(back[k]), _bits(t)), k
    infos = list_tensors(path)
    assert {i.dtype for i in infos.values()} == {name}
    assert read_metadata(path) == {"format": "pt"}
    # the safetensors package reads the same file
    pkg = st_pkg.load_file(str(path))
    for k, t in tensors.items():
        assert pkg[k].dtype == t.dtype and torch.equal(_bits(pkg[k]), _bits(t)), k
    assert _listdir(tmp_path) == ["x.safetensors"]


def test_package_files_load_here_and_ours_there(tmp_path):
    gen = torch.Generator().manual_seed(2)
    tensors = {
        "embed.weight": torch.randn(50, 16, generator=gen),
        "layer.0.bias": torch.randn(16, generator=gen).to(torch.bfloat16),
        "layer.0.mask": torch.rand(4, 4, generator=gen) > 0.5,
        "step": torch.tensor(12345678901, dtype=torch.int64),
        "half": torch.randn(3, 3, generator=gen).half(),
        "i8": torch.randint(-128, 127, (9,), dtype=torch.int8, generator=gen),
        "unicode é 😀 \"q\"": torch.arange(4, dtype=torch.int32),
    }
    meta = {"format": "pt", "note": 'with "quotes", \\ and é'}
    theirs = tmp_path / "theirs.safetensors"
    st_pkg.save_file(tensors, str(theirs), metadata=meta)
    ours = tmp_path / "ours.safetensors"
    save_file(tensors, ours, metadata=meta)
    for src in (theirs, ours):
        mine = load_file(src)
        pkg = st_pkg.load_file(str(src))
        assert set(mine) == set(pkg) == set(tensors)
        for k, t in tensors.items():
            assert torch.equal(mine[k], t) and torch.equal(pkg[k], t), (src.name, k)
        assert read_metadata(src) == meta
        with safetensors.safe_open(str(src), framework="pt") as f:
            assert f.metadata() == meta
            assert set(f.keys()) == set(tensors)
    # same header entries (dtype, shape, data size) whoever wrote the file
    a, b = list_tensors(theirs), list_tensors(ours)
    assert {k: (v.dtype, v.shape, v.data_offsets[1] - v.data_offsets[0]) for k, v in a.items()} == \
           {k: (v.dtype, v.shape, v.data_offsets[1] - v.data_offsets[0]) for k, v in b.items()}


def test_byte_identical_to_package(tmp_path):
    """Same layout rule (element size descending, then name), same JSON spelling and padding:
    the two writers produce the same bytes."""
    gen = torch.Generator().manual_seed(5)
    tensors = {"b": torch.ones(3, dtype=torch.uint8), "a": torch.randn(5, generator=gen).double(),
               "c": torch.ones(3).half(), "d": torch.randn(2, 2, generator=gen), "scalar": torch.tensor(1.5),
               "empty": torch.zeros(0, 4), "ctl\x01\x7f\b\f\n\t\r\"\\ é 😀": torch.arange(3)}
    # one metadata key at most: the package writes __metadata__ in hash-map order, which varies
    for meta in (None, {"format": "pt"}, {"k\n": "v\x02\"é"}):
        ours, theirs = tmp_path / "o.safetensors", tmp_path / "t.safetensors"
        save_file(tensors, ours, metadata=meta)
        st_pkg.save_file(tensors, str(theirs), metadata=meta)
        assert ours.read_bytes() == theirs.read_bytes()


def test_layout_is_aligned_and_header_padded(tmp_path):
    tensors = {"b": torch.ones(3, dtype=torch.uint8), "a": torch.ones(5, dtype=torch.float64),
               "c": torch.ones(3, dtype=torch.float16), "d": torch.ones(1, dtype=torch.int32)}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and raw[8:9] == b"{" and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    hdr = json.loads(raw[8:8 + n])
    assert "__metadata__" not in hdr  # metadata=None writes none, as the package does
    for k, v in hdr.items():
        size = tensors[k].element_size()
        assert (8 + n + v["data_offsets"][0]) % size == 0, k
    assert _C.st_header(str(path))["data_start"] == 8 + n


def test_non_contiguous_grad_and_views(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    p = torch.nn.Parameter(torch.randn(3, 3))
    tensors = {"t": base.t(), "slice": base[1:3, 2:5], "param": p, "off": base.view(-1)[5:9]}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path)
    back = st_pkg.load_file(str(path))
    for k, t in tensors.items():
        assert torch.equal(back[k], t.detach().contiguous()), k


def test_load_into_in_place_and_staged(tmp_path):
    gen = torch.Generator().manual_seed(3)
    src = {"a": torch.randn(4, 5, generator=gen), "b": torch.randn(6, generator=gen).double(),
           "c": torch.randint(0, 9, (2, 2), generator=gen)}
    path = tmp_path / "x.safetensors"
    save_file(src, path)
    a = torch.zeros(4, 5)
    ptr = a.data_ptr()
    b = torch.zeros(6, dtype=torch.float32)  # other dtype: staged then cast by copy_
    c = torch.zeros(2, 2, dtype=torch.int64).t()  # non-contiguous: staged
    load_into(path, {"a": a, "b": b, "c": c})
    assert a.data_ptr() == ptr and torch.equal(a, src["a"])
    assert torch.equal(b, src["b"].float())
    assert torch.equal(c, src["c"])
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \[4, 5\] in the file but \[5, 4\]"):
        load_into(path, {"a": torch.zeros(5, 4)})
    with pytest.raises(KeyError, match="'nope'"):
        load_into(path, {"nope": torch.zeros(1)})
    with pytest.raises(KeyError):
        _C.st_load_into(str(path), {"nope": torch.zeros(1)}, 0)
    with pytest.raises(ValueError, match="tensor 'a' in the file is F32"):
        _C.st_load_into(str(path), {"a": torch.zeros(4, 5, dtype=torch.float64)}, 0)
    # a subset read with several threads
    out = {"c": torch.empty(2, 2, dtype=torch.int64)}
    _C.st_load_into(str(path), out, 4)
    assert torch.equal(out["c"], src["c"])


def test_big_tensors_many_threads(tmp_path):
    gen = torch.Generator().manual_seed(4)
    tensors = {f"w{i}": torch.randn(3 << 20, generator=gen) for i in range(3)}  # 3 x 12 MiB
    tensors.update({f"s{i}": torch.randn(17, generator=gen) for i in range(200)})
    path = tmp_path / "big.safetensors"
    for threads in (1, 3, 8):
        save_file(tensors, path, threads=threads)
        back = load_file(path, threads=threads)
        assert all(torch.equal(back[k], v) for k, v in tensors.items())
    pkg = st_pkg.load_file(str(path))
    assert all(torch.equal(pkg[k], v) for k, v in tensors.items())


def test_argument_errors(tmp_path):
    path = tmp_path / "x.safetensors"
    with pytest.raises(TypeError, match="names must be str"):
        save_file({1: torch.zeros(1)}, path)
    with pytest.raises(TypeError, match="metadata must map str to str"):
        save_file({"a": torch.zeros(1)}, path, metadata={"a": 1})
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        save_file({"a": [1, 2]}, path)
    with pytest.raises(CoreError, match="'__metadata__' is reserved"):
        save_file({"__metadata__": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="NUL"):
        save_file({"a\0b": torch.zeros(1)}, path)
    with pytest.raises(ValueError, match="threads"):
        save_file({"a": torch.zeros(1)}, path, threads=-1)
    assert _listdir(tmp_path) == []


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


# ---- atomic writes -------------------------------------------------------------------------------

class _BadExport:
    def __dlpack__(self, *a, **k):
        raise RuntimeError("export failed on purpose")


def test_failed_export_leaves_old_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    # the producer's error, under the name of the tensor that failed (the kernels' DLPack rule)
    with pytest.raises(TypeError, match="'b': cannot export the tensor through DLPack: export failed on purpose"):
        _C.st_save(str(path), ["a", "b"], [torch.zeros(4), _BadExport()], None, 0)
    assert path.read_bytes() == before
    assert _listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.parametrize("direct_io,mode", [("0", "buffered"), ("1", "direct"), ("auto", "direct")])
def test_failed_write_midway_leaves_old_file_and_no_temp(tmp_path, direct_io, mode):
    """A file-size limit makes pwrite fail with EFBIG in the middle of the data region (in a
    child process, so the limit does not touch pytest); through the page cache and with O_DIRECT
    (which "auto" picks for this 16 MiB file)."""
    if mode == "direct":
        _need_o_direct(tmp_path)
    path = tmp_path / "x.safetensors"
    save_file({"old": torch.ones(3)}, path)
    before = path.read_bytes()
    script = textwrap.dedent(f"""
        import resource, signal, torch
        from accelerate_c import CoreError, _C
        from accelerate_c.safetensors_io import save_file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        try:
            save_file({{"big": torch.ones(4 << 20)}}, {str(path)!r}, threads=4)
        except CoreError as e:
            print("ERR", e.code, e)
        print("MODE", _C.st_last_write_mode())
    """)
    env = dict(os.environ, ACCELERATE_C_DIRECT_IO=direct_io)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=wait_s(120), env=env)
    assert "ERR AC_ERR_IO" in out.stdout, out.stdout + out.stderr
    assert "writing tensor 'big'" in out.stdout and "File too large" in out.stdout
    assert f"MODE {mode}" in out.stdout, out.stdout
    assert path.read_bytes() == before
    assert _listdir(tmp_path) == ["x.safetensors"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o555)
    try:
        with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
            save_file({"a": torch.zeros(2)}, d / "x.safetensors")
        assert ei.value.code == "AC_ERR_IO"
        assert _listdir(d) == []
    finally:
        d.chmod(0o755)


def test_missing_directory(tmp_path):
    with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
        save_file({"a": torch.zeros(2)}, tmp_path / "no" / "x.safetensors")
    assert ei.value.code == "AC_ERR_IO"


# ---- the O_DIRECT write path (ACCELERATE_C_DIRECT_IO) -------------------------------------------

DIRECT_ENV = "ACCELERATE_C_DIRECT_IO"
DIRECT_MIN = 4 << 20  # ST_DIRECT_MIN_BYTES in csrc/core/st_write.c: "auto" goes direct from here


def _need_o_direct(directory):
    """Skips the test if the file system of `directory` refuses O_DIRECT (tmpfs before Linux 6.6,
    some FUSE file systems); our writer would then fall back to buffered writes."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        pytest.skip("this platform has no O_DIRECT")
    probe = os.path.join(directory, ".o_direct_probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
    except OSError as e:
        if os.path.exists(probe):
            os.unlink(probe)
        pytest.skip(f"the file system of {directory} refuses O_DIRECT: {e}")
    try:
        os.write(fd, mmap.mmap(-1, 4096))  # an anonymous map is page-aligned
    except OSError as e:
        pytest.skip(f"the file system of {directory} refuses O_DIRECT writes: {e}")
    finally:
        os.close(fd)
        os.unlink(probe)


def _checkpoint_like(gen):
    """Tensors that cross the 8 MiB chunk boundaries at odd offsets, of several dtypes, with
    zero-size ones and a scalar, in a file whose size is not a multiple of 4096."""
    return {
        "embed.weight": torch.randn(3 << 20, generator=gen),  # 12 MiB: crosses a chunk boundary
        "head.weight": torch.randn(1000, 1001, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(9 << 20, generator=gen) > 0.5,  # 9 MiB of bool: crosses the next one
        "odd": _random(torch.uint8, (4097,), gen),
        "norm.bias": torch.randn(17, generator=gen).double(),
        "empty": torch.zeros(0, 3),
        "step": torch.tensor(7, dtype=torch.int64),
        "f8": _random(torch.float8_e4m3fn, (333,), gen),
    }


def test_direct_io_forced_writes_the_same_bytes(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    gen = torch.Generator().manual_seed(11)
    tensors = _checkpoint_like(gen)
    meta = {"format": "pt"}
    path = tmp_path / "d.safetensors"
    monkeypatch.setenv(DIRECT_ENV, "1")
    for threads in (0, 1, 3):
        save_file(tensors, path, metadata=meta, threads=threads)
        assert _C.st_last_write_mode() == "direct"
        # the reference: the safetensors package's bytes for the same tensors
        assert path.read_bytes() == st_pkg.save(tensors, metadata=meta), threads
    assert os.path.getsize(path) % 4096 != 0  # the padding of the last chunk was cut off
    for loaded in (st_pkg.load_file(str(path)), load_file(path)):
        assert set(loaded) == set(tensors)
        for k, t in tensors.items():
            assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape
            assert torch.equal(_bits(loaded[k]), _bits(t)), k
    assert read_metadata(path) == meta
    # a file smaller than one 4096-byte block, and one with no tensors at all
    for small in ({"x": torch.arange(5)}, {}):
        save_file(small, path)
        assert _C.st_last_write_mode() == "direct"
        assert path.read_bytes() == st_pkg.save(small)
    assert _listdir(tmp_path) == ["d.safetensors"]


def test_direct_io_off_and_auto(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    gen = torch.Generator().manual_seed(12)
    big = {"w": torch.randn((DIRECT_MIN // 4) + 1, generator=gen)}  # just above the threshold
    small = {"w": torch.randn(1000, generator=gen)}
    path = tmp_path / "x.safetensors"
    cases = [("0", big, "buffered"), ("0", small, "buffered"), ("auto", big, "direct"), ("auto", small, "buffered"),
             (None, big, "direct"), (None, small, "buffered"), ("", big, "direct"), ("1", small, "direct")]
    for value, tensors, mode in cases:
        if value is None:
            monkeypatch.delenv(DIRECT_ENV, raising=False)
        else:
            monkeypatch.setenv(DIRECT_ENV, value)
        save_file(tensors, path)
        assert _C.st_last_write_mode() == mode, (value, len(tensors["w"]))
        assert path.read_bytes() == st_pkg.save(tensors)
    assert _listdir(tmp_path) == ["x.safetensors"]


def test_direct_io_bad_value(tmp_path, monkeypatch):
    path = tmp_path / "x.safetensors"
    for value in ("yes", "2", "true", " 1"):
        monkeypatch.setenv(DIRECT_ENV, value)
        with pytest.raises(CoreError, match=f"invalid value '{value}' of the environment variable {DIRECT_ENV}") as ei:
            save_file({"a": torch.zeros(2)}, path)
        assert ei.value.code == "AC_ERR_INVALID_ARG"
        assert "x.safetensors" in str(ei.value) and "use auto" in str(ei.value)
        assert _C.st_last_write_mode() == "none"
    assert _listdir(tmp_path) == []


def test_direct_io_failures_leave_nothing(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "1")
    with pytest.raises(CoreError, match="cannot create the temporary file") as ei:
        save_file({"a": torch.zeros(2)}, tmp_path / "no" / "x.safetensors")
    assert ei.value.code == "AC_ERR_IO"
    assert _C.st_last_write_mode() == "none"
    # a target that is a directory: the data is written (directly) to the temp file, the rename fails
    (tmp_path / "d.safetensors").mkdir()
    with pytest.raises(CoreError, match="renaming .*d.safetensors.*tmp into place failed") as ei:
        save_file({"a": torch.zeros(DIRECT_MIN)}, tmp_path / "d.safetensors")
    assert ei.value.code == "AC_ERR_IO"
    assert _C.st_last_write_mode() == "direct"
    assert _listdir(tmp_path) == ["d.safetensors"] and _listdir(tmp_path / "d.safetensors") == []


def test_direct_io_mode_is_per_thread(tmp_path, monkeypatch):
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "auto")
    save_file({"w": torch.zeros(DIRECT_MIN)}, tmp_path / "a.safetensors")
    seen = []

    def other():
        seen.append(_C.st_last_write_mode())
        save_file({"w": torch.zeros(10)}, tmp_path / "b.safetensors")
        seen.append(_C.st_last_write_mode())

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == ["none", "buffered"]
    assert _C.st_last_write_mode() == "direct"


def test_direct_io_releases_the_gil(tmp_path, monkeypatch):
    """The main thread keeps running Python while another thread's direct save is in the C writer."""
    _need_o_direct(tmp_path)
    monkeypatch.setenv(DIRECT_ENV, "1")
    # 256 MiB: a save of ~100 ms even on a 2.5 GB/s disk, so the main thread has many 1 ms
    # sleeps to take while the writer runs; with the GIL held it would take at most the one or
    # two before the writer enters C
    tensors = {"w": torch.zeros(256 << 20, dtype=torch.uint8)}
    started, ticks = threading.Event(), []

    def save():
        started.set()
        save_file(tensors, tmp_path / "g.safetensors", threads=1)

    t = threading.Thread(target=save)
    t.start()
    started.wait()
    while t.is_alive():
        ticks.append(1)
        time.sleep(0.001)
    t.join()
    assert len(ticks) > 3
    assert (tmp_path / "g.safetensors").stat().st_size > 256 << 20


# ---- save_model / load_model_weights ---------------------------------------------------------------

class TinyLM(torch.nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(4)])
        self.norm = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.register_buffer("steps", torch.tensor(7, dtype=torch.int64))
        if tie:
            self.head.weight = self.embed.weight


def _state_equal(a, b):
    assert set(a) == set(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("size,want", [
    (1234, 1234), ("10GB", 10 * 10**9), ("5GiB", 5 * 2**30), ("500MB", 500 * 10**6), ("100KB", 100_000),
    ("3MiB", 3 * 2**20), ("5Gb", 5 * 10**9 // 8), ("1.5GB", 1_500_000_000), ("2kb", 250), (" 7 MB ", 7_000_000),
])
def test_parse_size(size, want):
    assert parse_size(size) == want


@pytest.mark.parametrize("size", ["ten", "5XB", "-1MB", 0, -5, "0GB", "GB", 1.5, True])
def test_parse_size_rejects(size):
    with pytest.raises(ValueError):
        parse_size(size)


def test_save_model_sharded_loads_with_package(tmp_path):
    torch.manual_seed(0)
    model = TinyLM(tie=True)
    sd = model.state_dict()
    files = save_model(model, tmp_path, max_shard_size="10KB")
    n = len(files) - 1
    assert n > 1 and files[-1] == "model.safetensors.index.json"
    assert files[:-1] == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert _listdir(tmp_path) == sorted(files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index) == {"metadata", "weight_map"}
    saved_names = set(sd) - {"head.weight"}  # the tied alias is saved once, under its first name
    assert set(index["weight_map"]) == saved_names
    assert index["metadata"]["total_size"] == sum(sd[k].numel() * sd[k].element_size() for k in saved_names)
    merged = {}
    for f in files[:-1]:
        part = st_pkg.load_file(str(tmp_path / f))
        assert all(index["weight_map"][k] == f for k in part)
        with safetensors.safe_open(str(tmp_path / f), framework="pt") as h:
            assert h.metadata() == {"format": "pt"}
        size = sum(t.numel() * t.element_size() for t in part.values())
        assert size <= 10_000 or len(part) == 1
        merged.update(part)
    _state_equal(merged, {k: sd[k] for k in saved_names})

    fresh = TinyLM(tie=True)
    res = load_model_weights(fresh, tmp_path)
    assert res.missing_keys == [] and res.unexpected_keys == []
    _state_equal(fresh.state_dict(), sd)
    assert fresh.head.weight.data_ptr() == fresh.embed.weight.data_ptr()


def test_save_model_single_file_and_transformers_names(tmp_path):
    model = TinyLM(tie=False)
    assert save_model(model, tmp_path) == ["model.safetensors"]
    assert _listdir(tmp_path) == ["model.safetensors"]
    _state_equal(st_pkg.load_file(str(tmp_path / "model.safetensors")), model.state_dict())
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())


def test_tied_and_distinct_views(tmp_path):
    flat = torch.arange(10, dtype=torch.float32)
    sd = {"first": flat[:5], "second": flat[5:], "again": flat[:5], "whole": flat}
    save_model(sd, tmp_path)
    back = st_pkg.load_file(str(tmp_path / "model.safetensors"))
    # identical views are saved once (first name kept); distinct views of one storage are all saved
    assert set(back) == {"first", "second", "whole"}
    for k in back:
        assert torch.equal(back[k], sd[k])


def test_stale_shards_removed_after_new_save(tmp_path):
    model = TinyLM(tie=False)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-notes.txt").write_text("keep me")
    many = save_model(model, tmp_path, max_shard_size="5KB")
    assert len(many) > 3
    one = save_model(model, tmp_path, max_shard_size="1GB")
    assert _listdir(tmp_path) == sorted(["config.json", "model-notes.txt", "model.safetensors"])
    two = save_model(model, tmp_path, max_shard_size=parse_size("20KB"))
    assert len(two) >= 3
    assert _listdir(tmp_path) == sorted(["config.json", "model-notes.txt"] + two)
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())
    assert one == ["model.safetensors"]


def test_failed_save_model_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = TinyLM(tie=False)
    save_model(model, tmp_path, max_shard_size="8KB")
    before = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    calls = {"n": 0}
    real = model_io.save_file

    def flaky(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(model_io, "save_file", flaky)
    other = TinyLM(tie=False)
    with pytest.raises(OSError, match="simulated"):
        save_model(other, tmp_path, max_shard_size="8KB")
    after = {f: (tmp_path / f).read_bytes() for f in os.listdir(tmp_path)}
    assert after == before  # no temp file left, every old file byte-identical


def test_load_model_weights_strict_errors(tmp_path):
    model = TinyLM(tie=False)
    sd = model.state_dict()
    partial = {k: v for k, v in sd.items() if k != "norm.bias"}
    partial["extra.weight"] = torch.zeros(2)
    save_model(partial, tmp_path)
    fresh = TinyLM(tie=False)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"missing keys: norm\.bias; unexpected keys: extra\.weight"):
        load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), before)  # nothing was loaded
    res = load_model_weights(fresh, tmp_path, strict=False)
    assert res.missing_keys == ["norm.bias"] and res.unexpected_keys == ["extra.weight"]
    assert torch.equal(fresh.blocks[0].weight, sd["blocks.0.weight"])
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_model_weights(fresh, tmp_path / "empty")


def test_index_with_missing_shard(tmp_path):
    model = TinyLM(tie=False)
    files = save_model(model, tmp_path, max_shard_size="10KB")
    os.unlink(tmp_path / files[0])
    with pytest.raises(FileNotFoundError, match=files[0]):
        load_model_weights(TinyLM(tie=False), tmp_path)


def test_save_model_torch_format(tmp_path):
    model = TinyLM(tie=False)
    files = save_model(model, tmp_path, max_shard_size="10KB", safe_serialization=False)
    assert files[-1] == "pytorch_model.bin.index.json" and files[0].startswith("pytorch_model-00001-of-")
    merged = {}
    for f in files[:-1]:
        merged.update(torch.load(tmp_path / f, weights_only=True))
    _state_equal(merged, model.state_dict())
    fresh = TinyLM(tie=False)
    load_model_weights(fresh, tmp_path)
    _state_equal(fresh.state_dict(), model.state_dict())
    with pytest.raises(ValueError, match="should be a directory"):
        save_model(model, tmp_path / files[0])


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
    assert _listdir(tmp_path) == []
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
    assert sorted(_listdir(tmp_path)) == ["c.safetensors", "d.safetensors", "ref.safetensors"]


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
    assert _listdir(tmp_path) == ["g.safetensors"]


def test_cuda_dlpack_tensor_refused_as_load_target(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.zeros(5)}, path)
    with pytest.raises(ValueError, match="'w' is on DLPack device type 2; copy it to the CPU first"):
        _C.st_load_into(str(path), {"w": _as_cuda_capsule(torch.zeros(5))}, 0)
