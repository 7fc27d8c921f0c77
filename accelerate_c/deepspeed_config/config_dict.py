"""Operations on a DeepSpeed config dict that the plugin and the Accelerator's checks share:
dotted key paths, "auto" values, and the mixed-precision rules between the Accelerator's
`mixed_precision` and the config's fp16/bf16 sections."""
from __future__ import annotations

AUTO = "auto"


def where(source: str | None) -> str:
    """" <file>" for messages about a config that came from a file, else ""."""
    return f" {source}" if source else ""


def get_value(config: dict, path: str, default=None):
    """The value at a dotted key path ("zero_optimization.stage"), or default."""
    node = config
    *parents, key = path.split(".")
    for name in parents:
        node = node.get(name) if isinstance(node, dict) else None
        if node is None:
            return default
    return node.get(key, default) if isinstance(node, dict) else default


def fill_auto(config: dict, path: str, value) -> bool:
    """Replaces the value at `path` by `value` when it is "auto"; whether it did."""
    node = config
    *parents, key = path.split(".")
    for name in parents:
        node = node.get(name) if isinstance(node, dict) else None
        if node is None:
            return False
    if isinstance(node, dict) and node.get(key) == AUTO:
        node[key] = value
        return True
    return False


def auto_paths(config: dict, prefix: str = "") -> list:
    """Every dotted key path whose value is still "auto", in the config's order."""
    out = []
    for key, value in config.items():
        if isinstance(value, dict):
            out += auto_paths(value, f"{prefix}{key}.")
        elif value == AUTO:
            out.append(prefix + key)
    return out


def apply_mixed_precision(config: dict, mixed_precision: str, source: str | None = None) -> None:
    """accelerate's rules (DeepSpeedPlugin.set_mixed_precision), applied in place: the
    Accelerator's mode adds its section when the config has none, fills `enabled: "auto"`, and
    may not contradict a section the config enables; absent sections read as disabled."""
    mp = str(mixed_precision)
    if mp == "fp16" and "fp16" not in config:
        config["fp16"] = {"enabled": True, "auto_cast": True}
    elif mp in ("bf16", "fp8") and "bf16" not in config:  # fp8 runs under bf16 autocast in accelerate
        config["bf16"] = {"enabled": True}
    if mp != "no":
        other = "bf16" if mp == "fp16" else "fp16"
        section = config.get(other)
        if isinstance(section, dict) and str(section.get("enabled", False)).lower() == "true":
            raise ValueError(f"mixed_precision={mp!r} (Accelerator argument, --mixed_precision or the config file) "
                             f"contradicts the DeepSpeed config{where(source)}, which enables {other} "
                             f"({other}.enabled=true); use one of them, or set {other}.enabled to \"auto\"")
    for dtype in ("fp16", "bf16"):
        config.setdefault(dtype, {"enabled": False})
    fill_auto(config, "fp16.enabled", mp == "fp16")
    fill_auto(config, "bf16.enabled", mp in ("bf16", "fp8"))


def mixed_precision_of(config: dict, source: str | None = None) -> str:
    """The mode a config trains in, as accelerate reports it under DeepSpeed: its enabled
    section wins over the Accelerator's argument."""
    fp16 = get_value(config, "fp16.enabled", False) is True
    bf16 = get_value(config, "bf16.enabled", False) is True
    if fp16 and bf16:
        raise ValueError(f"DeepSpeed config{where(source)}: fp16.enabled and bf16.enabled are both true; DeepSpeed "
                         "trains in one of them (set the other to false)")
    return "fp16" if fp16 else ("bf16" if bf16 else "no")
