"""accelerate's DeepSpeed objects as a script builds them: `DeepSpeedPlugin`, `HfDeepSpeedConfig`,
`DummyOptim`, `DummyScheduler`, and reading a DeepSpeed config (file, dict or JSON text).

The plugin's constructor fields, their defaults and the ACCELERATE_* variables read for unset
fields are accelerate 1.15's, and so is the `deepspeed_config` dict it builds, so that a script
(and its `accelerate launch` environment) configures the same run here. Nothing is checked here
beyond what accelerate checks when the plugin is built: which keys accelerate_c can run is
decided when the Accelerator reads the plugin (keys.py, sharding.py), so accelerate's own
plugin objects go through the same checks.

This package imports nothing else from accelerate_c: accelerate_c.utils re-exports these names,
and an import of utils must not come back here through another module.
"""
from __future__ import annotations

import base64
import copy
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

from .config_dict import AUTO, apply_mixed_precision, fill_auto, get_value

# The plugin's fields that a DeepSpeed config file also sets, and where (accelerate's table:
# the fields fill the file's "auto" values, then the file's own values become the fields).
FIELD_PATHS = {
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "zero_stage": "zero_optimization.stage",
    "offload_optimizer_device": "zero_optimization.offload_optimizer.device",
    "offload_param_device": "zero_optimization.offload_param.device",
    "offload_param_nvme_path": "zero_optimization.offload_param.nvme_path",
    "offload_optimizer_nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "zero3_save_16bit_model": "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}

# Settings of an accelerate config file that a deepspeed_config_file makes meaningless: the
# launcher lists the file's deepspeed_config keys in ACCELERATE_CONFIG_DS_FIELDS and accelerate
# refuses the combination rather than silently preferring one of them.
_FILE_OVERRIDES_FIELDS = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage",
                          "offload_optimizer_device", "offload_param_device", "offload_param_nvme_path",
                          "offload_optimizer_nvme_path", "zero3_save_16bit_model", "mixed_precision")

_TRUE = ("1", "true", "t", "yes", "y", "on")
_FALSE = ("0", "false", "f", "no", "n", "off")


def _env_bool(key: str, default: str) -> bool:
    # accelerate's str_to_bool words; anything else is an error naming the variable
    raw = os.environ.get(key, default).strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {key}={raw!r} is not a boolean (use true/false or 1/0)")


def _env_number(key: str, raw: str, kind):
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {key}={raw!r} is not {'an integer' if kind is int else 'a number'}"
                         ) from None


def load_config(value) -> tuple[dict, str | None]:
    """(a deep copy of the DeepSpeed config, the file it came from or None). `value`: a path to a
    JSON file, a dict, an object holding the dict as `.config` (accelerate's or transformers'
    HfDeepSpeedConfig), or JSON text, plain or urlsafe-base64 encoded (accelerate takes both)."""
    source = None
    if isinstance(value, dict):
        config = copy.deepcopy(value)  # the caller's dict stays reusable: "auto" values are filled in the copy
    elif isinstance(getattr(value, "config", None), dict):
        config = copy.deepcopy(value.config)
    elif isinstance(value, (str, os.PathLike)) and os.path.exists(value):
        source = os.fspath(value)
        try:
            with open(source, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"DeepSpeed config file {source} cannot be read as JSON: {e}") from None
    elif isinstance(value, str):
        config = _json_text(value)
    else:
        raise TypeError(f"hf_ds_config: expected a path to a DeepSpeed JSON file, a dict or an HfDeepSpeedConfig, "
                        f"got {type(value).__name__}")
    if not isinstance(config, dict):
        where = f" file {source}" if source else ""
        raise ValueError(f"DeepSpeed config{where} must hold a JSON object, got {type(config).__name__}")
    return config, source


def _json_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        return json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"hf_ds_config={text!r}: no such file, and not JSON text (plain or base64) either; pass "
                         "the path of an existing DeepSpeed config file, a dict, or JSON text") from None


