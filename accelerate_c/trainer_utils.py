"""The Trainer's helpers that need no Trainer: where its checkpoints are, how samples become
batches, and how evaluation outputs are gathered into arrays (trainer.py is the loop)."""
from __future__ import annotations

import os
import re

import torch

PREFIX_CHECKPOINT_DIR = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
CHECKPOINT_RE = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"-(\d+)$")


def get_last_checkpoint(folder: str) -> str | None:
    """The `checkpoint-N` folder in `folder` with the largest N among complete ones (those
    holding trainer_state.json, which is written last), or None."""
    if not os.path.isdir(folder):
        return None
    found = []
    for name in os.listdir(folder):
        m = CHECKPOINT_RE.match(name)
        path = os.path.join(folder, name)
        if m and os.path.isdir(path) and os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)):
            found.append((int(m.group(1)), path))
    return max(found)[1] if found else None


def sorted_checkpoints(folder: str) -> list:
    out = []
    for name in os.listdir(folder) if os.path.isdir(folder) else []:
        m = CHECKPOINT_RE.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            out.append((int(m.group(1)), os.path.join(folder, name)))
    return [p for _, p in sorted(out)]


# ---------------------------------------------------------------------- batches


def default_data_collator(features):
    """Stacks a list of samples: dicts become a dict of tensors ("label"/"label_ids" become
    "labels"), anything else goes through torch's default_collate."""
    from torch.utils.data import default_collate

    if not features or not isinstance(features[0], dict):
        return default_collate(features)
    first = features[0]
    batch = {}
    for src, dst in (("label", "labels"), ("label_ids", "labels")):
        if src in first and first[src] is not None:
            batch[dst] = torch.as_tensor([f[src] for f in features]) if not torch.is_tensor(first[src]) \
                else torch.stack([f[src] for f in features])
    for k, v in first.items():
        if k in ("label", "label_ids") or v is None or isinstance(v, str):
            continue
        if torch.is_tensor(v):
            batch[k] = torch.stack([f[k] for f in features])
        else:
            batch[k] = torch.as_tensor([f[k] for f in features])
    return batch


class RemoveColumnsCollator:
    """Drops the keys of dict samples that the model's forward does not take."""

    def __init__(self, collator, keep):
        self.collator, self.keep = collator, keep

    def __call__(self, features):
        if features and isinstance(features[0], dict):
            features = [{k: v for k, v in f.items() if k in self.keep} for f in features]
        return self.collator(features)


def cat_padded(tensors):
    """Concatenates along dim 0, padding dim 1 with -100 when lengths differ (token outputs)."""
    if len({t.shape[1:] for t in tensors}) > 1:
        width = max(t.shape[1] for t in tensors)
        tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, width - t.shape[1]), value=-100)
                   for t in tensors]
    return torch.cat(tensors, dim=0)


def to_numpy(x):
    if isinstance(x, (tuple, list)):
        return type(x)(to_numpy(t) for t in x)
    return x.float().numpy() if x.dtype in (torch.bfloat16, torch.float16) else x.numpy()


def output_field(outputs, key):
    if isinstance(outputs, dict):
        return outputs.get(key)
    return getattr(outputs, key, None)


def batch_size_of(inputs) -> int:
    if isinstance(inputs, dict):
        inputs = next(v for v in inputs.values() if torch.is_tensor(v))
    elif isinstance(inputs, (list, tuple)):
        inputs = inputs[0]
    return int(inputs.shape[0]) if torch.is_tensor(inputs) and inputs.dim() > 0 else 1


def detach_cpu(x):
    if isinstance(x, (tuple, list)):
        return type(x)(detach_cpu(t) for t in x)
    return x.detach().cpu()


def pad_tokens(acc, x):
    if isinstance(x, (tuple, list)):
        return type(x)(pad_tokens(acc, t) for t in x)
    if torch.is_tensor(x) and x.dim() >= 2:
        return acc.pad_across_processes(x, dim=1, pad_index=-100)
    return x


def concat_nested(chunks):
    if isinstance(chunks[0], (tuple, list)):
        return type(chunks[0])(concat_nested([c[i] for c in chunks]) for i in range(len(chunks[0])))
    return cat_padded(chunks) if chunks[0].dim() > 0 else torch.stack(chunks)


def is_causal_lm(model) -> bool:
    """Whether transformers' Trainer shifts `model`'s labels for label smoothing: its class is one
    of transformers' causal language models (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, the table
    transformers looks the class name up in: GPT2LMHeadModel is one, a custom *ForCausalLM is not).
    Without transformers installed, a class named *ForCausalLM with a config."""
    name = model._get_name() if hasattr(model, "_get_name") else type(model).__name__
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return name.endswith("ForCausalLM") and hasattr(model, "config")
    return name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def label_smoothed_loss(outputs, labels, epsilon: float, shift: bool = False, ignore_index: int = -100):
    """Cross-entropy with label smoothing `epsilon`, as transformers' Trainer computes it: (1 -
    epsilon) x the mean negative log-likelihood of the labels plus epsilon x the mean over the
    vocabulary of the negative log-probabilities, both averaged over the positions whose label
    is not `ignore_index`. `shift`: position t predicts label t + 1 (causal LMs)."""
    logits = output_field(outputs, "logits")
    if logits is None:
        logits = outputs[0]
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    neg_log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)
    if labels.dim() == neg_log_probs.dim() - 1:
        labels = labels.unsqueeze(-1)
    ignored = labels.eq(ignore_index)
    nll = neg_log_probs.gather(dim=-1, index=labels.clamp(min=0)).masked_fill(ignored, 0.0)
    spread = neg_log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(ignored, 0.0)
    active = ignored.numel() - ignored.long().sum()
    return (1 - epsilon) * nll.sum() / active + epsilon * spread.sum() / (active * neg_log_probs.shape[-1])


def tracker_config(args) -> dict:
    """TrainingArguments as a tracker's run configuration: the fields whose values are plain
    (numbers, strings, booleans), others as their str(), None dropped, as transformers'
    to_sanitized_dict gives its integrations."""
    config = {}
    for key, value in args.to_dict().items():
        if value is None:
            continue
        config[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return config
