"""The C safetensors engine through accelerate_c.safetensors_io: roundtrips of every dtype
against the tensors themselves, compatibility both ways with the `safetensors` package (the
same bytes, the same layout rule), views and parameters, load_into in place and staged, big
tensors on many threads, and argument errors."""
import json
import struct

import pytest
import torch

import safetensors
import safetensors.torch as st_pkg

from accelerate_c import CoreError, _C
from accelerate_c.safetensors_io import DTYPES, list_tensors, load_file, load_into, read_metadata, save_file

from safetensors_helpers import as_bytes, random_tensor, sorted_listdir


# ---- roundtrips and compatibility --------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DTYPES))
def test_roundtrip_every_dtype(tmp_path, name):
    dtype = DTYPES[name]
    gen = torch.Generator().manual_seed(1)
    tensors = {f"{name}_{i}": random_tensor(dtype, shape, gen)
               for i, shape in enumerate([(), (0,), (7,), (3, 5), (2, 3, 4), (1, 1000)])}
    path = tmp_path / "x.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    back = load_file(path)
    assert list(back) == sorted(back, key=lambda k: list_tensors(path)[k].data_offsets)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape
        assert torch.equal(as_bytes(back[k]), as_bytes(t)), k
    infos = list_tensors(path)
    assert {i.dtype for i in infos.values()} == {name}
    assert read_metadata(path) == {"format": "pt"}
    # the safetensors package reads the same file
    pkg = st_pkg.load_file(str(path))
    for k, t in tensors.items():
        assert pkg[k].dtype == t.dtype and torch.equal(as_bytes(pkg[k]), as_bytes(t)), k
    assert sorted_listdir(tmp_path) == ["x.safetensors"]


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
    assert sorted_listdir(tmp_path) == []
