"""TrainingArguments: transformers' field names and defaults for what accelerate_c's Trainer does,
validated up front, loadable from a dict, a JSON file or a YAML file, and mapped onto an
Accelerator the way transformers' Trainer builds its own (`accelerator_kwargs`). Also the
Trainer's configuration-side pieces: its state (trainer_state.json), control flags, callback
base class, learning-rate schedules and weight-decay grouping (the loop is in trainer.py)."""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
import re
import warnings
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

from torch import nn

from .lr_schedules import SCHEDULERS, check_kwargs, get_scheduler  # noqa: F401  (get_scheduler: re-exported)
from .training_args_fields import classify, is_transformers_args, transformers_defaults

# stepped with the evaluation metric (metric_for_best_model) after each evaluation
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
TRAIN_SAMPLING = ("random", "sequential", "group_by_length")
_OTHER_TRAIN_SAMPLING = ("batch_rebalance",)
INTERVALS = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad")
DDP_BACKENDS = ("nccl", "gloo")
_OTHER_DDP_BACKENDS = ("mpi", "ccl", "hccl", "cncl", "mccl")
ACCELERATOR_CONFIG_DEFAULTS = {
    "split_batches": False, "dispatch_batches": None, "even_batches": True, "use_seedable_sampler": True,
    "non_blocking": False, "gradient_accumulation_kwargs": None, "use_configured_state": False,
}
GRAD_ACC_KEYS = ("num_steps", "adjust_scheduler", "sync_with_dataloader", "sync_each_batch")

_ALIASES = {"evaluation_strategy": "eval_strategy", "no_cuda": "use_cpu"}


