"""The inner training helper: schedule, batching, AdamW steps."""

from __future__ import annotations

import math

import pytest
import torch

from modules import InnerConfig, PathModel, batches_from_tokens, flavour, make_optimizer, train_steps


def test_lr_warmup_then_cosine() -> None:
    cfg = InnerConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert cfg.lr_at(0) == pytest.approx(1e-4)
    assert cfg.lr_at(4) == pytest.approx(5e-4)
    assert cfg.lr_at(9) == pytest.approx(1e-3)
    assert cfg.lr_at(10) == pytest.approx(1e-3)  # cosine starts at the peak
    assert cfg.lr_at(60) == pytest.approx(1e-4 + 0.5 * 9e-4)  # half way
    assert cfg.lr_at(110) == pytest.approx(1e-4)
    assert cfg.lr_at(10_000) == pytest.approx(1e-4)  # stays at the floor
    lrs = [cfg.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    assert cfg.lr_at(35) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25)))


def test_lr_no_warmup() -> None:
    cfg = InnerConfig(lr=2e-3, warmup_steps=0, total_steps=100)
    assert cfg.lr_at(0) == pytest.approx(2e-3)


def test_inner_config_validation() -> None:
    with pytest.raises(ValueError, match="inner lr must be > 0"):
        InnerConfig(lr=0)
    with pytest.raises(ValueError, match="batch_size and total_steps must be >= 1"):
        InnerConfig(batch_size=0)


def test_batches_from_tokens_shapes_and_shift() -> None:
    tokens = torch.arange(3 * 2 * 5 + 1, dtype=torch.int32)
    batches = batches_from_tokens(tokens, batch_size=2, seq_len=5, steps=3)
    assert len(batches) == 3
    for s, (x, y) in enumerate(batches):
        assert x.shape == y.shape == (2, 5)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(y, x + 1)
        assert int(x[0, 0]) == s * 10
    # extra tokens are ignored
    assert len(batches_from_tokens(torch.arange(100), batch_size=2, seq_len=5, steps=3)) == 3


def test_batches_from_tokens_too_short() -> None:
    with pytest.raises(ValueError, match="token range has 30 tokens, 3 steps need 31"):
        batches_from_tokens(torch.arange(30), batch_size=2, seq_len=5, steps=3)


def test_train_steps_lowers_loss_and_sets_schedule() -> None:
    torch.manual_seed(0)
    cfg = flavour("debug")
    inner = InnerConfig(lr=3e-3, warmup_steps=2, total_steps=20, batch_size=2)
    model = PathModel(cfg)
    opt = make_optimizer(model, inner)
    tokens = (torch.arange(2 * cfg.seq_len + 1) % 5).repeat(1)
    batch = batches_from_tokens(tokens, batch_size=2, seq_len=cfg.seq_len, steps=1)
    losses = train_steps(model, opt, batch * 8, inner, first_step=3)
    assert len(losses) == 8
    assert losses[-1] < losses[0]
    assert opt.param_groups[0]["lr"] == pytest.approx(inner.lr_at(10))