class HfDeepSpeedConfig:
    """A DeepSpeed config dict with its queries (accelerate.utils.HfDeepSpeedConfig's public
    ones). What the plugin keeps as `hf_ds_config`."""

    def __init__(self, config_file_or_dict):
        self.config, self.config_file = load_config(config_file_or_dict)

    def get_value(self, ds_key_long: str, default=None):
        return get_value(self.config, ds_key_long, default)

    def is_true(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else bool(value)

    def is_false(self, ds_key_long: str) -> bool:
        value = self.get_value(ds_key_long)
        return False if value is None else not bool(value)

    def is_zero2(self) -> bool:
        return self.get_value("zero_optimization.stage", -1) == 2

    def is_zero3(self) -> bool:
        return self.get_value("zero_optimization.stage", -1) == 3

    def is_offload(self) -> bool:
        # accelerate's rule: offloading counts from stage 2 on
        if not (self.is_zero2() or self.is_zero3()):
            return False
        devices = {self.get_value("zero_optimization.offload_optimizer.device"),
                   self.get_value("zero_optimization.offload_param.device")}
        return bool(devices & {"cpu", "nvme"})


@dataclass
class DeepSpeedPlugin:
    """accelerate 1.15's DeepSpeedPlugin: same fields, defaults, environment variables and
    resulting `deepspeed_config`. `hf_ds_config`: a path to a DeepSpeed JSON file, a dict, or an
    HfDeepSpeedConfig; unset, ACCELERATE_DEEPSPEED_CONFIG_FILE, else a config built from the
    fields. accelerate_c runs ZeRO stages 1 and 2 (docs/sharding.md)."""

    hf_ds_config: Any = None
    gradient_accumulation_steps: int = None
    gradient_clipping: float = None
    zero_stage: int = None
    is_train_batch_min: bool = True
    offload_optimizer_device: str = None
    offload_param_device: str = None
    offload_optimizer_nvme_path: str = None
    offload_param_nvme_path: str = None
    zero3_init_flag: bool = None
    zero3_save_16bit_model: bool = None
    transformer_moe_cls_names: str = None
    enable_msamp: bool = None
    msamp_opt_level: str | None = None

    def __post_init__(self):
        env = os.environ.get
        if self.gradient_accumulation_steps is None:
            raw = env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", AUTO)
            self.gradient_accumulation_steps = int(raw) if raw.isdigit() else raw
        if self.gradient_clipping is None:
            raw = env("ACCELERATE_GRADIENT_CLIPPING", AUTO)
            self.gradient_clipping = raw if raw == AUTO else _env_number("ACCELERATE_GRADIENT_CLIPPING", raw, float)
        if self.zero_stage is None:
            self.zero_stage = _env_number("ACCELERATE_DEEPSPEED_ZERO_STAGE",
                                          env("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"), int)
        if self.offload_optimizer_device is None:
            self.offload_optimizer_device = env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none")
        if self.offload_param_device is None:
            self.offload_param_device = env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
        if self.offload_optimizer_nvme_path is None:
            self.offload_optimizer_nvme_path = env("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "none")
        if self.offload_param_nvme_path is None:
            self.offload_param_nvme_path = env("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", "none")
        if self.zero3_save_16bit_model is None:
            self.zero3_save_16bit_model = env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "false").lower() == "true"
        if self.enable_msamp is None:
            self.enable_msamp = env("ACCELERATE_FP8_BACKEND") == "MSAMP"
        if self.msamp_opt_level is None:
            self.msamp_opt_level = env("ACCELERATE_FP8_OPT_LEVEL", "O1")
        if self.hf_ds_config is None:
            self.hf_ds_config = env("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")

        given = self.hf_ds_config
        if isinstance(given, dict) or (isinstance(given, (str, os.PathLike)) and os.fspath(given) != "none") \
                or isinstance(getattr(given, "config", None), dict):
            self.hf_ds_config = given if isinstance(given, HfDeepSpeedConfig) else HfDeepSpeedConfig(given)
            config = self.hf_ds_config.config
            config.setdefault("gradient_accumulation_steps", 1)
            if "zero_optimization" not in config:
                where = f" {self.hf_ds_config.config_file}" if self.hf_ds_config.config_file else ""
                raise ValueError(f"DeepSpeed config{where} has no 'zero_optimization' section: it says which ZeRO "
                                 "stage to run (e.g. \"zero_optimization\": {\"stage\": 2})")
            self._refuse_fields_a_file_overrides()
            for name, path in FIELD_PATHS.items():  # the fields fill the file's "auto" values ...
                if getattr(self, name) is not None:
                    fill_auto(config, path, getattr(self, name))
            for name, path in FIELD_PATHS.items():  # ... and the file's concrete values become the fields
                value = get_value(config, path)
                if value is not None and value != AUTO:
                    setattr(self, name, value)
        else:
            config = {
                "train_batch_size": AUTO,
                "train_micro_batch_size_per_gpu": AUTO,
                "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "zero_optimization": {
                    "stage": self.zero_stage,
                    "offload_optimizer": {
                        "device": self.offload_optimizer_device,
                        "nvme_path": self.offload_optimizer_nvme_path if self.offload_optimizer_device == "nvme"
                        else None,
                    },
                    "offload_param": {
                        "device": self.offload_param_device,
                        "nvme_path": self.offload_param_nvme_path if self.offload_param_device == "nvme" else None,
                    },
                    "stage3_gather_16bit_weights_on_model_save": self.zero3_save_16bit_model,
                },
            }
            if self.gradient_clipping:  # "auto" included: the Accelerator fills it (with 1.0, as accelerate)
                config["gradient_clipping"] = self.gradient_clipping
            self.hf_ds_config = HfDeepSpeedConfig(config)
        # the file a config came from, for error messages (accelerate_c's own attribute)
        self.config_file = self.hf_ds_config.config_file
        self.deepspeed_config = self.hf_ds_config.config
        self.deepspeed_config["steps_per_print"] = float("inf")  # as accelerate: DeepSpeed's own logging off
        if self.zero3_init_flag is None:
            self.zero3_init_flag = _env_bool("ACCELERATE_DEEPSPEED_ZERO3_INIT", str(self.hf_ds_config.is_zero3()))
        if self.zero3_init_flag and not self.hf_ds_config.is_zero3():
            warnings.warn("DeepSpeedPlugin(zero3_init_flag=True) applies to ZeRO stage 3 only; set to False.",
                          stacklevel=3)
            self.zero3_init_flag = False
        if self.enable_msamp and "msamp" not in self.deepspeed_config:
            # kept as accelerate writes it; the Accelerator then refuses the "msamp" key (fp8)
            self.deepspeed_config["msamp"] = {"enabled": True, "opt_level": self.msamp_opt_level}

    def _refuse_fields_a_file_overrides(self):
        listed = [n for n in os.environ.get("ACCELERATE_CONFIG_DS_FIELDS", "").split(",") if n]
        clash = [n for n in listed if n in _FILE_OVERRIDES_FIELDS]
        if clash:
            raise ValueError(
                f"The accelerate config file sets {', '.join(clash)} next to deepspeed_config_file; with a DeepSpeed "
                f"config file these come from that file only ({', '.join(_FILE_OVERRIDES_FIELDS)}). Remove them "
                "from the accelerate config file and set them in the DeepSpeed config file instead.")

    # ---- accelerate's queries and fills ------------------------------------------------------
    def get_value(self, ds_key_long: str, default=None):
        return get_value(self.deepspeed_config, ds_key_long, default)

    def is_auto(self, ds_key_long: str) -> bool:
        return self.get_value(ds_key_long) == AUTO

    def fill_match(self, ds_key_long: str, mismatches=None, must_match: bool = True, **kwargs):
        """accelerate's fill_match: an "auto" value at ds_key_long takes kwargs[ds_key_long] (an
        "auto" with no value given is an error); with must_match, a concrete value differing from
        the given one is appended to `mismatches`."""
        mismatches = [] if mismatches is None else mismatches
        node_path, _, key = ds_key_long.rpartition(".")
        node = get_value(self.deepspeed_config, node_path) if node_path else self.deepspeed_config
        if not isinstance(node, dict):
            return
        if node.get(key) == AUTO:
            if ds_key_long not in kwargs:
                raise ValueError(f"DeepSpeed config: {ds_key_long} is 'auto' and nothing fills it; set a value for it "
                                 "in the DeepSpeed config")
            node[key] = kwargs[ds_key_long]
            return
        if must_match and node.get(key) is not None and ds_key_long in kwargs and node[key] != kwargs[ds_key_long]:
            mismatches.append(f"- ds {ds_key_long}={node[key]} vs arg {ds_key_long}={kwargs[ds_key_long]}")

    def deepspeed_config_process(self, prefix: str = "", mismatches=None, config=None, must_match: bool = True,
                                 **kwargs):
        """Fills every "auto" of the config from kwargs (dotted key paths), as accelerate does."""
        top = mismatches is None
        mismatches = [] if mismatches is None else mismatches
        for key, value in (self.deepspeed_config if config is None else config).items():
            if isinstance(value, dict):
                self.deepspeed_config_process(prefix + key + ".", mismatches, value, must_match, **kwargs)
            else:
                self.fill_match(prefix + key, mismatches, must_match=must_match, **kwargs)
        if top and mismatches:
            raise ValueError("DeepSpeed config values disagree with the arguments given:\n" + "\n".join(mismatches)
                             + "\nSet these DeepSpeed config values to 'auto' to take the arguments' values.")

    def set_mixed_precision(self, mixed_precision: str):
        """accelerate's rules for the Accelerator's mixed precision against the config (also
        the Accelerator's path: config_dict.apply_mixed_precision)."""
        apply_mixed_precision(self.deepspeed_config, mixed_precision, self.config_file)

    def is_zero3_init_enabled(self) -> bool:
        return self.zero3_init_flag


