"""Config files: where they live, reading (YAML or JSON), validation against the schema, writing.

The files are accelerate's: same location (`$HF_HOME/accelerate/default_config.yaml`, HF_HOME
defaulting to `$XDG_CACHE_HOME/huggingface`, then `~/.cache/huggingface`), same keys (those of
accelerate 1.15's ClusterConfig, see utils/config_schema.py), so a file written by accelerate
runs here and the reverse. Unlike accelerate, an unknown key, a value of the wrong type or out of
range is an error naming the file, the key and the allowed values, and a value accelerate_c
cannot run yet is refused at launch instead of being ignored.
"""
from __future__ import annotations

import json
import os
import re

from .config_schema import (
    ANY,
    CLUSTER_KEYS,
    DYNAMO_BACKENDS,
    PLANNED_DISTRIBUTED_TYPES,
    SUPPORTED_DISTRIBUTED_TYPES,
    Key,
)


class ConfigError(ValueError):
    """A config file that cannot be read or that breaks the schema."""


class ConfigNotSupportedError(ConfigError, NotImplementedError):
    """A valid config that asks for a feature accelerate_c does not have yet."""


def hf_home() -> str:
    """accelerate's rule: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    return os.path.expanduser(
        os.environ.get("HF_HOME", os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")))


def cache_dir() -> str:
    return os.path.join(hf_home(), "accelerate")


def default_config_file() -> str:
    """Where `accelerate config` / `accelerate-c config` write by default (read at call time, so a
    changed HF_HOME is honoured)."""
    return os.path.join(cache_dir(), "default_config.yaml")


# ---------------------------------------------------------------- reading


def read_config_file(path: str) -> dict:
    """The file's mapping, parsed as JSON for *.json, else as YAML (which also reads the JSON that
    `accelerate config default` writes into default_config.yaml)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} does not exist (create one with `accelerate-c config` or "
                          "`accelerate-c config default`, or pass an existing file with --config_file)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} cannot be read: {e}") from None
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        kind = "JSON" if path.endswith(".json") else "YAML"
        raise ConfigError(f"config file {path} is not valid {kind}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values, got "
                          f"{'nothing' if data is None else type(data).__name__}")
    return data


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, dict):
        return "dict"
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "strlist"
    if isinstance(value, (list, tuple)) and all(isinstance(v, bool) for v in value):
        return "boollist"
    return type(value).__name__


def _check(key: Key, value, where: str, path: str):
    """The value, normalised, or ConfigError naming file, key and allowed values."""
    def fail(why):
        raise ConfigError(f"config file {path}: key '{where}': {why}; allowed: {key.describe()}")

    if value is None:
        if key.nullable:
            return None
        fail("null is not allowed")
    if value is False and "bool" not in key.types and key.choices is not None:
        # YAML 1.1 reads an unquoted `no`/`NO` as false: take it as the choice it spells
        value = next((c for c in key.choices if isinstance(c, str) and c.lower() == "no"), value)
    kind = _kind(value)
    if kind == "int" and "int" not in key.types and "float" in key.types:
        kind = "float"
    if kind not in key.types:
        fail(f"got {value!r} ({'list' if isinstance(value, list) else kind})")
    if kind == "dict":
        return _check_mapping(value, key.sub or {}, where, path, key.sub_prefix)
    if kind == "strlist":
        return list(value)
    if kind == "str" and key.pattern is not None:
        if not re.fullmatch(key.pattern, value):
            fail(f"got {value!r}")
        return value
    if kind == "str" and key.choices is not None and value not in key.choices:
        # accelerate upper/lower-cases several of these before use: accept any case, keep the canonical one
        value = next((c for c in key.choices if isinstance(c, str) and c.lower() == value.lower()), value)
    if kind == "boollist":
        return list(value)
    if key.choices is not None and (kind, value) not in {(_kind(c), c) for c in key.choices}:
        fail(f"got {value!r}")
    if kind in ("int", "float"):
        if (key.lo is not None and value < key.lo) or (key.hi is not None and value > key.hi):
            fail(f"{value!r} is out of range")
    return value


