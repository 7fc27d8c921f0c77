"""The directory conventions the checkpoint writer (checkpointing.py) and reader
(checkpoint_load.py) share: the completion marker ``checkpoint.json`` and its format, how files
of the i-th object are named, which ``checkpoint_<n>`` directories count as complete, and what
a data loader's position is. See docs/checkpoints.md.
"""
from __future__ import annotations

import os
import re
from typing import List

import torch

from .data_loader import get_sampler
from .state_io import CheckpointError, read_json

MARKER = "checkpoint.json"
CHECKPOINT_FORMAT = "accelerate_c.checkpoint"
CHECKPOINT_VERSION = 1
AUTO_NAME_RE = re.compile(r"^checkpoint_(\d+)$")
OURS_RE = re.compile(r"^(optimizer(_\d+)?|scheduler(_\d+)?|scaler|random_states_\d+|dataloader_\d+|"
                      r"custom_checkpoint_\d+)\.json$")


def suffix(i: int) -> str:
    return "" if i == 0 else f"_{i}"


# ---- finding checkpoints ----------------------------------------------------------------------------------
def has_our_files(directory: str) -> bool:
    try:
        return any(OURS_RE.match(e) for e in os.listdir(directory))
    except OSError:
        return False


def refuse_links_out(directory: str) -> None:
    """A checkpoint is read from its directory only: an entry that is a symbolic link resolving
    outside it (an absolute link, or a relative one climbing out) is refused before any file is
    opened, so a checkpoint from elsewhere cannot make load_state read another file of this
    machine. Links inside the directory, and a directory that is itself a link, are fine."""
    root = os.path.realpath(directory)
    for here, dirs, files in os.walk(directory):
        for name in dirs + files:
            p = os.path.join(here, name)
            if os.path.islink(p):
                real = os.path.realpath(p)
                if real != root and not real.startswith(root + os.sep):
                    raise CheckpointError(f"{p}: a symbolic link to {real}, outside the checkpoint directory "
                                          f"{directory}; copy the file into the checkpoint instead")


def read_marker(directory: str) -> dict:
    path = os.path.join(directory, MARKER)
    doc = read_json(path, "the completion marker")
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT or not isinstance(doc.get("files"), dict):
        raise CheckpointError(f"{path}: not an accelerate_c checkpoint marker")
    if not isinstance(doc.get("version"), int) or doc["version"] > CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {doc.get('version')!r} is newer than this "
                              f"accelerate_c reads ({CHECKPOINT_VERSION})")
    return doc


def is_complete(directory: str) -> bool:
    if os.path.isfile(os.path.join(directory, MARKER)):
        try:
            read_marker(directory)
            return True
        except (CheckpointError, OSError):
            return False
    # accelerate's own checkpoint: it writes random_states_0.pkl after everything but custom objects
    return os.path.isfile(os.path.join(directory, "random_states_0.pkl")) and not has_our_files(directory)


def complete_checkpoints(base: str) -> List[tuple]:
    """[(i, path)] of the complete ``checkpoint_{i}`` directories under ``base``, oldest first."""
    out = []
    if not os.path.isdir(base):
        return out
    for entry in os.listdir(base):
        m = AUTO_NAME_RE.match(entry)
        path = os.path.join(base, entry)
        if m and os.path.isdir(path) and is_complete(path):
            out.append((int(m.group(1)), path))
    out.sort()
    return out


def sampler_of(dl):
    getter = getattr(dl, "get_sampler", None)
    if callable(getter):
        return getter()
    return get_sampler(dl)


def loader_state(dl) -> dict:
    """Where a data loader stands: the epoch under way or next (its `iteration`, what set_epoch()
    is called with at an epoch's start), the batches of that epoch already handed out and whether
    one is under way (`mid_epoch`; a prepared loader's resume_position()), its seedable sampler's
    epoch and seed, and the state of a sampler's own generator. The batches already consumed in
    the current epoch are skipped by the user with skip_first_batches, as in accelerate. (The
    RNG states as they were at that epoch's start differ by process: they go to each process's
    random_states file.)"""
    position = getattr(dl, "resume_position", None)
    if callable(position):
        pos = position()
        st = {"iteration": pos["iteration"], "batches_seen": pos["batches_seen"], "mid_epoch": pos["mid_epoch"]}
    else:
        st = {"iteration": int(getattr(dl, "iteration", 0))}
        for attr in ("batches_seen", "_batches_seen"):
            if isinstance(getattr(dl, attr, None), int):
                st["batches_seen"] = getattr(dl, attr)
    sampler = sampler_of(dl)
    if sampler is not None:
        st["sampler"] = type(sampler).__name__
        for attr in ("epoch", "initial_seed"):
            if isinstance(getattr(sampler, attr, None), int):
                st[f"sampler_{attr}"] = int(getattr(sampler, attr))
        g = getattr(sampler, "generator", None)
        if isinstance(g, torch.Generator) and g.device.type == "cpu":
            st["sampler_generator"] = g.get_state()
    sg = getattr(dl, "synchronized_generator", None)
    if isinstance(sg, torch.Generator) and sg.device.type == "cpu" and sg is not getattr(sampler, "generator", None):
        st["synchronized_generator"] = sg.get_state()
    return st
