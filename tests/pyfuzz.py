"""The Python fuzz targets (docs/security.md): structured inputs from hypothesis strategies, each
run through the code that reads it, with the outcome checked. Shared by the short, derandomized
runs of tests/test_fuzz_inputs.py (make test) and the long runs of tests/fuzz/run_py.py.

Every target accepts exactly two outcomes: the input is taken (and then what was taken is
checked where a reference exists), or an exception of the documented type whose message names
the file or key at fault. Any other exception, a hang (SIGALRM), a pickle load, a read of a file
outside the checkpoint directory or a state changed by a failed load is a finding: the check
raises AssertionError (hypothesis then shrinks the input).
"""
from __future__ import annotations

import atexit
import functools
import json
import os
import random
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager

import numpy as np
import torch
import yaml
from hypothesis import strategies as st

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

COUNTS: dict = {}  # target -> examples run (tests/fuzz/run_py.py reports them)


def count(target: str) -> None:
    COUNTS[target] = COUNTS.get(target, 0) + 1


@contextmanager
def time_limit(seconds: int, what: str):
    """A hang is a finding: SIGALRM turns one into an AssertionError naming the input's target."""
    def fire(signum, frame):
        raise AssertionError(f"{what}: no answer within {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---- values ---------------------------------------------------------------------------------------
_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.sampled_from([0, 1, -1, 2, 3, 8, 1 << 31, 1 << 63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["auto", "none", "cpu", "nvme", "no", "fp16", "bf16", "NO", "MULTI_GPU", "DEEPSPEED", "true",
                     "1", "5e-5", "", "../x", "/etc/passwd", "\x00", "\ud7ff"]),
)
values = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)


def _text_of(data, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data, allow_nan=True)
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except yaml.YAMLError:
        return json.dumps(data, allow_nan=True)


def _keys_of(obj, out=None) -> set:
    """Every key (at any depth) and every string value of a decoded document: an error message
    names one of them, or the file."""
    out = set() if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(str(k))
            _keys_of(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _keys_of(v, out)
    return out


def _names_something(msg: str, path: str, data) -> bool:
    if path in msg or os.path.basename(path) in msg:
        return True
    return any(k and k in msg for k in _keys_of(data))


# ---- config files (accelerate_c.utils.config) -----------------------------------------------------
def _config_keys():
    from accelerate_c.utils import config_schema as cs

    top, nested = [], {}
    for name, obj in vars(cs).items():
        if isinstance(obj, dict) and obj and all(type(v).__name__ == "Key" for v in obj.values()):
            for k, key in obj.items():
                top.append(k)
                if getattr(key, "sub", None):
                    nested[k] = list(key.sub)
    return sorted(set(top)), nested


_CFG_TOP, _CFG_NESTED = None, None


@st.composite
def config_docs(draw):
    global _CFG_TOP, _CFG_NESTED
    if _CFG_TOP is None:
        _CFG_TOP, _CFG_NESTED = _config_keys()
    doc = {}
    if draw(st.booleans()):
        doc["distributed_type"] = draw(st.sampled_from(["NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP", "TPU"]))
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.sampled_from(_CFG_TOP + ["not_a_key", "fp16", "dynamo_backend"]))
        if key in _CFG_NESTED and draw(st.booleans()):
            sub = draw(st.dictionaries(st.sampled_from(_CFG_NESTED[key] + ["bogus"]), values, max_size=4))
            doc[key] = sub
        else:
            doc[key] = draw(values)
    return doc


def check_config(doc, fmt: str, tmpdir: str) -> None:
    """A config file: validated (and then written and read back the same), or ConfigError naming
    the file and, for a bad value, the key."""
    from accelerate_c.utils.config import ConfigError, load_config_from_file, to_file_dict, validate, write_config_file

    count("config")
    path = os.path.join(tmpdir, f"cfg.{fmt}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(_text_of(doc, fmt))
    with time_limit(20, "config"):
        try:
            cfg = load_config_from_file(path)
        except ConfigError as e:
            assert path in str(e), f"ConfigError without the file: {e}"
            return
        except Exception as e:  # noqa: BLE001 - anything else is the finding
            raise AssertionError(f"config {fmt} {doc!r}: {type(e).__name__}: {e}") from e
        # what was accepted writes and reads back the same
        again = os.path.join(tmpdir, f"again.{fmt}")
        if os.path.exists(again):
            os.unlink(again)
        write_config_file(dict(cfg.values), again, as_json=(fmt == "json"))
        back = load_config_from_file(again)
        # the writer leaves nulls out, as accelerate does (a nullable key then reads as its
        # default, which the launcher treats the same): compare with that, not the raw values
        want = validate(to_file_dict(cfg.values), again)
        assert back.values == want, f"round trip changed the config: {want!r} -> {back.values!r}"


def check_config_bytes(raw: bytes, fmt: str, tmpdir: str) -> None:
    """Arbitrary bytes as a config file: ConfigError naming the file, or a valid config."""
    from accelerate_c.utils.config import ConfigError, load_config_from_file

    count("config_bytes")
    path = os.path.join(tmpdir, f"raw.{fmt}")
    with open(path, "wb") as f:
        f.write(raw)
    with time_limit(20, "config bytes"):
        try:
            load_config_from_file(path)
        except ConfigError as e:
            assert path in str(e), f"ConfigError without the file: {e}"
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"config bytes {raw!r}: {type(e).__name__}: {e}") from e


# ---- DeepSpeed JSON (accelerate_c.deepspeed_config) -----------------------------------------------
_DS_PATHS = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "zero_allow_untested_optimizer",
             "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window",
             "fp16.hysteresis", "fp16.min_loss_scale", "bf16.enabled", "zero_optimization.stage",
             "zero_optimization.reduce_bucket_size", "zero_optimization.allgather_bucket_size",
             "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
             "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param.device",
             "zero_optimization.round_robin_gradients", "zero_optimization.stage3_prefetch_bucket_size",
             "optimizer.type", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
             "optimizer.params.weight_decay", "scheduler.type", "scheduler.params.warmup_num_steps",
             "scheduler.params.warmup_max_lr", "scheduler.params.total_num_steps", "aio.block_size",
             "tensorboard.enabled", "flops_profiler.enabled", "amp.enabled", "pipeline.stages", "bogus.key"]


@st.composite
def deepspeed_docs(draw):
    doc: dict = {}
    if draw(st.integers(0, 9)):
        doc["zero_optimization"] = {"stage": draw(st.sampled_from([0, 1, 2, 3, "auto", "2", None, -1, 4]))}
    for _ in range(draw(st.integers(0, 8))):
        path = draw(st.sampled_from(_DS_PATHS)).split(".")
        value = draw(st.one_of(values, st.just("auto")))
        node = doc
        for p in path[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[path[-1]] = value
    return doc


def check_deepspeed(doc, tmpdir: str, mixed_precision: str = "no", num_processes: int = 1) -> None:
    """A DeepSpeed JSON file through what the Accelerator does with it: a ShardingConfig, or a
    ValueError / TypeError / NotImplementedError naming the file or a key of the config."""
    from accelerate_c.deepspeed_config import DeepSpeedPlugin
    from accelerate_c.deepspeed_config.sharding import sharding_from_config

    count("deepspeed")
    path = os.path.join(tmpdir, "ds_config.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(doc, allow_nan=True))
    with time_limit(20, "deepspeed"):
        try:
            plugin = DeepSpeedPlugin(hf_ds_config=path)
            sharding_from_config(plugin, mixed_precision=mixed_precision, num_processes=num_processes)
        except (ValueError, TypeError, NotImplementedError) as e:
            assert _names_something(str(e), path, doc), f"error names neither the file nor a key: {e}"
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"deepspeed {doc!r}: {type(e).__name__}: {e}") from e


# ---- TrainingArguments dicts ----------------------------------------------------------------------
_TA_FIELDS = None


@st.composite
def training_args_docs(draw):
    global _TA_FIELDS
    if _TA_FIELDS is None:
        from dataclasses import fields

        from accelerate_c.training_args import TrainingArguments

        _TA_FIELDS = sorted(f.name for f in fields(TrainingArguments))
    names = _TA_FIELDS + ["evaluation_strategy", "no_cuda", "not_a_field", "push_to_hub", "fsdp"]
    return draw(st.dictionaries(st.sampled_from(names), st.one_of(values, st.sampled_from(
        ["steps", "epoch", "no", "linear", "cosine", "adamw_torch", "loss", "fp16", "auto"])), max_size=6))


def check_training_args(doc) -> None:
    """TrainingArguments.from_dict: arguments, or a ValueError naming the field."""
    from accelerate_c.training_args import _ALIASES, TrainingArguments

    count("training_args")
    with time_limit(20, "training_args"):
        try:
            args = TrainingArguments.from_dict(dict(doc))
        except ValueError as e:
            msg = str(e)
            named = dict(doc, **{_ALIASES[k]: v for k, v in doc.items() if k in _ALIASES})  # the new spelling
            assert "TrainingArguments" in msg and _names_something(msg, "\0", named), \
                f"error names no field: {msg}"
            return
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"training args {doc!r}: {type(e).__name__}: {e}") from e
        assert isinstance(args, TrainingArguments)


# ---- load_state on mutated checkpoint directories --------------------------------------------------
class CheckpointBench:
    """One Accelerator job, a pristine checkpoint of it, a second (other seed) checkpoint outside
    the directory as the decoy a symlink may point to, and the state a clean load gives."""

    def __init__(self):
        from checkpoint_helpers import prepared

        from helpers import reset_all_states

        reset_all_states()
        self.root = tempfile.mkdtemp(prefix="ac_fuzz_ckpt_")
        atexit.register(shutil.rmtree, self.root, True)
        self.acc, self.model, self.opt, self.sched = prepared(seed=0)
        self.pristine = os.path.join(self.root, "pristine")
        self.acc.save_state(self.pristine)
        # the decoy: the same files from a job with other weights (same sizes: a followed symlink
        # passes every size check and loads other state, which the comparison below sees)
        other_acc, om, oo, osch = self.acc, *plain_other(seed=1)
        self.decoy = os.path.join(self.root, "outside")
        _save_other(self.acc, om, oo, osch, self.decoy, self.model, self.opt, self.sched)
        self.files = sorted(os.listdir(self.pristine))
        self.work = os.path.join(self.root, "ck")
        self.acc.load_state(self.pristine)
        self.reference = self.snapshot()
        self.sched_attrs = set(vars(self.sched.scheduler if hasattr(self.sched, "scheduler") else self.sched))

    def restore(self) -> None:
        """Back to the reference after a load of changed (but loadable) content: torch's
        schedulers keep whatever keys a state dict brought, so those go first."""
        s = self.sched.scheduler if hasattr(self.sched, "scheduler") else self.sched
        for k in set(vars(s)) - self.sched_attrs:
            delattr(s, k)
        self.acc.load_state(self.pristine)

    def snapshot(self) -> dict:
        np_state = np.random.get_state()
        opt_sd = self.opt.state_dict()
        return {"model": {k: v.clone() for k, v in self.model.state_dict().items()},
                "optimizer": {"state": {k: {n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in v.items()}
                                        if isinstance(v, dict) else v for k, v in opt_sd["state"].items()},
                              "param_groups": json.loads(json.dumps(opt_sd["param_groups"]))},
                "scheduler": json.loads(json.dumps(self.sched.state_dict())),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                "numpy_rng": (np_state[0], np_state[1].tolist(), *np_state[2:]),
                "step": self.acc.step, "iteration": self.acc.save_iteration}

    def fresh_copy(self) -> str:
        if os.path.lexists(self.work):
            shutil.rmtree(self.work)
        shutil.copytree(self.pristine, self.work)
        return self.work


def plain_other(seed):
    from checkpoint_helpers import plain_setup

    return plain_setup(seed)


