"""`accelerate-c estimate-memory`: bytes per rank to train a model with Adam under DDP and ZeRO-1/2/3.

The model is named by a Python import path, `package.module:Class` or `path/to/file.py:factory`,
built on the meta device when it allows it (no memory, no time). Counted per rank: parameters,
gradients, Adam's two fp32 states per parameter and, under 16-bit training, an fp32 master copy
of the parameters; ZeRO-1 shards the optimizer states (Adam + master copy) over the processes,
ZeRO-2 also the gradients, ZeRO-3 also the parameters (each shard rounded up, as flat shards are
padded to the world size). Activations, buffers and framework overheads are not counted.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
STRATEGIES = ("DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3")


def _fail(msg: str):
    raise SystemExit(f"accelerate-c estimate-memory: {msg}")


def load_factory(path: str):
    """The callable named by `module.path:attr` or `file.py:attr` (attr may be dotted)."""
    if ":" not in path:
        _fail(f"model path {path!r} must look like 'package.module:Class' or 'path/to/file.py:factory'")
    target, attr = path.rsplit(":", 1)
    if not target or not attr:
        _fail(f"model path {path!r} must look like 'package.module:Class' or 'path/to/file.py:factory'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would find the user's own packages
    try:
        if target.endswith(".py") or os.sep in target:
            if not os.path.isfile(target):
                _fail(f"file {target!r} does not exist")
            spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(target))[0], target)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except SystemExit:
        raise
    except Exception as e:  # noqa: BLE001 - any import error, reported with the path
        _fail(f"cannot import {target!r}: {type(e).__name__}: {e}")
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            _fail(f"{target!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        _fail(f"{path!r} is not a class or a function")
    return obj


def build_model(path: str, kwargs: dict | None = None):
    """(model, on_meta): the model built under `torch.device("meta")`, or normally when its
    constructor does not run on the meta device."""
    import torch
    from torch import nn

    factory = load_factory(path)
    kwargs = kwargs or {}
    try:
        with torch.device("meta"):
            model, on_meta = factory(**kwargs), True
    except Exception:  # noqa: BLE001 - code that needs real tensors at construction: build it normally
        try:
            model, on_meta = factory(**kwargs), False
        except Exception as e:  # noqa: BLE001
            _fail(f"cannot construct {path}: {type(e).__name__}: {e}"
                  + ("" if kwargs else " (pass its arguments as JSON with --model_kwargs)"))
    if not isinstance(model, nn.Module):
        _fail(f"{path} returned {type(model).__name__}, not a torch.nn.Module")
    return model, on_meta


def count(model) -> dict:
    """Parameter counts: total, trainable, and the largest layer (the module with the most
    parameters of its own)."""
    seen = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    largest_name, largest = "", 0
    for name, module in model.named_modules():
        n = sum(p.numel() for p in module.parameters(recurse=False))
        if n > largest:
            largest_name, largest = name or "(root)", n
    return {"params": total, "trainable": trainable, "largest_layer": largest_name, "largest_layer_params": largest}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def estimate(counts: dict, dtype: str, num_processes: int) -> dict:
    """Bytes per rank for each strategy, with the parts of each."""
    size = DTYPE_BYTES[dtype]
    P, T, n = counts["params"], counts["trainable"], num_processes
    frozen = P - T
    mixed = dtype != "float32"
    per_param_opt = 8 + (4 if mixed else 0)  # Adam m and v in fp32, plus the fp32 master copy
    out = {}
    for level, name in enumerate(STRATEGIES):
        params_b = size * (frozen + (T if level < 3 else _ceil_div(T, n)))
        grads_b = size * (T if level < 2 else _ceil_div(T, n))
        opt_b = per_param_opt * (T if level < 1 else _ceil_div(T, n))
        out[name] = {"params": params_b, "grads": grads_b, "optimizer": opt_b, "total": params_b + grads_b + opt_b}
    return out


def convert_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def table(headers: list, rows: list, title: str) -> str:
    widths = [max(len(str(r[i])) for r in rows + [headers]) + 2 for i in range(len(headers))]
    inner = sum(widths) + len(widths) - 1
    if len(title) + 2 > inner:
        widths[-1] += len(title) + 2 - inner
        inner = len(title) + 2
    line = lambda l, m, r: l + m.join("─" * w for w in widths) + r  # noqa: E731
    row = lambda cells: "│" + "│".join(str(c).center(w) for c, w in zip(cells, widths)) + "│"  # noqa: E731
    out = [line("┌", "─", "┐"), "│" + title.center(inner) + "│", line("├", "┬", "┤"), row(headers),
           line("├", "┼", "┤")]
    out += [row(r) for r in rows]
    out.append(line("└", "┴", "┘"))
    return "\n".join(out)


def run(args) -> int:
    for d in args.dtypes:
        if d not in DTYPE_BYTES:
            _fail(f"unknown dtype {d!r}; choose from {', '.join(DTYPE_BYTES)}")
    if args.num_processes < 1:
        _fail(f"--num_processes must be >= 1, got {args.num_processes}")
    try:
        kwargs = json.loads(args.model_kwargs) if args.model_kwargs else {}
    except json.JSONDecodeError as e:
        _fail(f"--model_kwargs is not valid JSON: {e}")
    if not isinstance(kwargs, dict):
        _fail("--model_kwargs must be a JSON object, such as '{\"vocab\": 64}'")
    model, on_meta = build_model(args.model_path, kwargs)
    counts = count(model)
    result = {"model": args.model_path, "num_processes": args.num_processes, "built_on_meta": on_meta, **counts,
              "dtypes": {}}
    rows = []
    for d in args.dtypes:
        est = estimate(counts, d, args.num_processes)
        layer = counts["largest_layer_params"] * DTYPE_BYTES[d]
        result["dtypes"][d] = {"largest_layer_bytes": layer, "model_bytes": counts["params"] * DTYPE_BYTES[d],
                               **{k: v for k, v in est.items()}}
        rows.append([d, convert_bytes(layer), convert_bytes(counts["params"] * DTYPE_BYTES[d]),
                     *(convert_bytes(est[s]["total"]) for s in STRATEGIES)])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    title = f"Memory per rank to train `{args.model_path}` with Adam on {args.num_processes} process(es)"
    print(table(["dtype", "Largest layer", "Model size", *STRATEGIES], rows, title))
    print(f"{counts['params']:,} parameters ({counts['trainable']:,} trainable); largest layer: "
          f"{counts['largest_layer']} ({counts['largest_layer_params']:,} parameters)"
          + ("" if on_meta else "; built on the CPU (its constructor does not run on the meta device)"))
    print("Counted: parameters + gradients + Adam states (2 x fp32 per parameter) + an fp32 master copy for "
          "16-bit dtypes; ZeRO-1 shards optimizer states, ZeRO-2 also gradients, ZeRO-3 also parameters. "
          "Activations and buffers are not included.")
    return 0


def register(sub) -> None:
    p = sub.add_parser("estimate-memory", help="Estimate the memory per rank to train a model with Adam "
                                               "(DDP, ZeRO-1/2/3).")
    p.add_argument("model_path", help="the model as an import path: 'package.module:Class', "
                                      "'package.module:factory' or 'path/to/file.py:Class'")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float16", "bfloat16"],
                   help="parameter dtypes to estimate: float32, float16, bfloat16")
    p.add_argument("--num_processes", type=int, default=1, help="data-parallel processes (ranks)")
    p.add_argument("--model_kwargs", default=None, help="constructor arguments as a JSON object")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(func=run)
