"""Regenerates the seed corpus of tests/c/fuzz_safetensors.c (tests/c/corpus/safetensors/).

Seeds use the fuzz target's input format: byte 0 odd = a whole file image; byte 0 even = a
2-byte little-endian data-region size followed by the JSON header. Run from the repository root
with the venv's python (needs torch and, for the package-written seeds, safetensors)."""
import json
import os
import struct
import tempfile

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors")


def header_seed(obj_or_text, data_size):
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text, separators=(",", ":"))
    return b"\x00" + struct.pack("<H", data_size) + text.encode()


def file_seed(image):
    return b"\x01" + image


def main():
    os.makedirs(HERE, exist_ok=True)
    seeds = {
        "empty": header_seed("{}", 0),
        "padded": header_seed('{"__metadata__":{"format":"pt"}}      ', 0),
        "one_f32": header_seed({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, 24),
        "mixed": header_seed({
            "__metadata__": {"format": "pt", "note": "x\"y\\z\u00e9"},
            "a": {"dtype": "BF16", "shape": [4], "data_offsets": [8, 16]},
            "b": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]},
            "c": {"dtype": "BOOL", "shape": [0, 3], "data_offsets": [16, 16]},
            "d\u00e9\U0001F600": {"dtype": "U8", "shape": [], "data_offsets": [16, 17]},
        }, 17),
        "escapes": header_seed('{"\\u00e9\\ud83d\\ude00\\n\\t\\"":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}}', 1),
        "whitespace": header_seed('{ "w" : { "dtype" : "F16" , "shape" : [ 1 , 2 ] , "data_offsets" : [ 0 , 4 ] } }\n', 4),
        "overlap": header_seed({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12),
        "hole": header_seed({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}}, 12),
        "big_shape": header_seed({"a": {"dtype": "F64", "shape": [4294967296, 4294967296], "data_offsets": [0, 8]}}, 8),
    }
    # whole files written by the safetensors package and by hand
    try:
        import torch
        from safetensors.torch import save_file
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.safetensors")
            save_file({"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
                       "m": torch.tensor([True, False]), "i": torch.tensor([1, 2], dtype=torch.int16)},
                      p, metadata={"format": "pt"})
            with open(p, "rb") as f:
                seeds["package_file"] = file_seed(f.read())
    except ImportError:
        pass
    hdr = b'{"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}'
    seeds["raw_file"] = file_seed(struct.pack("<Q", len(hdr)) + hdr + b"abc")
    seeds["raw_short"] = file_seed(b"\x10\x00\x00")
    seeds["raw_huge_len"] = file_seed(struct.pack("<Q", 2**63) + b"{}")
    for name, data in seeds.items():
        with open(os.path.join(HERE, name), "wb") as f:
            f.write(data)
    with open(os.path.join(os.path.dirname(HERE), "safetensors.dict"), "w") as f:
        f.write("# libFuzzer dictionary for fuzz_safetensors\n")
        toks = ['"dtype"', '"shape"', '"data_offsets"', '"__metadata__"', '"format"', '"pt"', '"F32"', '"F16"',
                '"BF16"', '"F64"', '"I64"', '"I32"', '"I16"', '"I8"', '"U8"', '"BOOL"', '"F8_E4M3"', '"C64"',
                '"U64"', '"F4"', "[0,0]", "[]", "{}", ":", ",", "\\u0000", "\\ud83d", "\\udc00",
                "18446744073709551615", "9223372036854775807", "4294967296", "-1", "1.5", "1e3", "00"]
        for i, t in enumerate(toks):
            esc = t.replace("\\", "\\\\").replace('"', '\\"')
            f.write(f'kw{i}="{esc}"\n')


if __name__ == "__main__":
    main()
