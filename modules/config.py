"""Model configuration and named flavours (tiny `debug` for tests, `small` for CPU benchmarks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Block = Literal["gpt2", "llama"]
BLOCKS: tuple[Block, ...] = ("gpt2", "llama")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A decoder-only transformer. Every path of a DiPaCo run is one of these."""

    vocab_size: int = 257
    """Byte-level tokenizer: 256 byte values + one end-of-document token."""
    seq_len: int = 64
    """Context length; also the size of the learned position table (gpt2) or the rotary table (llama)."""
    d_model: int = 64
    """Hidden width."""
    n_layers: int = 2
    """Number of transformer blocks in a path."""
    n_heads: int = 4
    """Attention heads; must divide d_model (llama: into an even head width, rotary pairs dimensions)."""
    mlp_ratio: int = 4
    """gpt2: MLP hidden width = mlp_ratio * d_model. llama: sets the SwiGLU width so a path has as many
    parameters as the gpt2 path of the same config (`mlp_hidden`)."""
    block: Block = "llama"
    """`llama`: RMSNorm, rotary positions on q and k, SwiGLU MLP, no biases. `gpt2`: LayerNorm, learned positions,
    GELU MLP, biases (modules/model.py). llama is the default because it trained to lower held-out perplexity at
    equal parameters and steps (docs/LOG.md, bench/blocks.py); gpt2 stays selectable."""
    tie_embeddings: bool = False
    """Output projection = token embedding matrix. The matrix lives in the `embed` level; the `head` level then
    holds the final norm only."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model config: n_heads={self.n_heads} does not divide d_model={self.d_model}")
        if self.block not in BLOCKS:
            raise ValueError(f"model config: block must be one of {list(BLOCKS)}, got {self.block!r}")
        if self.block == "llama" and self.head_dim % 2:
            raise ValueError(
                f"model config: rotary positions need an even head width, got d_model/n_heads = {self.head_dim}"
            )
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"model config: tie_embeddings must be true or false, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def mlp_hidden(self) -> int:
        """MLP hidden width. gpt2: mlp_ratio * d_model. llama: the SwiGLU width h that gives a path the gpt2 path's
        parameter count, rounded to the nearest integer.

        Both blocks share the embedding, q/k/v/out projections and LM head; per block gpt2 also has LayerNorm
        biases (2d), projection biases (3d + d + m*d + d, m = mlp_ratio) and an MLP of 2*m*d^2 weights, llama has
        a SwiGLU of 3*d*h weights; gpt2 also has a learned position table (T*d) and the final LayerNorm bias (d).
        Equal parameters: 3*d*h*L = 2*m*d^2*L + (7 + m)*d*L + T*d + d, so

            h = 2/3 * m * d + (T + (7 + m) * L + 1) / (3 * L)

        i.e. Llama's usual "2/3 of 4d" plus a few units that buy back the positions and biases llama drops. The
        vocabulary and tying cancel out. debug (d 64, T 64, L 2, m 4): h = 185, 137,024 vs 137,088 parameters."""
        if self.block == "gpt2":
            return self.mlp_ratio * self.d_model
        d, t, n, m = self.d_model, self.seq_len, self.n_layers, self.mlp_ratio
        return round((2 * m * d * d * n + (7 + m) * d * n + t * d + d) / (3 * d * n))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """A config from its stored fields. One without `block` was written before the field existed, when every
        path was gpt2 (runs in a registry, exports, featurizers), so it stays gpt2 whatever the default is now."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**{"block": "gpt2", **data})


FLAVOURS: dict[str, ModelConfig] = {
    # Runs the whole pipeline on a CPU in seconds.
    "debug": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4, block="llama"),
    # CPU benchmarks and the demo's comparisons.
    "small": ModelConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4, block="llama"),
    # The paper's 150M path shape (12 blocks, hidden 896, 16 heads); byte vocabulary here.
    "paper-150m": ModelConfig(seq_len=1024, d_model=896, n_layers=12, n_heads=16, block="llama"),
}


def flavour(name: str) -> ModelConfig:
    """Return a copy of a named flavour."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown model flavour {name!r}; known: {sorted(FLAVOURS)}")
    return ModelConfig.from_dict(FLAVOURS[name].to_dict())
