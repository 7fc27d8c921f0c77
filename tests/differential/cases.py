"""Random training configurations for the differential harness.

A case is a plain dict drawn from one integer seed, so a failing case is replayed from its seed
alone (`python tests/differential/run.py --replay SEED`). Each key is one axis; `draw` keeps the
combinations a user could write (e.g. comm hooks only with several processes). A new capability
(a sharding strategy, a collective backend) becomes a new key here and a branch in subject.py,
with its reference in reference.py.
"""
from __future__ import annotations

import random

WORLD_SIZES = (1, 2, 3)
PARAM_DTYPES = ("fp32", "bf16", "mixed")  # mixed: the middle layer in bf16, the rest fp32
MIXED_PRECISIONS = ("no", "bf16", "fp16")
CLIPS = ("none", "norm2", "norminf", "value")
COMM_HOOKS = ("no", "fp16", "bf16")
ZERO_GRADS = ("opt_none", "opt_zeros", "model", "manual_none")
SYNC_STYLES = ("accumulate", "no_sync")
OPTIMIZERS = ("sgd", "sgd_momentum", "adamw")


def draw(seed: int, world: int | None = None) -> dict:
    """The case of `seed` (for `world` processes when given, else drawn too)."""
    r = random.Random(seed)
    c: dict = {"seed": seed}
    c["world"] = world if world is not None else r.choice(WORLD_SIZES)
    c["param_dtype"] = r.choice(PARAM_DTYPES)
    c["mp"] = r.choice(MIXED_PRECISIONS)
    c["ga"] = r.randint(1, 4)
    # batches per process: often not a multiple of ga, so the loader ends mid-window
    c["batch_size"] = r.choice((2, 3, 4))
    c["batches"] = r.randint(2, 8)
    c["dataset_extra"] = r.randint(0, c["batch_size"] * c["world"] - 1)  # a ragged last batch
    c["clip"] = r.choice(CLIPS)
    c["max_norm"] = r.choice((0.05, 0.5, 100.0))  # clips hard, sometimes, never
    c["unscale_first"] = r.random() < 0.3
    c["clip_twice"] = r.random() < 0.2
    c["comm_hook"] = r.choice(COMM_HOOKS) if c["world"] > 1 else "no"
    c["tiny_buckets"] = r.random() < 0.5
    c["unused"] = r.random() < 0.25  # a layer that never takes part (find_unused_parameters)
    c["frozen"] = r.random() < 0.25
    c["zero_grad"] = r.choice(ZERO_GRADS)
    c["assign_grad"] = r.random() < 0.15  # a .grad assigned between backward and the step
    c["two_models"] = r.random() < 0.2
    c["sync_style"] = r.choice(SYNC_STYLES)
    c["optimizer"] = r.choice(OPTIMIZERS) if c["param_dtype"] == "fp32" else r.choice(OPTIMIZERS[:2])
    c["skip_first"] = r.choice((0, 0, 1, 2))
    c["epochs"] = r.choice((1, 1, 2))
    # a weight used by two reentrant-checkpointed segments: torch DDP refuses it without
    # static_graph, so one process only
    c["reentrant"] = c["world"] == 1 and r.random() < 0.2
    # non-finite values: an overflowing loss on one rank (fp16 must skip that step everywhere),
    # or a NaN gradient after backward (clipping must propagate it as torch does)
    c["overflow"] = None
    if c["mp"] == "fp16" and r.random() < 0.4:
        c["overflow"] = (r.randrange(c["world"]), r.randrange(max(1, c["batches"])))
    c["nan_grad_step"] = r.randrange(4) if (c["mp"] != "fp16" and r.random() < 0.1) else None
    c["eval"] = r.random() < 0.5
    return c


def describe(c: dict) -> str:
    """One line naming the axes that differ from the plain default."""
    keys = ("world", "param_dtype", "mp", "ga", "clip", "comm_hook", "sync_style", "zero_grad", "optimizer")
    parts = [f"{k}={c[k]}" for k in keys]
    for flag in ("unscale_first", "clip_twice", "tiny_buckets", "unused", "frozen", "assign_grad", "two_models",
                 "reentrant", "eval"):
        if c[flag]:
            parts.append(flag)
    if c["skip_first"]:
        parts.append(f"skip_first={c['skip_first']}")
    if c["overflow"] is not None:
        parts.append(f"overflow={c['overflow']}")
    if c["nan_grad_step"] is not None:
        parts.append(f"nan_grad_step={c['nan_grad_step']}")
    return " ".join(parts)
