"""A checkpoint of accelerate_c's save_state rewritten in accelerate's own save_state layout, for
a user who goes back to accelerate (`accelerate-c convert-checkpoint DIR --to accelerate`).

accelerate's names (its checkpointing.save_accelerator_state): the models' `model.safetensors`,
`model_1.safetensors`, ... (or `pytorch_model*.bin`) as they are; `optimizer.bin`,
`optimizer_1.bin`, `scheduler.bin`, ..., `scaler.pt`, `random_states_<rank>.pkl` and
`custom_checkpoint_<i>.pkl` as torch.save files of the same state dicts (which accelerate's
load_state reads with torch.load), and a stateful data loader's state as its
`dl_state_dict{_i}.bin` (the main process's). The other data loaders' positions have no file in
accelerate's layout (it records none): they are left out, and a resumed accelerate run skips the consumed
batches itself (skip_first_batches), as with its own checkpoints. A checkpoint sharded under ZeRO
is refused: `accelerate-c merge-weights` gives its consolidated weights.

The result is written in a hidden sibling directory and renamed into place when complete.
"""
from __future__ import annotations

import os
import re
import shutil
import uuid

import torch

from .checkpoint_layout import MARKER, read_marker, refuse_links_out
from .durable import fsync_dir
from .state_io import CheckpointError, StateFile
from .zero_checkpoint import PLAN_FILE

_MODEL = re.compile(r"^(model(_\d+)?\.safetensors|pytorch_model(_\d+)?\.bin)$")
# our state file stem -> accelerate's file name for it
_STATES = [(re.compile(r"^(optimizer|scheduler)(_\d+)?$"), "{}.bin"), (re.compile(r"^scaler$"), "{}.pt"),
           (re.compile(r"^(random_states|custom_checkpoint)_\d+$"), "{}.pkl")]
_PICKLED = re.compile(r"^((optimizer|scheduler)(_\d+)?\.bin|scaler\.pt|(random_states|custom_checkpoint)_\d+\.pkl)$")


def _accelerate_name(stem: str):
    for pattern, name in _STATES:
        if pattern.match(stem):
            return name.format(stem)
    return None


def _stateful_loader_files(src: str, files: dict, tmp: str) -> list:
    """accelerate's dl_state_dict{_i}.bin for each stateful data loader: the main process's
    state_dict() (accelerate keeps one file, whichever process wrote it last)."""
    if "random_states_0.json" not in files:
        return []
    states = StateFile(src, "random_states_0", "random_states_0.json").load().get("dataloader_state_dict") or []
    out = []
    for i, sd in enumerate(states):
        if sd is not None:
            name = "dl_state_dict.bin" if i == 0 else f"dl_state_dict_{i}.bin"
            torch.save(sd, os.path.join(tmp, name))
            out.append(name)
    return out


def to_accelerate(src: str, dst: str) -> tuple:
    """Writes dst from the complete checkpoint src; returns (files written, files left out)."""
    src, dst = os.fspath(src), os.fspath(dst)
    if os.path.exists(dst):
        raise FileExistsError(f"convert-checkpoint: {dst} exists; choose a new output directory")
    if not os.path.isdir(src):
        raise FileNotFoundError(f"convert-checkpoint: {src} is not a directory")
    refuse_links_out(src)
    if not os.path.isfile(os.path.join(src, MARKER)):
        already = os.path.isfile(os.path.join(src, "random_states_0.pkl"))
        raise CheckpointError(f"{src}: no {MARKER}, so not a complete accelerate_c checkpoint"
                              + (" (it has accelerate's own files: it is in accelerate's layout already)" if already
                                 else " (a save_state cut short leaves none)"))
    files = read_marker(src)["files"]  # a complete accelerate_c checkpoint, or CheckpointError
    if PLAN_FILE in files:
        raise CheckpointError(f"{src}: saved under ZeRO, with the optimizer state sharded across processes, which "
                              "accelerate's layout has no place for; `accelerate-c merge-weights` writes its "
                              "consolidated model weights")
    parent = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(parent, f".{os.path.basename(dst)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    written, left_out = [], []
    try:
        for name in sorted(files):
            stem, ext = os.path.splitext(name)
            if _MODEL.match(name) or _PICKLED.match(name):
                shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
                written.append(name)
            elif ext == ".json" and _accelerate_name(stem):
                target = _accelerate_name(stem)
                torch.save(StateFile(src, stem, name).load(), os.path.join(tmp, target))
                written.append(target)
            elif ext == ".safetensors" and _accelerate_name(stem):
                continue  # the tensors of a state file, now inside its torch.save file
            else:
                left_out.append(name)  # data loader positions: no such file in accelerate's layout
        written += _stateful_loader_files(src, files, tmp)
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(tmp)
        os.rename(tmp, dst)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written, left_out