def _check_mapping(data: dict, schema: dict, where: str, path: str, prefix: str = "") -> dict:
    out = {}
    for name, value in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"config file {path}: key {name!r} in '{where or 'top level'}' is not a string")
        # accelerate's launcher prefixes fsdp_config/fp8_config/dynamo_config keys that lack it
        full = name if not prefix or name.startswith(prefix.rstrip("_")) else prefix + name
        dotted = f"{where}.{name}" if where else name
        if full not in schema:
            raise ConfigError(f"config file {path}: unknown key '{dotted}'; known keys"
                              f"{' in ' + where if where else ''}: {', '.join(sorted(schema))}")
        out[name] = _check(schema[full], value, dotted, path)
    return out


def _legacy(data: dict, path: str) -> dict:
    """The conversions accelerate applies to older files (process_config)."""
    data = dict(data)
    if "fp16" in data:
        fp16 = data.pop("fp16")
        if not isinstance(fp16, bool):
            raise ConfigError(f"config file {path}: key 'fp16' (old spelling of mixed_precision): got {fp16!r}; "
                              "allowed: true/false")
        if "mixed_precision" not in data:
            data["mixed_precision"] = "fp16" if fp16 else None
    if "dynamo_backend" in data:
        backend = data.pop("dynamo_backend")
        backend = "NO" if backend is False else backend  # unquoted NO in YAML 1.1
        if not isinstance(backend, str) or backend.upper() not in DYNAMO_BACKENDS:
            raise ConfigError(f"config file {path}: key 'dynamo_backend': got {backend!r}; allowed: one of "
                              + ", ".join(repr(b) for b in DYNAMO_BACKENDS))
        data.setdefault("dynamo_config", {} if backend.upper() == "NO" else {"dynamo_backend": backend.upper()})
    if isinstance(data.get("mixed_precision"), str):
        data["mixed_precision"] = data["mixed_precision"].lower()
    if isinstance(data.get("gpu_ids"), int) and not isinstance(data.get("gpu_ids"), bool):
        data["gpu_ids"] = str(data["gpu_ids"])
    return data


def validate(data: dict, path: str = "<config>") -> dict:
    """All ClusterConfig keys, checked and with accelerate's defaults filled in."""
    data = _legacy(data, path)
    if "distributed_type" not in data:
        raise ConfigError(f"config file {path}: key 'distributed_type' is missing; allowed: "
                          f"{CLUSTER_KEYS['distributed_type'].describe()}")
    if data.get("compute_environment") == "AMAZON_SAGEMAKER":
        raise ConfigNotSupportedError(f"config file {path}: compute_environment AMAZON_SAGEMAKER: launching on "
                                      "Amazon SageMaker is not supported yet by accelerate_c (supported: "
                                      "LOCAL_MACHINE)")
    checked = _check_mapping(data, CLUSTER_KEYS, "", path)
    values = {name: key.default for name, key in CLUSTER_KEYS.items()}
    if checked["distributed_type"] == "NO":
        values["num_processes"] = 1
    values.update(checked)
    for name, key in CLUSTER_KEYS.items():
        if "dict" in key.types and values[name] is None:
            values[name] = {}
    if values["machine_rank"] >= values["num_machines"]:
        raise ConfigError(f"config file {path}: key 'machine_rank': {values['machine_rank']} is out of range; "
                          f"allowed: 0 to num_machines - 1 = {values['num_machines'] - 1}")
    if values["num_processes"] == 0:
        raise ConfigError(f"config file {path}: key 'num_processes': 0 is out of range; allowed: an integer >= 1 "
                          "(or -1: pass --num_processes at launch)")
    return values


