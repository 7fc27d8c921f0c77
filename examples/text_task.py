"""Shared by the text-classification examples (nlp_example.py, by_feature/): a task the
repository generates and a small transformer built from a config, so every example runs here on
CPU without downloads.

The task: sentences of examples/tiny_corpus.py's grammar, as characters; the label says whether
the sentence ends with a place ("... in the park.", "... by the sea."). The model: transformers'
BertForSequenceClassification from a BertConfig of a few layers (trained from scratch)."""
from __future__ import annotations

import os
import random
import sys

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_corpus import PLACES, sentence  # noqa: E402

PAD = 0
CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz .:"))
VOCAB = len(CHARS) + 1  # 0 is padding


def _encode(text: str, seq_len: int) -> list:
    ids = [CHARS.index(c) + 1 for c in text[:seq_len]]
    return ids + [PAD] * (seq_len - len(ids))


def make_dataset(n: int, seq_len: int = 48, seed: int = 0) -> TensorDataset:
    """n labelled sentences: (input_ids, attention_mask, labels), half of each label."""
    rng = random.Random(seed)
    texts, labels = [], []
    while len(texts) < n:
        s = sentence(rng)
        if s.startswith("count:"):
            continue
        label = int(any(s.endswith(p + ".") for p in PLACES))
        if labels.count(label) >= (n + 1) // 2:
            continue
        texts.append(s)
        labels.append(label)
    ids = torch.tensor([_encode(t, seq_len) for t in texts])
    return TensorDataset(ids, (ids != PAD).long(), torch.tensor(labels))


def make_model(seed: int = 0, hidden: int = 64, layers: int = 2, seq_len: int = 48):
    """A small BERT classifier from a config (no pretrained weights)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=2 * hidden, max_position_embeddings=seq_len, num_labels=2,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=PAD)
    return BertForSequenceClassification(config)


def batch_dict(batch) -> dict:
    ids, mask, labels = batch
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def evaluate(accelerator, model, loader) -> dict:
    """Accuracy and F1 over the whole evaluation set, gathered from every process
    (gather_for_metrics drops the samples repeated to even out the last batch)."""
    model.eval()
    preds, refs = [], []
    with torch.no_grad():
        for batch in loader:
            logits = model(**batch_dict(batch)).logits
            p, r = accelerator.gather_for_metrics((logits.argmax(-1), batch[2]))
            preds.append(p)
            refs.append(r)
    model.train()
    preds, refs = torch.cat(preds), torch.cat(refs)
    tp = int(((preds == 1) & (refs == 1)).sum())
    precision = tp / max(1, int((preds == 1).sum()))
    recall = tp / max(1, int((refs == 1).sum()))
    return {"accuracy": float((preds == refs).float().mean()), "f1": 2 * precision * recall / max(1e-12, precision + recall),
            "count": len(refs)}


def add_arguments(parser):
    """The arguments every text-classification example takes (small defaults: minutes on 2 CPU cores)."""
    parser.add_argument("--mixed_precision", default=None, choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--num_epochs", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--train_size", type=int, default=1200)
    parser.add_argument("--eval_size", type=int, default=400)
    parser.add_argument("--max_train_steps", type=int, default=None, help="stop after this many optimizer steps")
    parser.add_argument("--seed", type=int, default=42)
    return parser


def build(accelerator, args):
    """Data loaders, model, AdamW and a linear decay, prepared: (model, optimizer, train_dl,
    eval_dl, scheduler, total optimizer steps)."""
    from torch.utils.data import DataLoader

    train_dl = DataLoader(make_dataset(args.train_size, seed=args.seed), batch_size=args.batch_size, shuffle=True,
                          drop_last=True)
    eval_dl = DataLoader(make_dataset(args.eval_size, seed=args.seed + 1), batch_size=32)
    model = make_model(args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    per_epoch = len(train_dl) // (accelerator.num_processes * accelerator.gradient_accumulation_steps)
    total = min(per_epoch * args.num_epochs, args.max_train_steps or 10**9)
    # a prepared scheduler steps once per process at each optimizer step (accelerate's rule)
    horizon = max(1, total * accelerator.num_processes)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / horizon))
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl,
                                                                         scheduler)
    return model, optimizer, train_dl, eval_dl, scheduler, total