def _save_other(acc, model, opt, sched, where, live_model, live_opt, live_sched):
    """A checkpoint of (model, opt, sched) written through `acc` (whose prepared objects are the
    live ones): their states are swapped in, saved, and swapped back."""
    keep = (live_model.state_dict(), live_opt.state_dict(), live_sched.state_dict())
    keep = ({k: v.clone() for k, v in keep[0].items()}, _clone_sd(keep[1]), json.loads(json.dumps(keep[2])))
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
    with torch.no_grad():
        live_model.load_state_dict(model.state_dict())
    live_opt.load_state_dict(opt.state_dict())
    live_sched.load_state_dict(sched.state_dict())
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)
    acc.save_state(where)
    with torch.no_grad():
        live_model.load_state_dict(keep[0])
    live_opt.load_state_dict(keep[1])
    live_sched.load_state_dict(keep[2])
    torch.set_rng_state(rng[0])
    random.setstate(rng[1])
    np.random.set_state(rng[2])


def _clone_sd(sd):
    import copy

    return copy.deepcopy(sd)


@functools.lru_cache(maxsize=None)  # one pristine checkpoint per process, made at first use
def bench() -> CheckpointBench:
    return CheckpointBench()


MUTATION_OPS = ("flip", "truncate", "swap", "delete", "extra", "symlink_out", "symlink_dir_out", "json_edit",
                "fix_marker")
# the extra files a mutation may add (a bench may name its own: `extras`)
EXTRAS = ("pytorch_model.bin", "optimizer.bin", "random_states_0.pkl", "model_1.safetensors", "custom_checkpoint_0.json",
          "zero_plan.json", "notes.txt", ".hidden")


@st.composite
def mutations(draw, ops=MUTATION_OPS):
    """One to three mutations (op, file choice, position or second file, bit, payload), then
    optionally the sizes in checkpoint.json made consistent. `ops`: the kinds drawn from (a
    bench's `focus` names extra json_edit kinds that pick among some files only)."""
    n = draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        op = draw(st.sampled_from(ops))
        out.append((op, draw(st.integers(0, 1 << 30)), draw(st.integers(0, 1 << 30)), draw(st.integers(0, 255)),
                    draw(values if op.startswith("json_edit") else st.binary(max_size=64))))
    if draw(st.booleans()):
        out.append(("fix_marker", 0, 0, 0, b""))  # sizes made consistent: the checks behind the gate run
    return out


def apply_mutations(b, ops) -> bool:
    """Applies the mutations to a fresh copy of bench `b`'s pristine checkpoint (`b.fresh_copy()`;
    `b.decoy` is the other checkpoint beside it that links point to); True when a file's content
    inside the directory changed (then a successful load may legitimately load other values)."""
    import re

    from accelerate_c.checkpoint_layout import MARKER

    d = b.fresh_copy()
    extras = getattr(b, "extras", EXTRAS)
    focus = getattr(b, "focus", {})
    content_changed = False
    for op, a, c, bit, payload in ops:
        files = sorted(f for f in os.listdir(d) if os.path.isfile(os.path.join(d, f)) and
                       not os.path.islink(os.path.join(d, f)))
        if op in focus:  # a JSON edit of the files this kind aims at (a shard plan, say)
            files = [f for f in files if re.fullmatch(focus[op], f)]
            op = "json_edit"
        if not files:
            continue
        name = files[a % len(files)]
        p = os.path.join(d, name)
        if op == "flip":
            data = bytearray(open(p, "rb").read())
            if data:
                data[c % len(data)] ^= 1 << (bit % 8)
                open(p, "wb").write(bytes(data))
                content_changed = True
        elif op == "truncate":
            size = os.path.getsize(p)
            with open(p, "r+b") as f:
                f.truncate(c % (size + 1))
            content_changed = True
        elif op == "swap":
            other = os.path.join(d, files[c % len(files)])
            if other != p:
                tmp = p + ".swap"
                os.rename(p, tmp)
                os.rename(other, p)
                os.rename(tmp, other)
                content_changed = True
        elif op == "delete":
            os.unlink(p)
            content_changed = True
        elif op == "extra":
            extra = extras[c % len(extras)]
            if not os.path.exists(os.path.join(d, extra)):
                open(os.path.join(d, extra), "wb").write(bytes(payload))
        elif op == "symlink_out":
            target = os.path.join(b.decoy, name)
            if os.path.exists(target):
                os.unlink(p)
                os.symlink(target, p)
        elif op == "symlink_dir_out":
            # a relative symlink that climbs out of the directory
            target = os.path.join("..", "outside", name)
            if os.path.exists(os.path.join(b.decoy, name)):
                os.unlink(p)
                os.symlink(target, p)
        elif op == "json_edit" and name.endswith(".json"):
            try:
                doc = json.loads(open(p, "rb").read())
            except ValueError:
                continue
            edit_json(doc, c, payload)
            open(p, "w").write(json.dumps(doc, allow_nan=True))
            content_changed = True
        elif op == "fix_marker" and os.path.exists(os.path.join(d, MARKER)):
            try:
                marker = json.loads(open(os.path.join(d, MARKER), "rb").read())
                if isinstance(marker, dict) and isinstance(marker.get("files"), dict):
                    for f in list(marker["files"]):
                        q = os.path.join(d, str(f))
                        if os.path.lexists(q) and os.path.isfile(q):
                            marker["files"][f] = os.path.getsize(q)
                    open(os.path.join(d, MARKER), "w").write(json.dumps(marker))
            except ValueError:
                pass
    return content_changed