def unsupported(values: dict, path: str = "<config>") -> list:
    """One message per value that accelerate_c cannot run yet (empty: the config runs)."""
    out = []
    dt = values["distributed_type"]
    if dt not in SUPPORTED_DISTRIBUTED_TYPES:
        if dt in PLANNED_DISTRIBUTED_TYPES:
            what = {"FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM"}[dt]
            out.append(f"distributed_type {dt}: {what} is not supported yet by accelerate_c")
        else:
            out.append(f"distributed_type {dt}: this hardware is not supported by accelerate_c, which runs on "
                       "CPUs and CUDA GPUs")
        out[-1] += f" (supported: {', '.join(SUPPORTED_DISTRIBUTED_TYPES)})"
    for name, key in CLUSTER_KEYS.items():
        if name == "distributed_type":
            continue
        value = values[name]
        if name == "deepspeed_config" and dt != "DEEPSPEED":
            continue  # read only under DEEPSPEED, as accelerate's launcher does
        if key.sub is not None and key.supported is ANY:
            for sub_name, sub_value in value.items():
                full = sub_name if sub_name.startswith(key.sub_prefix.rstrip("_")) else key.sub_prefix + sub_name
                sub_key = key.sub[full]
                if sub_key.supported is not ANY and _norm(sub_value) not in sub_key.supported:
                    out.append(f"{name}.{sub_name}={sub_value!r}: {sub_key.feature} is not supported yet by "
                               f"accelerate_c (supported: {', '.join(map(repr, sub_key.supported))})")
            continue
        if key.supported is ANY or value in key.supported:
            continue
        if key.sub is not None:
            out.append(f"{name}: {key.feature} is not supported yet by accelerate_c (leave {name} empty)")
        else:
            out.append(f"{name}={value!r}: {key.feature} is not supported yet by accelerate_c (supported: "
                       f"{', '.join(map(repr, key.supported))})")
    return out


def _norm(v):
    return v.upper() if isinstance(v, str) else v


class ClusterConfig:
    """A validated config file: attribute access to every key (defaults filled in)."""

    def __init__(self, values: dict, path: str | None = None, raw: dict | None = None):
        self.__dict__["values"] = values
        self.__dict__["path"] = path
        self.__dict__["raw"] = raw if raw is not None else to_file_dict(values)

    def __getattr__(self, name):
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("ClusterConfig is read-only; build a new one from a dict")

    def unsupported(self) -> list:
        return unsupported(self.values, self.path or "<config>")

    def to_dict(self) -> dict:
        return to_file_dict(self.values)


def load_config_from_file(path: str | None = None) -> ClusterConfig:
    """The config at `path` (default: the default location), validated; ConfigError otherwise."""
    path = default_config_file() if path is None else path
    raw = read_config_file(path)
    return ClusterConfig(validate(raw, path), path, raw)


def config_in_effect(config_file: str | None) -> str | None:
    """The file a command should read: --config_file, else the default one if it exists."""
    if config_file is not None:
        return config_file
    default = default_config_file()
    return default if os.path.isfile(default) else None


# ---------------------------------------------------------------- writing


def to_file_dict(values: dict) -> dict:
    """What accelerate writes: nulls and empty mappings are left out."""
    return {k: v for k, v in values.items() if v is not None and not (isinstance(v, dict) and not v)}


def write_config_file(values: dict, path: str, as_json: bool | None = None, overwrite: bool = False) -> str:
    """Validates `values` and writes them (JSON when as_json, or for *.json; YAML otherwise).
    An existing file is replaced only when overwrite=True; the write is atomic."""
    import yaml

    validate(values, path)
    data = to_file_dict(values)
    if as_json is None:
        as_json = path.endswith(".json")
    text = json.dumps(data, indent=2, sort_keys=True) + "\n" if as_json else yaml.safe_dump(data)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if not overwrite:
        with open(path, "x", encoding="utf-8") as f:  # "x": never clobber a file created meanwhile
            f.write(text)
        return path
    from ..durable import write_bytes_durable

    write_bytes_durable(path, text.encode("utf-8"))
    return path
