"""Process settings that benchmarks apply alike to every contender: glibc's malloc settings.

glibc reads its MALLOC_*_ variables (and GLIBC_TUNABLES) once, at process start, and mallopt()
changes the whole process, so contenders compared "like with like" run in child processes
started with the same environment:

  defaults  no malloc setting at all: the MALLOC_* variables and GLIBC_TUNABLES' glibc.malloc.*
            entries of this environment removed, ACCELERATE_C_MALLOC_TUNING=0
  tuned     the same, plus the MALLOC_*_ equivalents of accelerate_c's opt-in settings
            (accelerate_c.host_malloc.GLIBC_ENV) for every contender, torch and accelerate
            included; accelerate_c's own mallopt stays off (ACCELERATE_C_MALLOC_TUNING=0), so
            it gets exactly what the others get
"""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

from accelerate_c import host_malloc

SETTINGS = ("defaults", "tuned")


def process_env(setting: str, base: Dict[str, str] = None) -> Dict[str, str]:
    """The environment of a contender's process under `setting`."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown process setting {setting!r}; expected one of {SETTINGS}")
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("MALLOC_")}
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith("glibc.malloc.")]
    if tunables:
        env["GLIBC_TUNABLES"] = ":".join(tunables)
    if setting == "tuned":
        env.update({k: str(v) for k, v in host_malloc.GLIBC_ENV.items()})
    env[host_malloc.ENV] = "0"
    return env


def removed_from_environment() -> List[str]:
    """What of this process's environment the settings leave out (for a note in the output)."""
    out = [f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_")]
    out += [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":") if t.startswith("glibc.malloc.")]
    if os.environ.get(host_malloc.ENV, "0").strip() not in ("", "0"):
        out.append(f"{host_malloc.ENV}={os.environ[host_malloc.ENV]}")
    return out


def describe(setting: str) -> str:
    if setting == "defaults":
        return "glibc's default malloc settings for every contender"
    return ("every contender started with " + " ".join(f"{k}={v}" for k, v in host_malloc.GLIBC_ENV.items())
            + " (what accelerate_c's opt-in sets with mallopt; its own mallopt off)")


def parse(text: str) -> Tuple[str, ...]:
    """--settings: a comma-separated subset of SETTINGS, in SETTINGS' order."""
    asked = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in asked if s not in SETTINGS]
    if bad or not asked:
        raise ValueError(f"--settings: expected a comma-separated subset of {', '.join(SETTINGS)}; got {text!r}")
    return tuple(s for s in SETTINGS if s in asked)