def edit_json(doc, where: int, value) -> None:
    """Replaces (or deletes, or adds) one node of a JSON document, chosen by `where`."""
    nodes = []

    def walk(obj):
        if isinstance(obj, dict):
            for k in list(obj):
                nodes.append((obj, k))
                walk(obj[k])
        elif isinstance(obj, list):
            for i in range(len(obj)):
                nodes.append((obj, i))
                walk(obj[i])

    walk(doc)
    if not nodes:
        return
    parent, key = nodes[where % len(nodes)]
    kind = (where >> 8) % 4
    if kind == 0 and isinstance(parent, dict):
        del parent[key]
    elif kind == 1 and isinstance(parent, dict):
        parent[f"{key}_extra"] = value
    else:
        parent[key] = value


_PICKLE_CALLS = []
_OUTSIDE_OPENS = []
_AUDIT = {"on": False, "decoy": None}


def _audit(event, args):
    if not _AUDIT["on"] or event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    try:
        real = os.path.realpath(os.fsdecode(args[0]))
    except (TypeError, ValueError):
        return
    if real.startswith(_AUDIT["decoy"] + os.sep):
        _OUTSIDE_OPENS.append(real)


_AUDIT_INSTALLED = False


def check_load_state(ops) -> None:
    """load_state on a mutated copy of the pristine checkpoint."""
    count("load_state")
    check_load(bench(), ops)


def check_load(b, ops) -> None:
    """load_state of bench `b`'s job (`b.acc`) on a copy of its pristine checkpoint mutated by
    `ops`: a clear error naming a file of the checkpoint with the job bitwise as it was, or a
    load (equal to the pristine one's when no byte inside the directory changed); never pickle,
    an open() outside the directory or a hang."""
    global _AUDIT_INSTALLED
    from accelerate_c import CoreError
    from accelerate_c.state_io import CheckpointError

    from checkpoint_helpers import assert_state_equal

    content_changed = apply_mutations(b, ops)
    if not _AUDIT_INSTALLED:
        sys.addaudithook(_audit)
        _AUDIT_INSTALLED = True
    _AUDIT["decoy"] = os.path.realpath(b.decoy)
    before = b.snapshot()
    real_load = torch.load
    _PICKLE_CALLS.clear()
    _OUTSIDE_OPENS.clear()

    def no_pickle(*a, **k):
        _PICKLE_CALLS.append(a[:1])
        raise AssertionError("torch.load (pickle) called on a safe checkpoint")

    torch.load = no_pickle
    _AUDIT["on"] = True
    error = None
    try:
        with time_limit(60, "load_state"):
            b.acc.load_state(b.work)
    except AssertionError:
        raise
    except (CheckpointError, FileNotFoundError, CoreError, RuntimeError) as e:
        error = e
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"load_state after {ops!r}: {type(e).__name__}: {e}") from e
    finally:
        _AUDIT["on"] = False
        torch.load = real_load
    assert not _PICKLE_CALLS, f"pickle used after {ops!r}"
    assert not _OUTSIDE_OPENS, f"load_state opened {_OUTSIDE_OPENS[0]} outside the checkpoint after {ops!r}"
    if error is not None:
        msg = str(error)
        assert b.work in msg or any(f in msg for f in b.files), f"{type(error).__name__} names no file: {msg}"
        assert_state_equal(b.snapshot(), before, "job after a failed load")
        return
    if not content_changed:
        # only links and extra files: the directory's own bytes are the pristine checkpoint's, so
        # the state must be the pristine one (another one means a read outside the directory)
        assert_state_equal(b.snapshot(), b.reference, f"job after loading {ops!r}")
    else:
        b.restore()  # back to the reference for the next input


