"""Model configuration and named flavours (tiny `debug` for tests, `small` for CPU benchmarks)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """A GPT-style decoder. Every path of a DiPaCo run is one of these."""

    vocab_size: int = 257
    """Byte-level tokenizer: 256 byte values + one end-of-document token."""
    seq_len: int = 64
    """Context length; also the size of the learned position table."""
    d_model: int = 64
    """Hidden width."""
    n_layers: int = 2
    """Number of transformer blocks in a path."""
    n_heads: int = 4
    """Attention heads; must divide d_model."""
    mlp_ratio: int = 4
    """MLP hidden width = mlp_ratio * d_model."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model config: n_heads={self.n_heads} does not divide d_model={self.d_model}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)


FLAVOURS: dict[str, ModelConfig] = {
    # Runs the whole pipeline on a CPU in seconds.
    "debug": ModelConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4),
    # CPU benchmarks and the demo's comparisons.
    "small": ModelConfig(seq_len=128, d_model=128, n_layers=4, n_heads=4),
    # The paper's 150M path shape (12 blocks, hidden 896, 16 heads); byte vocabulary here.
    "paper-150m": ModelConfig(seq_len=1024, d_model=896, n_layers=12, n_heads=16),
}


def flavour(name: str) -> ModelConfig:
    """Return a copy of a named flavour."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown model flavour {name!r}; known: {sorted(FLAVOURS)}")
    return ModelConfig.from_dict(FLAVOURS[name].to_dict())
