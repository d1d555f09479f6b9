"""`InnerStates`: inner AdamW state kept per (run, path) after acceptance, copied, evicted least recent first."""

from __future__ import annotations

import pytest
import torch

from island.optimizer_state import InnerStates, cpu_copy
from modules import InnerConfig, ModelConfig, build_path, init_state, make_optimizer

CFG = ModelConfig(vocab_size=32, seq_len=8, d_model=16, n_layers=1, n_heads=2)
INNER = InnerConfig(warmup_steps=0, total_steps=10, batch_size=2)


def trained_optimizer(seed: int) -> torch.optim.Optimizer:
    """An AdamW that took one step (so it has moments), on a tiny path."""
    model = build_path(CFG, [init_state(CFG, seed=0)])
    optimizer = make_optimizer(model, INNER)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len), generator=gen)
    model.loss(x, x).backward()
    optimizer.step()
    return optimizer


def moments(state: dict) -> list[torch.Tensor]:
    return [s["exp_avg"] for s in state["state"].values()]


def test_nothing_is_kept_before_acceptance() -> None:
    states = InnerStates(2)
    assert states.get((1, 10)) is None and states.last_lease is None and len(states) == 0


def test_accept_keeps_a_copy_and_get_hands_out_a_fresh_one() -> None:
    states = InnerStates(2)
    optimizer = trained_optimizer(0)
    states.accept((1, 10), 7, optimizer.state_dict())
    assert states.last_lease == 7 and (1, 10) in states
    kept = states.get((1, 10))
    assert kept is not None
    for got, want in zip(moments(kept), moments(optimizer.state_dict()), strict=True):
        assert got.device.type == "cpu" and torch.equal(got, want)
    # Training the live optimizer, or what `get` returned, leaves the kept state as it was accepted.
    before = [t.clone() for t in moments(kept)]
    optimizer.step()
    moments(kept)[0].add_(1.0)
    again = states.get((1, 10))
    assert again is not None
    assert all(torch.equal(a, b) for a, b in zip(moments(again), before, strict=True))


def test_loading_the_kept_state_does_not_let_training_change_it() -> None:
    states = InnerStates(1)
    first = trained_optimizer(0)
    states.accept((1, 10), 1, first.state_dict())
    kept_before = [t.clone() for t in moments(states.get((1, 10)) or {})]
    second = trained_optimizer(1)
    second.load_state_dict(states.get((1, 10)) or {})
    second.step()  # would update the kept tensors in place if `get` had not copied them
    assert all(torch.equal(a, b) for a, b in zip(moments(states.get((1, 10)) or {}), kept_before, strict=True))


def test_least_recently_accepted_path_is_evicted() -> None:
    states = InnerStates(2)
    state = cpu_copy(trained_optimizer(0).state_dict())
    states.accept((1, 10), 1, state)
    states.accept((1, 11), 2, state)
    states.accept((1, 10), 3, state)  # path 10 is the most recent again
    states.accept((1, 12), 4, state)
    assert (1, 11) not in states and (1, 10) in states and (1, 12) in states
    assert states.last_lease == 4


def test_capacity_one_keeps_the_last_accepted_lease_only() -> None:
    """The multi-process rule: resume only the path of the last accepted lease (the followers hold that one)."""
    states = InnerStates(1)
    state = cpu_copy(trained_optimizer(0).state_dict())
    states.accept((1, 10), 1, state)
    states.accept((1, 11), 2, state)
    assert states.get((1, 10)) is None and states.get((1, 11)) is not None and states.last_lease == 2


def test_capacity_is_checked() -> None:
    with pytest.raises(ValueError, match="capacity"):
        InnerStates(0)