# ---- the model index reader (model_io.load_model_weights: sharded safetensors + index) ----------------
class IndexBench:
    def __init__(self):
        from accelerate_c.model_io import save_model

        from helpers import make_model

        self.root = tempfile.mkdtemp(prefix="ac_fuzz_index_")
        atexit.register(shutil.rmtree, self.root, True)
        self.model = make_model(0)
        self.pristine = os.path.join(self.root, "pristine")
        save_model(self.model, self.pristine, max_shard_size=200)  # several shards and an index
        self.files = sorted(os.listdir(self.pristine))
        assert "model.safetensors.index.json" in self.files, self.files
        self.work = os.path.join(self.root, "w")


@functools.lru_cache(maxsize=None)  # as bench()
def index_bench() -> IndexBench:
    return IndexBench()


@st.composite
def index_mutations(draw):
    """(edit kind, where, value): a JSON edit of the index, raw bytes for it, or a shard file
    deleted / truncated / flipped."""
    kind = draw(st.sampled_from(["json_edit", "json_edit", "raw", "shard_delete", "shard_truncate", "shard_flip"]))
    return kind, draw(st.integers(0, 1 << 30)), draw(values if kind == "json_edit" else st.binary(max_size=300))


def check_model_index(mut) -> None:
    """load_model_weights with a mutated index or shard: loads, or ValueError / FileNotFoundError /
    RuntimeError / CoreError naming the index or a shard, with the model unchanged."""
    from accelerate_c import CoreError
    from accelerate_c.model_io import load_model_weights

    from checkpoint_helpers import assert_state_equal

    count("model_index")
    b = index_bench()
    if os.path.lexists(b.work):
        shutil.rmtree(b.work)
    shutil.copytree(b.pristine, b.work)
    kind, where, value = mut
    index = os.path.join(b.work, "model.safetensors.index.json")
    shards = [f for f in b.files if f.endswith(".safetensors")]
    shard = os.path.join(b.work, shards[where % len(shards)])
    if kind == "json_edit":
        doc = json.loads(open(index, "rb").read())
        edit_json(doc, where, value)
        open(index, "w").write(json.dumps(doc, allow_nan=True))
    elif kind == "raw":
        open(index, "wb").write(bytes(value))
    elif kind == "shard_delete":
        os.unlink(shard)
    elif kind == "shard_truncate":
        with open(shard, "r+b") as f:
            f.truncate(where % (os.path.getsize(shard) + 1))
    else:
        data = bytearray(open(shard, "rb").read())
        data[where % len(data)] ^= 1 << (where % 8)
        open(shard, "wb").write(bytes(data))
    with torch.no_grad():
        for p in b.model.parameters():
            p.fill_(0.5)
    before = {k: v.clone() for k, v in b.model.state_dict().items()}
    with time_limit(20, "model_index"):
        try:
            load_model_weights(b.model, b.work)
        except (ValueError, FileNotFoundError, RuntimeError, CoreError) as e:
            msg = str(e)
            assert b.work in msg or any(f in msg for f in b.files), f"{type(e).__name__} names no file: {msg}"
            assert_state_equal({k: v for k, v in b.model.state_dict().items()}, before, "model after a failed load")
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"load_model_weights after {mut!r}: {type(e).__name__}: {e}") from e