def _err(name: str, why: str) -> ValueError:
    return ValueError(f"TrainingArguments.{name}: {why}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _read_mapping_file(path: str, what: str) -> dict:
    """A JSON (or, by extension, YAML) file holding a mapping; a clear error otherwise."""
    if not os.path.isfile(path):
        raise _err(what, f"file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise _err(what, f"file {path!r} cannot be read: {e}") from None
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # noqa: BLE001 - any parse error, reported with the file
        raise _err(what, f"file {path!r} cannot be parsed: {e}") from None
    if not isinstance(data, dict):
        raise _err(what, f"file {path!r} must hold a mapping, got {type(data).__name__}")
    return data


# the dict fields a JSON string (starting with "{") may give, as transformers' _VALID_DICT_FIELDS;
# another string stays what it was (a path, read below where the field takes one)
_JSON_DICT_FIELDS = ("accelerator_config", "fsdp_config", "deepspeed", "activation_checkpointing_kwargs",
                     "gradient_checkpointing_kwargs", "lr_scheduler_kwargs")


def _typed_strings(value):
    """A parsed JSON value with its command-line strings typed as transformers types them:
    "true"/"false" (any case) a bool, a run of digits an int, digits with one "." a float; dicts
    walked through, everything else kept."""
    if isinstance(value, dict):
        return {k: _typed_strings(v) for k, v in value.items()}
    if not isinstance(value, str):
        return value
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    if value.isdigit():
        return int(value)
    whole, dot, frac = value.partition(".")
    if dot and (whole + frac).isdigit():
        return float(value)
    return value


@dataclass
class TrainingArguments:
    """transformers' TrainingArguments, for the fields accelerate_c's Trainer supports (see
    docs/trainer.md). Every value is checked when the object is built: a wrong type, a value
    out of range or a choice that does not exist raises ValueError naming the field."""

    output_dir: str | None = None
    overwrite_output_dir: bool = False
    do_train: bool = False
    do_eval: bool = False
    eval_strategy: str = "no"
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    eval_accumulation_steps: int | None = None
    learning_rate: float = 5e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict | None = field(default_factory=dict)
    warmup_ratio: float = 0.0
    warmup_steps: float = 0
    logging_dir: str | None = None
    logging_strategy: str = "steps"
    logging_first_step: bool = False
    logging_steps: float = 500
    logging_nan_inf_filter: bool = True
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_safetensors: bool = True
    save_on_each_node: bool = False
    save_only_model: bool = False
    use_cpu: bool = False
    seed: int = 42
    data_seed: int | None = None
    full_determinism: bool = False
    bf16: bool = False
    fp16: bool = False
    ddp_backend: str | None = None
    eval_steps: float | None = None
    eval_on_start: bool = False
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_prefetch_factor: int | None = None
    dataloader_persistent_workers: bool = False
    dataloader_pin_memory: bool = True
    run_name: str | None = None
    disable_tqdm: bool | None = None
    remove_unused_columns: bool = True
    label_names: list | None = None
    train_sampling_strategy: str = "random"
    length_column_name: str = "length"
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    fsdp: Any = ""
    fsdp_config: Any = None
    deepspeed: Any = None
    accelerator_config: Any = None
    optim: str = "adamw_torch"
    report_to: Any = "none"
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_timeout: int = 1800
    resume_from_checkpoint: str | None = None
    gradient_checkpointing: bool = False
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    prediction_loss_only: bool = False
    label_smoothing_factor: float = 0.0

    # ------------------------------------------------------------------ validation
    def __post_init__(self):
        # transformers fields read by from_dict and ignored (training_args_fields.py); not a field
        self.carried = {}
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # transformers' default since 4.50
        try:
            self.output_dir = os.fspath(self.output_dir)
        except TypeError:
            raise _err("output_dir", f"expected a path, got {self.output_dir!r}") from None
        if self.logging_dir is None:
            self.logging_dir = os.path.join(self.output_dir, "runs")
        for name in _JSON_DICT_FIELDS:  # '{...}' from a command line, as transformers reads it
            v = getattr(self, name, None)
            if isinstance(v, str) and v.startswith("{"):
                try:
                    setattr(self, name, _typed_strings(json.loads(v)))
                except json.JSONDecodeError as e:
                    raise _err(name, f"not valid JSON ({e}): {v!r}") from None
        for f in fields(self):
            if f.type in ("bool",) or f.name in ("disable_tqdm", "ddp_find_unused_parameters",
                                                 "ddp_broadcast_buffers", "greater_is_better"):
                v = getattr(self, f.name)
                if not isinstance(v, bool) and not (v is None and "None" in str(f.type)):
                    raise _err(f.name, f"expected true/false, got {v!r}")
        self._check_ints()
        self._check_floats()
        self._check_choices()
        self._check_intervals()
        self._check_features()
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        if self.load_best_model_at_end:
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
            if self.save_strategy != "best" and self.eval_strategy != self.save_strategy:
                raise _err("load_best_model_at_end", f"needs save_strategy ({self.save_strategy!r}) to match "
                           f"eval_strategy ({self.eval_strategy!r})")
            if self.eval_strategy == "steps" and self.save_strategy == "steps" and self.save_steps % self.eval_steps:
                raise _err("load_best_model_at_end", f"save_steps ({self.save_steps}) must be a multiple of "
                           f"eval_steps ({self.eval_steps})")
        if self.lr_scheduler_type in METRIC_SCHEDULERS:
            if self.eval_strategy == "no":
                raise _err("lr_scheduler_type", f"{self.lr_scheduler_type!r} is stepped with the evaluation metric "
                                                "(metric_for_best_model) after each evaluation: it needs an "
                                                "eval_strategy other than 'no'")
            if self.metric_for_best_model is None:
                self.metric_for_best_model = "loss"
        if self.save_strategy == "best" and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.metric_for_best_model is not None:
            if not isinstance(self.metric_for_best_model, str):
                raise _err("metric_for_best_model", f"expected a metric name, got {self.metric_for_best_model!r}")
            if self.greater_is_better is None:  # transformers' rule: a name ending in "loss" is minimised
                self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _check_ints(self):
        spec = {"per_device_train_batch_size": 1, "per_device_eval_batch_size": 1, "gradient_accumulation_steps": 1,
                "dataloader_num_workers": 0, "ddp_timeout": 1, "seed": None}
        for name, lo in spec.items():
            v = getattr(self, name)
            if not _is_int(v):
                raise _err(name, f"expected an integer, got {v!r}")
            if lo is not None and v < lo:
                raise _err(name, f"must be >= {lo}, got {v}")
        w = self.warmup_steps
        if not _is_num(w) or not math.isfinite(w) or w < 0 or (w >= 1 and w != int(w)):
            raise _err("warmup_steps", f"expected a whole number of steps >= 0, or a float in (0, 1) (a ratio of the "
                                       f"total training steps), got {w!r}")
        self.warmup_steps = int(w) if w >= 1 or w == 0 else float(w)
        if not _is_int(self.max_steps) or (self.max_steps < 1 and self.max_steps != -1):
            raise _err("max_steps", f"expected a positive integer, or -1 (train num_train_epochs), got "
                                    f"{self.max_steps!r}")
        for name in ("eval_accumulation_steps", "save_total_limit", "dataloader_prefetch_factor",
                     "ddp_bucket_cap_mb"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 1):
                raise _err(name, f"expected None or an integer >= 1, got {v!r}")
        if self.data_seed is not None and not _is_int(self.data_seed):
            raise _err("data_seed", f"expected None or an integer, got {self.data_seed!r}")
        if self.dataloader_prefetch_factor is not None and self.dataloader_num_workers == 0:
            raise _err("dataloader_prefetch_factor", "needs dataloader_num_workers > 0 (torch's DataLoader only "
                                                     "prefetches with worker processes)")
        if self.dataloader_persistent_workers and self.dataloader_num_workers == 0:
            raise _err("dataloader_persistent_workers", "needs dataloader_num_workers > 0")

    def _check_floats(self):
        spec = {"learning_rate": (0, None), "weight_decay": (0, None), "adam_epsilon": (0, None),
                "max_grad_norm": (0, None), "num_train_epochs": (0, None), "warmup_ratio": (0, 1),
                "label_smoothing_factor": (0, 1),
                "adam_beta1": (0, 1), "adam_beta2": (0, 1)}
        for name, (lo, hi) in spec.items():
            v = getattr(self, name)
            if name == "max_grad_norm" and v is None:
                self.max_grad_norm = 0.0  # None: no clipping, as in transformers
                continue
            if not _is_num(v) or not math.isfinite(v):
                raise _err(name, f"expected a finite number, got {v!r}")
            if v < lo or (hi is not None and (v >= hi if name.startswith("adam_beta") else v > hi)):
                rng = f"in [{lo}, {hi})" if name.startswith("adam_beta") else (f"in [{lo}, {hi}]" if hi else f">= {lo}")
                raise _err(name, f"must be {rng}, got {v!r}")
            setattr(self, name, float(v))

    def _check_choices(self):
        def choice(name, allowed, other=()):
            v = getattr(self, name)
            v = getattr(v, "value", v)  # a transformers enum member
            if isinstance(v, str):
                v = v.lower()
            if v in other:
                raise _err(name, f"{v!r} is not supported yet by accelerate_c (supported: {', '.join(allowed)})")
            if v not in allowed:
                raise _err(name, f"got {v!r}; choose from {', '.join(allowed)}")
            setattr(self, name, v)

        choice("eval_strategy", INTERVALS)
        choice("logging_strategy", INTERVALS)
        choice("save_strategy", SAVE_STRATEGIES)
        choice("lr_scheduler_type", SCHEDULERS)
        choice("train_sampling_strategy", TRAIN_SAMPLING, _OTHER_TRAIN_SAMPLING)
        if not isinstance(self.length_column_name, str):
            raise _err("length_column_name", f"expected a column name, got {self.length_column_name!r}")
        choice("optim", OPTIMIZERS)
        if self.ddp_backend is not None:
            choice("ddp_backend", DDP_BACKENDS, _OTHER_DDP_BACKENDS)
        if self.lr_scheduler_kwargs is None:
            self.lr_scheduler_kwargs = {}
        if not isinstance(self.lr_scheduler_kwargs, dict):
            raise _err("lr_scheduler_kwargs", f"expected a mapping, got {self.lr_scheduler_kwargs!r}")
        try:
            check_kwargs(self.lr_scheduler_type, self.lr_scheduler_kwargs)
        except ValueError as e:
            raise _err("lr_scheduler_kwargs", str(e)) from None
        if self.fp16 and self.bf16:
            raise _err("fp16", "fp16 and bf16 cannot both be true")
        if self.label_names is not None and (not isinstance(self.label_names, (list, tuple))
                                             or not all(isinstance(n, str) for n in self.label_names)):
            raise _err("label_names", f"expected a list of names, got {self.label_names!r}")
        if self.resume_from_checkpoint is not None and not isinstance(self.resume_from_checkpoint, (str, bool,
                                                                                                     os.PathLike)):
            raise _err("resume_from_checkpoint", f"expected a path, got {self.resume_from_checkpoint!r}")
        rt = self.report_to
        if rt is None:
            rt = "none"
        rt = [rt] if isinstance(rt, str) else rt
        if not isinstance(rt, (list, tuple)) or not all(isinstance(r, str) for r in rt):
            raise _err("report_to", f"expected 'none', 'all', an integration name or a list of them, got "
                                    f"{self.report_to!r}")
        self.report_to = [] if list(rt) == ["none"] else list(rt)

    def _steps(self, name, value, allow_none=False):
        if value is None and allow_none:
            return None
        if not _is_num(value) or value <= 0:
            raise _err(name, f"expected an integer > 0 (or a float in (0, 1): a ratio of the total training "
                             f"steps), got {value!r}")
        if value > 1:
            if value != int(value):
                raise _err(name, f"a value > 1 must be a whole number of steps, got {value!r}")
            return int(value)
        return value

    def _check_intervals(self):
        self.logging_steps = self._steps("logging_steps", self.logging_steps)
        self.save_steps = self._steps("save_steps", self.save_steps)
        self.eval_steps = self._steps("eval_steps", self.eval_steps, allow_none=True)
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.logging_steps  # transformers' rule
        if self.eval_strategy != "no":
            self.do_eval = True

    def _check_features(self):
        if self.fsdp is None:  # transformers 5's default
            self.fsdp = ""
        if isinstance(self.fsdp, bool):
            self.fsdp = "full_shard" if self.fsdp else ""
        if isinstance(self.fsdp, (list, tuple)):
            if not all(isinstance(o, str) for o in self.fsdp):
                raise _err("fsdp", f"expected a string of FSDP options or a list of them, got {self.fsdp!r}")
            self.fsdp = " ".join(self.fsdp)
        if not isinstance(self.fsdp, str):
            raise _err("fsdp", f"expected a string of FSDP options or a list, got {self.fsdp!r}")
        # the DeepSpeed config's file, named in its errors (accelerate_c's attribute, not a field)
        self.deepspeed_source = os.fspath(self.deepspeed) if isinstance(self.deepspeed, (str, os.PathLike)) else None
        for name in ("fsdp_config", "deepspeed"):
            v = getattr(self, name)
            if isinstance(v, (str, os.PathLike)):
                setattr(self, name, _read_mapping_file(os.fspath(v), name))
            elif v is not None and not isinstance(v, dict):
                raise _err(name, f"expected a path to a JSON file or a mapping, got {v!r}")
        self.accelerator_config = self._accelerator_config(self.accelerator_config)
        for name in ("torch_compile_backend", "torch_compile_mode"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise _err(name, f"expected a name, got {v!r}")
        # transformers' rules: a backend or a mode turns compilation on; inductor by default
        if self.torch_compile_backend is not None or self.torch_compile_mode is not None:
            self.torch_compile = True
        if self.torch_compile and self.torch_compile_backend is None:
            self.torch_compile_backend = "inductor"

    @staticmethod
    def _accelerator_config(value) -> dict:
        if value is None:
            value = {}
        elif isinstance(value, (str, os.PathLike)):
            value = _read_mapping_file(os.fspath(value), "accelerator_config")
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif hasattr(value, "to_dict"):
            value = value.to_dict()
        if not isinstance(value, dict):
            raise _err("accelerator_config", f"expected a mapping, a path to a JSON file or None, got {value!r}")
        out = dict(ACCELERATOR_CONFIG_DEFAULTS)
        for k, v in value.items():
            if k not in ACCELERATOR_CONFIG_DEFAULTS:
                raise _err("accelerator_config", f"unknown key {k!r}; known keys: "
                           f"{', '.join(ACCELERATOR_CONFIG_DEFAULTS)}")
            out[k] = v
        for k in ("split_batches", "even_batches", "use_seedable_sampler", "non_blocking", "use_configured_state"):
            if not isinstance(out[k], bool):
                raise _err("accelerator_config", f"{k} must be true/false, got {out[k]!r}")
        if out["dispatch_batches"] not in (None, True, False):
            raise _err("accelerator_config", f"dispatch_batches must be None or true/false, got "
                                             f"{out['dispatch_batches']!r}")
        ga = out["gradient_accumulation_kwargs"]
        if ga is not None:
            if not isinstance(ga, dict):
                raise _err("accelerator_config", f"gradient_accumulation_kwargs must be a mapping, got {ga!r}")
            for k, v in ga.items():
                if k not in GRAD_ACC_KEYS:
                    raise _err("accelerator_config", f"gradient_accumulation_kwargs: unknown key {k!r}; known "
                                                     f"keys: {', '.join(GRAD_ACC_KEYS)}")
                if k == "num_steps" and (not _is_int(v) or v < 1):
                    raise _err("accelerator_config", f"gradient_accumulation_kwargs.num_steps must be an "
                                                     f"integer >= 1, got {v!r}")
                if k != "num_steps" and not isinstance(v, bool):
                    raise _err("accelerator_config", f"gradient_accumulation_kwargs.{k} must be true/false, "
                                                     f"got {v!r}")
        return out

    # ------------------------------------------------------------------ derived values
    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """warmup_steps when >= 1; a fraction in (0, 1) of the training steps, rounded up
        (transformers 5's rule); otherwise ceil(num_training_steps * warmup_ratio)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps if self.warmup_steps > 0 else self.warmup_ratio
        return math.ceil(num_training_steps * ratio)

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_dict(cls, data: dict, source: str = "dict") -> "TrainingArguments":
        """From a mapping of field names to values (the keys of transformers' TrainingArguments,
        e.g. its `to_dict()`). transformers' other fields (training_args_fields.py): those about
        training mechanics accelerate_c has not built are refused by name unless at their
        default; the rest are kept in `.carried` and ignored, with one warning naming those not
        at their default. A name transformers does not have either is an error."""
        if not isinstance(data, dict):
            raise ValueError(f"TrainingArguments from {source}: expected a mapping, got {type(data).__name__}")
        names = {f.name: f for f in fields(cls)}
        kwargs, carried, listed = {}, {}, []
        hf_defaults = None
        for key, value in data.items():
            name = _ALIASES.get(key, key)
            if key == "no_cuda":
                value = bool(value)
            if name in names:
                if name in kwargs:
                    raise ValueError(f"TrainingArguments from {source}: {key!r} given twice (also as an alias)")
                kwargs[name] = _coerce(names[name], value)
                continue
            if hf_defaults is None:
                hf_defaults = transformers_defaults()
            kind, detail = classify(key, value, hf_defaults)
            if kind == "refuse":
                raise ValueError(f"TrainingArguments.{key}={value!r} (from {source}): {detail}")
            if kind == "carry":
                carried[key] = value
                if detail:
                    listed.append(f"{key}={value!r}")
                continue
            close = difflib.get_close_matches(key, list(names) + list(hf_defaults), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"TrainingArguments from {source}: unknown field {key!r}{hint}")
        if listed:
            warnings.warn(f"TrainingArguments (from {source}): these transformers fields do not concern accelerate_c's "
                          f"training mechanics and are carried but ignored: {', '.join(listed)}", stacklevel=2)
        args = cls(**kwargs)
        args.carried = carried
        return args

    @classmethod
    def from_json_file(cls, path: str) -> "TrainingArguments":
        return cls.from_dict(_read_mapping_file(os.fspath(path), "from_json_file"), source=os.fspath(path))

    @classmethod
    def from_yaml_file(cls, path: str) -> "TrainingArguments":
        import yaml

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ValueError(f"TrainingArguments.from_yaml_file: file {path!r} does not exist")
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f)
            except yaml.YAMLError as e:
                raise ValueError(f"TrainingArguments.from_yaml_file: {path!r} is not valid YAML: {e}") from None
        return cls.from_dict(data, source=path)


def _coerce(f, value):
    """Numbers written as strings (YAML 1.1 reads `5e-5` as a string) become numbers for numeric fields."""
    if isinstance(value, str) and str(f.type).split(" ")[0] in ("float", "int"):
        try:
            number = float(value)
        except ValueError:
            return value  # the validation names the field
        # inf and nan stay floats: int() of them raises, and the validation names the field
        return int(number) if str(f.type).startswith("int") and math.isfinite(number) and number == int(number) \
            else number
    return value


def load_training_args(source) -> TrainingArguments:
    """TrainingArguments from a TrainingArguments (accelerate_c's, or transformers': read
    through its to_dict()), a dict, or a .json / .yaml / .yml file."""
    if isinstance(source, TrainingArguments):
        return source
    if is_transformers_args(source):
        return TrainingArguments.from_dict(source.to_dict(), source=f"{type(source).__name__} of transformers")
    if isinstance(source, dict):
        return TrainingArguments.from_dict(source)
    path = os.fspath(source)
    if path.endswith((".yaml", ".yml")):
        return TrainingArguments.from_yaml_file(path)
    return TrainingArguments.from_json_file(path)


# ---------------------------------------------------------------------- the Trainer's state and callbacks


class EvalPrediction:
    """What compute_metrics receives: predictions and label_ids (numpy arrays, or tuples of
    them); unpacks as `predictions, label_ids = eval_pred`, as in transformers."""

    def __init__(self, predictions, label_ids, inputs=None):
        self.predictions, self.label_ids, self.inputs = predictions, label_ids, inputs

    def __iter__(self):
        return iter((self.predictions, self.label_ids) if self.inputs is None else
                    (self.predictions, self.label_ids, self.inputs))

    def __getitem__(self, i):
        return tuple(self)[i]


@dataclass
class TrainerState:
    """The loop's progress, saved as trainer_state.json in every checkpoint (transformers' keys)."""

    epoch: float | None = None
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    total_flos: float = 0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True

    def save_to_json(self, json_path: str):
        """Written atomically and durably (accelerate_c.durable): a trainer_state.json is always complete."""
        from .durable import write_bytes_durable

        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        write_bytes_durable(json_path, text.encode("utf-8"))

    @classmethod
    def load_from_json(cls, json_path: str) -> "TrainerState":
        with open(json_path, encoding="utf-8") as f:
            data = json.load(f)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class TrainerControl:
    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False

    def _new_step(self):
        self.should_save = self.should_evaluate = self.should_log = False


class TrainerCallback:
    """transformers' callback events; each gets (args, state, control, **kwargs) and may
    return a TrainerControl. Subclass and override the ones you need."""

    def on_init_end(self, args, state, control, **kwargs): pass
    def on_train_begin(self, args, state, control, **kwargs): pass
    def on_train_end(self, args, state, control, **kwargs): pass
    def on_epoch_begin(self, args, state, control, **kwargs): pass
    def on_epoch_end(self, args, state, control, **kwargs): pass
    def on_step_begin(self, args, state, control, **kwargs): pass
    def on_step_end(self, args, state, control, **kwargs): pass
    def on_evaluate(self, args, state, control, **kwargs): pass
    def on_save(self, args, state, control, **kwargs): pass
    def on_log(self, args, state, control, **kwargs): pass
    def on_predict(self, args, state, control, **kwargs): pass


# ---------------------------------------------------------------------- schedules and weight decay


_NORM_NAME = re.compile(r"(bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.))", re.IGNORECASE)


def get_decay_parameter_names(model: nn.Module) -> list:
    """Names of the parameters that get weight decay: all but biases and normalisation layers."""
    norm_types = tuple(t for t in (nn.LayerNorm, getattr(nn, "RMSNorm", None)) if t is not None)
    skip = set()
    for mname, module in model.named_modules():
        if isinstance(module, norm_types):
            skip.update(f"{mname}.{n}" if mname else n for n, _ in module.named_parameters(recurse=False))
    return [n for n, _ in model.named_parameters() if n not in skip and not _NORM_NAME.search(n)]


# ---------------------------------------------------------------------- the Accelerator


def accelerator_kwargs(args: TrainingArguments) -> dict:
    """The Accelerator's constructor arguments for `args`, as transformers'
    create_accelerator_and_postprocess builds them (see docs/trainer.md for the table)."""
    from .utils.dataclasses import (
        DataLoaderConfiguration,
        DistributedDataParallelKwargs,
        GradientAccumulationPlugin,
        InitProcessGroupKwargs,
        ProjectConfiguration,
        TorchDynamoPlugin,
    )

    log_with = trackers_for_report_to(args.report_to)
    cfg = dict(args.accelerator_config)
    if cfg.pop("use_configured_state"):
        raise NotImplementedError("TrainingArguments.accelerator_config.use_configured_state=True is not supported "
                                  "yet by accelerate_c")
    ga = dict(cfg.pop("gradient_accumulation_kwargs") or {})
    # (equal counts agree: transformers' Trainer copies num_steps into gradient_accumulation_steps)
    if "num_steps" in ga and args.gradient_accumulation_steps > 1 and args.gradient_accumulation_steps != ga["num_steps"]:
        raise ValueError("TrainingArguments: accelerator_config.gradient_accumulation_kwargs.num_steps and "
                         "gradient_accumulation_steps > 1 are both set; set only one")
    ga["num_steps"] = ga.get("num_steps", args.gradient_accumulation_steps)
    dl = DataLoaderConfiguration(split_batches=cfg["split_batches"], dispatch_batches=cfg["dispatch_batches"],
                                 even_batches=cfg["even_batches"], use_seedable_sampler=cfg["use_seedable_sampler"],
                                 data_seed=args.data_seed, non_blocking=cfg["non_blocking"])
    handlers = [InitProcessGroupKwargs(timeout=timedelta(seconds=args.ddp_timeout),
                                       **({"backend": args.ddp_backend} if args.ddp_backend else {}))]
    ddp = {}
    if args.ddp_find_unused_parameters is not None:
        ddp["find_unused_parameters"] = args.ddp_find_unused_parameters
    if args.ddp_bucket_cap_mb is not None:
        ddp["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_broadcast_buffers is not None:
        ddp["broadcast_buffers"] = args.ddp_broadcast_buffers
    if ddp:
        handlers.append(DistributedDataParallelKwargs(**ddp))
    kwargs = dict(
        mixed_precision="bf16" if args.bf16 else ("fp16" if args.fp16 else None),  # None: env / launcher
        cpu=args.use_cpu,
        dataloader_config=dl,
        gradient_accumulation_plugin=GradientAccumulationPlugin(**ga),
        kwargs_handlers=handlers,
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=args.logging_dir,
                                            save_on_each_node=args.save_on_each_node),
        # as transformers: always a plugin; without torch_compile its backend comes from
        # ACCELERATE_DYNAMO_BACKEND (the launcher's config), "no" by default
        dynamo_plugin=TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode),
    )
    if log_with:
        kwargs["log_with"] = log_with
    # passed on so that the Accelerator refuses it with its "not supported yet" error
    if args.fsdp:
        kwargs["fsdp_plugin"] = {"fsdp": args.fsdp, "fsdp_config": args.fsdp_config}
    if args.deepspeed is not None:
        kwargs["deepspeed_plugin"] = deepspeed_plugin(args)
    return kwargs


# transformers' report_to integrations that are accelerate_c trackers of the same name (tracking.py);
# "jsonl" is accelerate_c's own
REPORT_TO_TRACKERS = ("tensorboard", "wandb", "comet_ml", "mlflow", "clearml", "dvclive", "swanlab", "trackio", "jsonl")


def trackers_for_report_to(report_to) -> list:
    """The Accelerator's log_with for TrainingArguments.report_to: "all" stays "all" (every
    installed tracker), the integrations that are trackers here keep their names; the others of
    transformers' (azure_ml, codecarbon, dagshub, flyte, neptune) are refused by name."""
    names = [] if report_to in (None, "none") else ([report_to] if isinstance(report_to, str) else list(report_to))
    names = [n for n in names if n != "none"]
    if "all" in names:
        return ["all"]
    other = [n for n in names if n not in REPORT_TO_TRACKERS]
    if other:
        raise NotImplementedError(f"TrainingArguments.report_to={report_to!r}: {', '.join(map(repr, other))} "
                                  f"{'is' if len(other) == 1 else 'are'} not among accelerate_c's trackers "
                                  f"{list(REPORT_TO_TRACKERS)}; use those, 'all' or 'none'")
    return names


def deepspeed_plugin(args: TrainingArguments):
    """The DeepSpeedPlugin for `args.deepspeed`, its "auto" values filled from the arguments as
    transformers fills them when TrainingArguments are built (per-device batch size, accumulation,
    max_grad_norm, learning rate, Adam betas/eps, weight decay, fp16/bf16); a concrete value that
    disagrees with an argument is a ValueError listing them. The rest is filled by the Accelerator."""
    from .deepspeed_config import DeepSpeedPlugin, fill_from_training_args

    config = copy.deepcopy(args.deepspeed)  # args.deepspeed keeps its "auto" values
    source = getattr(args, "deepspeed_source", None)
    try:  # transformers' args.world_size; a bad WORLD_SIZE gets its own error from the Accelerator
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        world = 1
    # an absent accumulation count reads as the arguments' (the plugin would otherwise put 1 there,
    # which then overrides gradient_accumulation_steps with a warning)
    config.setdefault("gradient_accumulation_steps", "auto")
    fill_from_training_args(config, args, world, source)
    plugin = DeepSpeedPlugin(hf_ds_config=config)
    plugin.config_file = plugin.hf_ds_config.config_file = source
    return plugin
