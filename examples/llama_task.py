"""Shared by the Llama examples (by_feature/fsdp.py, by_feature/trainer.py): a character-level
language-modelling task the repository generates and a tiny transformers LlamaForCausalLM built
from a LlamaConfig, so both run here on CPU without downloads.

The text is examples/tiny_corpus.py's grammar; each sample is `seq_len` consecutive characters
(input_ids, and labels equal to them: the model shifts them itself, as transformers' causal LMs
do)."""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_corpus import make_text  # noqa: E402

CHARS = sorted(set("abcdefghijklmnopqrstuvwxyz .:"))
VOCAB = len(CHARS)


def make_samples(n: int, seq_len: int = 32, seed: int = 0) -> list:
    """n samples {"input_ids", "labels"} of seq_len characters each, cut from generated text."""
    text = make_text(n * seq_len, seed=seed)
    ids = torch.tensor([CHARS.index(c) for c in text])
    return [{"input_ids": ids[i * seq_len:(i + 1) * seq_len], "labels": ids[i * seq_len:(i + 1) * seq_len].clone()}
            for i in range(n)]


def make_model(seed: int = 0, hidden: int = 32, layers: int = 2):
    """A tiny LlamaForCausalLM from a config (no pretrained weights); its decoder blocks are
    LlamaDecoderLayer, the class the seed FSDP config wraps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config)
