"""Inner training helper: plain PyTorch AdamW steps with warmup + cosine schedule and gradient clipping.

The schedule is indexed by the *global* inner step (round * H + local step) so it continues across rounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from modules.model import PathModel


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    """Inner optimizer and batch settings of a run."""

    lr: float = 3e-3
    """Peak AdamW learning rate."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at total_steps."""
    warmup_steps: int = 10
    total_steps: int = 1000
    """Global inner steps of the whole run (rounds * H); sets the cosine period."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Max global grad norm; 0 disables clipping."""
    batch_size: int = 8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"inner lr must be > 0, got {self.lr}")
        if self.batch_size < 1 or self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError("batch_size and total_steps must be >= 1, warmup_steps >= 0")

    def lr_at(self, step: int) -> float:
        """Learning rate at a global inner step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        floor = self.lr * self.min_lr_ratio
        return floor + 0.5 * (self.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: PathModel, cfg: InnerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)


def train_steps(
    model: PathModel,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    cfg: InnerConfig,
    *,
    first_step: int,
    before_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Run one AdamW step per (inputs, targets) batch; returns the loss of each step. `before_step(i)` is called
    before step i (the reference replays an overlap lease's move onto its landed versions there)."""
    model.train()
    losses: list[float] = []
    for i, (x, y) in enumerate(batches):
        if before_step is not None:
            before_step(i)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr_at(first_step + i)
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def heldout_loss(
    model: PathModel,
    tokens: torch.Tensor,
    *,
    max_tokens: int,
    batch_size: int = 16,
    device: torch.device | None = None,
) -> float:
    """Mean next-token loss of `model` on the first `max_tokens` of `tokens`, cut into non-overlapping windows of
    seq_len inputs (+1 target); the model's train/eval mode is restored afterwards."""
    seq_len = model.cfg.seq_len
    n = min(max_tokens, tokens.numel())
    windows = (n - 1) // seq_len
    if windows < 1:
        raise ValueError(f"held-out scoring needs at least seq_len + 1 = {seq_len + 1} tokens, got {n}")
    data = tokens[: windows * seq_len + 1].long()
    x_all = data[:-1].view(windows, seq_len)
    y_all = data[1:].view(windows, seq_len)
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        for start in range(0, windows, batch_size):
            x, y = x_all[start : start + batch_size], y_all[start : start + batch_size]
            if device is not None:
                x, y = x.to(device), y.to(device)
            total += float(model.loss(x, y)) * x.size(0)
    finally:
        model.train(was_training)
    return total / windows


def batches_from_tokens(
    tokens: torch.Tensor, *, batch_size: int, seq_len: int, steps: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a contiguous token range of length steps*batch_size*seq_len + 1 into (inputs, targets) batches."""
    need = steps * batch_size * seq_len + 1
    if tokens.numel() < need:
        raise ValueError(f"token range has {tokens.numel()} tokens, {steps} steps need {need}")
    out = []
    for s in range(steps):
        base = s * batch_size * seq_len
        x = tokens[base : base + batch_size * seq_len].view(batch_size, seq_len)
        y = tokens[base + 1 : base + batch_size * seq_len + 1].view(batch_size, seq_len)
        out.append((x.long(), y.long()))
    return out
