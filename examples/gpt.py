"""A small byte-level GPT: the model of the examples, the demo and the benchmarks.

Decoder-only transformer (pre-norm blocks, causal self-attention through
``F.scaled_dot_product_attention(is_causal=True)``, GELU MLP, tied input/output
embeddings), vocabulary of 256 bytes. The default configuration has about 2.3 M
parameters, small enough for several ranks on a few CPU cores.

Determinism: there is no dropout by default, and every weight is initialised from
an explicitly seeded ``torch.Generator`` in a fixed order, without touching the
global RNG; so the same ``seed`` gives bitwise the same model in any process,
which is what the recovery equivalence tests compare against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 5
    n_head: int = 4
    n_embd: int = 192
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not a multiple of n_head {self.n_head}")
        if min(self.vocab_size, self.seq_len, self.n_layer, self.n_head, self.n_embd) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg, seed)``: ``forward(x, y=None) -> (logits, loss)``, loss the mean
    cross-entropy over all ``y`` positions (``None`` without targets)."""

    def __init__(self, cfg: GPTConfig | None = None, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        # The modules' default init draws from the global RNG; keep that state as it
        # was, since every weight is re-initialised from `seed` below anyway.
        with torch.random.fork_rng(devices=[]):
            self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every weight from ``torch.Generator().manual_seed(seed)`` (GPT-2
        scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), zero
        biases, unit LayerNorm gains), in ``named_parameters`` order."""
        g = torch.Generator().manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif ".ln" in name or name.startswith("ln_"):
                p.fill_(1.0)
            elif name.endswith("proj.weight"):
                p.normal_(0.0, resid_std, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)

    def num_params(self) -> int:
        """Parameters counted once (the tied embedding is shared)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, x: torch.Tensor, y: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = x.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len {self.cfg.seq_len}")
        pos = torch.arange(t, device=x.device)
        h = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))
        if y is None:
            return logits, None
        loss = F.cross_entropy(logits.view(b * t, -1), y.reshape(b * t))
        return logits, loss
