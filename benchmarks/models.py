"""A small GPT-style language model and synthetic token data, for the benchmarks and examples.

Self-contained (torch only) and free of side effects on import: nothing is built, seeded or
downloaded until a function is called.

    from models import GPT, GPTConfig, TokenDataset, make_tokens, PRESETS

    cfg = PRESETS["bench"]                       # ~14M parameters
    model = GPT(cfg)                             # weights drawn from torch's global RNG
    data = TokenDataset(make_tokens(256, cfg.block_size, cfg.vocab_size, seed=0))
    x, y = data[0]                               # x: (T,) inputs, y: (T,) next-token targets
    loss = model(x[None], y[None])               # with targets: the mean cross-entropy (fp32)
    logits = model(x[None])                      # without: the logits, (B, T, vocab)

The model: token embedding + learned positions, `n_layer` pre-LayerNorm blocks of causal
self-attention (torch.nn.functional.scaled_dot_product_attention) and a GELU MLP, a final
LayerNorm and an LM head, tied to the token embedding by default. No dropout, so a training
run is a deterministic function of the seed and the data.

The data: `make_tokens(..., pattern="markov")` draws sequences from a random sparse Markov
chain (every token has `branching` equally likely successors), so a model can learn it and the
best possible loss is known: log(branching) nats per token (after the first). `pattern="uniform"`
draws i.i.d. uniform tokens (nothing to learn; the loss stays near log(vocab_size)). Both are
deterministic functions of the seed (a private torch.Generator; the global RNG is not touched).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPTConfig", "GPT", "PRESETS", "make_tokens", "TokenDataset", "markov_loss_floor"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    block_size: int = 128  # the longest sequence (number of learned positions)
    n_layer: int = 6
    n_head: int = 6
    d_model: int = 384
    mlp_ratio: int = 4
    tie_weights: bool = True  # LM head shares the token embedding's weight
    bias: bool = True

    def __post_init__(self):
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})")

    def replace(self, **changes) -> "GPTConfig":
        return replace(self, **changes)


PRESETS = {
    # ~13.8M parameters (tied head): what benchmarks/bench_step.py times
    "bench": GPTConfig(),
    # ~0.2M parameters: smoke tests
    "tiny": GPTConfig(vocab_size=512, block_size=32, n_layer=2, n_head=2, d_model=64),
    # ~3.4M parameters: a CPU example that learns something in a minute or two
    "small": GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, d_model=256),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer LM. forward(idx) -> logits (B, T, vocab);
    forward(idx, targets) -> mean next-token cross-entropy, a 0-dim float32 tensor (computed
    from fp32 logits, also under autocast), without returning the logits."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def num_params(self) -> int:
        """Parameters counted once (a tied head is not counted twice)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def make_tokens(n_seqs: int, seq_len: int, vocab_size: int, seed: int = 0, pattern: str = "markov",
                branching: int = 4) -> torch.Tensor:
    """(n_seqs, seq_len + 1) int64 tokens, a deterministic function of the arguments.
    Row i gives the inputs row[:-1] and the next-token targets row[1:] of one sequence."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "uniform":
        return torch.randint(0, vocab_size, (n_seqs, seq_len + 1), generator=g)
    if pattern != "markov":
        raise ValueError(f"pattern must be 'markov' or 'uniform', got {pattern!r}")
    if not 1 <= branching <= vocab_size:
        raise ValueError(f"branching must be in [1, vocab_size], got {branching}")
    successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
    choice = torch.randint(0, branching, (n_seqs, seq_len), generator=g)
    out = torch.empty(n_seqs, seq_len + 1, dtype=torch.int64)
    out[:, 0] = torch.randint(0, vocab_size, (n_seqs,), generator=g)
    for t in range(seq_len):
        out[:, t + 1] = successors[out[:, t], choice[:, t]]
    return out


def markov_loss_floor(branching: int = 4) -> float:
    """The best achievable mean loss on pattern="markov" data, in nats (first token excepted;
    a little above it where a token's successors repeat)."""
    return math.log(branching)


class TokenDataset(torch.utils.data.Dataset):
    """Wraps make_tokens()' output: item i is (inputs, targets), each (seq_len,) int64."""

    def __init__(self, tokens: torch.Tensor):
        if tokens.dim() != 2 or tokens.size(1) < 2:
            raise ValueError(f"tokens must be (n_seqs, seq_len + 1), got {tuple(tokens.shape)}")
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.size(0)

    def __getitem__(self, i):
        row = self.tokens[i]
        return row[:-1], row[1:]