def _is_named(obj, name: str) -> bool:
    """obj is an instance of accelerate_c's or accelerate's class called `name` (accelerate need
    not be importable: its class is recognised by name and package)."""
    return any(base.__name__ == name and base.__module__.split(".")[0] in ("accelerate", "accelerate_c")
               for base in type(obj).__mro__)


def is_dummy_optim(obj) -> bool:
    return _is_named(obj, "DummyOptim")


def is_dummy_scheduler(obj) -> bool:
    return _is_named(obj, "DummyScheduler")


def is_deepspeed_plugin(obj) -> bool:
    return _is_named(obj, "DeepSpeedPlugin")


class DummyOptim:
    """Stands for the optimizer a DeepSpeed config's `optimizer` block describes: pass it to
    `prepare()` and get back the real optimizer built from the block (accelerate's signature).
    `lr` and `weight_decay` fill the block's "auto" values."""

    def __init__(self, params, lr=0.001, weight_decay=0, **kwargs):
        self.params = params
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands for the scheduler a DeepSpeed config's `scheduler` block describes (accelerate's
    signature). `total_num_steps` and `warmup_num_steps` fill the block's "auto" values; without
    a block, `lr_scheduler_callable(optimizer)` builds the scheduler."""

    def __init__(self, optimizer, total_num_steps=None, warmup_num_steps=0, lr_scheduler_callable=None, **kwargs):
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs
