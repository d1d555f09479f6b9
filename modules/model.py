"""The path model: a plain decoder-only transformer in one of two block styles (`ModelConfig.block`).

* `gpt2`: pre-norm LayerNorm, learned absolute positions, GELU MLP, biases (GPT-2, nanoGPT).
* `llama`: pre-norm RMSNorm (eps 1e-5), rotary positions on q and k (RoPE, base 10000; Su et al. 2021), SwiGLU
  MLP (Shazeer 2020), no biases and no position table (Llama, Touvron et al. 2023). Its SwiGLU width is chosen
  so a path has the gpt2 path's parameter count (`ModelConfig.mlp_hidden`).

Reads top to bottom: norm -> rotary -> attention -> MLP -> block -> path. Both styles use the same parameter
names (`tok_emb`, `blocks.N.{ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj}`, `ln_f`, `lm_head`; llama simply
has no `pos_emb` and no `.bias`), so the level split (`modules.layout.Level.owns`), the per-module init and the
simulator treat them alike. Embedding and LM head are untied by default because they are separate DiPaCo levels
(`embed`, `head`); with `tie_embeddings` the LM head is `tok_emb.weight` (embed level) and the head level holds
only the final norm `ln_f`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from modules.config import ModelConfig

RMS_EPS = 1e-5
"""RMSNorm epsilon (Llama's)."""
ROPE_BASE = 10000.0
"""Rotary base: pair i of a head turns by position * ROPE_BASE^(-2i / head_dim)."""

Rope = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without the mean subtraction and the bias."""

    def __init__(self, dim: int, eps: float = RMS_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def make_norm(cfg: ModelConfig) -> nn.Module:
    return nn.LayerNorm(cfg.d_model) if cfg.block == "gpt2" else RMSNorm(cfg.d_model)


def rotary_tables(head_dim: int, t: int, device: torch.device) -> Rope:
    """cos and sin of the rotation angles, each (T, head_dim / 2). Computed per forward (a few kFLOPs) rather than
    kept as buffers, so a model built on the meta device, moved or cast needs nothing recomputed."""
    inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(t, dtype=torch.float32, device=device), inv_freq)  # (T, head_dim / 2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate (B, heads, T, head_dim) by position: dimension i pairs with i + head_dim / 2 (Llama's layout)."""
    cos, sin = (r.to(x.dtype) for r in rope)
    x1, x2 = x.chunk(2, dim=-1)  # (B, heads, T, head_dim / 2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.block == "gpt2"
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=bias)

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q = q.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        k = k.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        v = v.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2)
        if rope is not None:  # llama: positions enter here, as rotations of q and k
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        # (B, heads, T, head_dim) -> (B, T, C)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    """gpt2: proj(gelu(fc(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_hidden)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class SwiGLU(nn.Module):
    """llama: proj(silu(gate) * up). Gate and up share one `fc` weight of 2 * mlp_hidden rows (gate rows first), so
    the tensor names are the gpt2 MLP's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.hidden = cfg.mlp_hidden
        self.fc = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # two matmuls on the row halves of `fc` give contiguous (B, T, h) outputs; halves of one (B, T, 2h) output
        # are strided, which made the element-wise silu * up ~1.8x slower on CPU (docs/LOG.md, "blocks")
        gate = F.linear(x, self.fc.weight[: self.hidden])  # (B, T, h)
        up = F.linear(x, self.fc.weight[self.hidden :])  # (B, T, h)
        return self.proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg)
        self.mlp = MLP(cfg) if cfg.block == "gpt2" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, rope: Rope | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))


class PathModel(nn.Module):
    """One DiPaCo path: an ordinary dense transformer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        # gpt2 adds a learned position vector to the input; llama rotates q and k instead (no parameters)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model) if cfg.block == "gpt2" else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = make_norm(cfg)
        # tied: the output projection is tok_emb.weight, so the head level owns ln_f only
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> final-norm hidden states (B, T, d_model); positions count from 0 at idx[:, 0]."""
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len={self.cfg.seq_len}")
        x = self.tok_emb(idx)  # (B, T, d)
        rope: Rope | None = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(t, device=idx.device))
        else:
            rope = rotary_tables(self.cfg.head_dim, t, idx.device)
        for block in self.blocks:
            x = block(x, rope)
        return self.ln_f(x)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab)."""
        head = self.tok_emb.weight if self.lm_head is None else self.lm_head.weight  # (vocab, d)
        return F.linear(self.hidden(idx), head)

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def init_state(cfg: ModelConfig, *, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic initial weights (GPT-2 style, for both blocks: N(0, 0.02) matrices, zero biases, unit norms)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):  # names and shapes only; the values are drawn below
        model = PathModel(cfg)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias"):
            state[name] = torch.zeros(tensor.shape)
        elif ".ln" in name or name.startswith("ln_f."):
            state[name] = torch.ones(tensor.shape)
        else:
            state[name] = torch.randn(tensor.shape, generator=gen) * 0.02
    return state
