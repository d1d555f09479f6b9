"""Asynchronous and hybrid updates in the reference: staleness, periods, and their reduction to rounds."""

from __future__ import annotations

import math

import pytest
import torch

from modules import InnerConfig, ModelConfig, OuterConfig, parse_layout, simulate
from modules.asynchrony import AsyncSettings, Lease, Upload, period_size, simulate_async, staleness_weight
from modules.cursor import fitting_steps

CFG = ModelConfig(seq_len=16, d_model=32, n_layers=2, n_heads=4)
INNER = InnerConfig(lr=3e-3, warmup_steps=2, total_steps=12, batch_size=2)
OUTER = OuterConfig()
H = 2
LAYOUT = "embed:shared, b0-0:routed2, b1-1:routed2, head:shared"


def shard(path: int, n: int = 600) -> torch.Tensor:
    i = torch.arange(n)
    return ((i * (3 + 2 * path) + (i // 7) * (path + 1)) % 50 + 10 * path) % CFG.vocab_size


def rounds_of(num_paths: int, rounds: int) -> list[Lease | Upload]:
    """The round schedule as events: every path leases, then every path uploads, in path order."""
    events: list[Lease | Upload] = []
    for _ in range(rounds):
        events += [Lease(p, H) for p in range(num_paths)]
        events += [Upload(p) for p in range(num_paths)]
    return events


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_staleness_weight_and_period() -> None:
    assert [staleness_weight(s) for s in (0, 1, 3)] == [1.0, 0.5, 0.25]
    assert [staleness_weight(s, "inverse_square") for s in (0, 1, 3)] == [1.0, 0.25, 0.0625]
    assert staleness_weight(7, "none") == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1)
    with pytest.raises(ValueError, match="unknown staleness damping 'linear'"):
        staleness_weight(1, "linear")  # type: ignore[arg-type]
    assert period_size(4, None) == 4 and period_size(4, 2) == 2
    with pytest.raises(ValueError, match="at least one path"):
        period_size(0, None)


@pytest.mark.parametrize("sync", ["round", "async"])
def test_round_order_reduces_to_the_round_simulator(sync: str) -> None:
    """Every path leasing and uploading once per period, periods of the module's users: async equals rounds
    bit for bit (Delayed Nesterov with c = 0 is the round schedule when arrivals line up)."""
    layout = parse_layout(LAYOUT, n_layers=2)
    tokens = [shard(p) for p in range(4)]
    ref = simulate(CFG, layout, INNER, OUTER, steps_per_round=H, rounds=3, seed=0, tokens=tokens)
    got = simulate_async(
        CFG, layout, INNER, OUTER, AsyncSettings(sync=sync),  # type: ignore[arg-type]
        events=rounds_of(4, 3), budget_steps=3 * H, seed=0, tokens=tokens,
    )  # fmt: skip
    assert [u.loss for u in got.uploads] == [loss for r in ref.losses for loss in r]
    for lv in range(4):
        for m, weights in enumerate(ref.modules[lv]):
            assert same(got.modules[lv][m], weights)
    assert got.versions == [[3], [3, 3], [3, 3], [3]]
    assert all(s == 0 for u in got.uploads for s in u.staleness)


def test_a_fast_path_makes_the_others_stale_and_damped() -> None:
    """Path 0 uploads twice while path 1 holds its first lease: the shared modules step on every upload
    (`dn_period` 1), so path 1 arrives two versions late and is refused (max 1); its retry trains the same
    token range from the new weights."""
    layout = parse_layout("embed:shared, b0-1:routed2, head:shared", n_layers=2)
    tokens = [shard(p) for p in range(2)]
    settings = AsyncSettings(sync="async", max_staleness=1, dn_period=1)
    events: list[Lease | Upload] = [Lease(0, H), Lease(1, H), Upload(0), Lease(0, H), Upload(0), Upload(1)]
    events += [Lease(1, H), Upload(1), Lease(0, H), Upload(0), Lease(1, H), Upload(1), Lease(1, H), Upload(1)]
    got = simulate_async(CFG, layout, INNER, OUTER, settings, events=events, budget_steps=3 * H, seed=0, tokens=tokens)
    staleness = [(u.path, u.staleness, u.refused is not None) for u in got.uploads]
    assert staleness[:3] == [(0, [0, 0, 0], False), (0, [0, 0, 0], False), (1, [2, 0, 2], True)]
    assert staleness[3] == (1, [0, 0, 0], False)
    assert got.versions == [[6], [3, 3], [6]]  # shared: every accepted upload; routed: its own path's
    refused = got.uploads[2]
    assert refused.refused == "staleness 2 over max_staleness 1"


def test_budget_and_lease_order_are_checked() -> None:
    layout = parse_layout(LAYOUT, n_layers=2)
    tokens = [shard(p) for p in range(4)]
    settings = AsyncSettings(sync="async")
    with pytest.raises(ValueError, match="uploads without a lease"):
        simulate_async(CFG, layout, INNER, OUTER, settings, events=[Upload(0)], budget_steps=H, seed=0, tokens=tokens)
    with pytest.raises(ValueError, match="already holds a lease"):
        simulate_async(
            CFG, layout, INNER, OUTER, settings, events=[Lease(0, H), Lease(0, H)], budget_steps=H, seed=0,
            tokens=tokens,
        )  # fmt: skip
    with pytest.raises(ValueError, match=r"paths \[1, 2, 3\] did not spend their budget"):
        simulate_async(
            CFG, layout, INNER, OUTER, settings, events=[Lease(0, H), Upload(0)], budget_steps=H, seed=0,
            tokens=tokens,
        )  # fmt: skip


def test_a_stale_part_moves_its_module_by_its_damped_share() -> None:
    """One part of staleness 1 (1/(1+s) = 0.5) next to a fresh one: the step is Nesterov on
    (0.5 g_stale + g_fresh) / 2, the weight total undamped."""
    from modules import nesterov_step
    from modules.asynchrony import _Module, _Part, fold

    gen = torch.Generator().manual_seed(0)
    weights = {"w": torch.randn(3, 4, generator=gen)}
    g1, g2 = {"w": torch.randn(3, 4, generator=gen) * 0.01}, {"w": torch.randn(3, 4, generator=gen) * 0.01}
    module = _Module(weights=weights)
    parts = [_Part(path=1, seq=2, grad=g2, tokens=8, staleness=0), _Part(path=0, seq=1, grad=g1, tokens=8, staleness=1)]
    new, momentum = fold(module, parts, OUTER, "inverse")
    want, want_m = nesterov_step(weights, {"w": (g1["w"] * 0.5 + g2["w"]) / 2}, None, OUTER)
    assert torch.allclose(new["w"], want["w"], atol=1e-7) and momentum is not None
    assert torch.allclose(momentum["w"], want_m["w"], atol=1e-7)
    undamped, _ = fold(module, parts, OUTER, "none")
    assert not torch.allclose(undamped["w"], new["w"])


@pytest.mark.parametrize(("sync", "lr"), [("async", 0.3), ("round", 0.7)])
def test_async_levels_step_with_async_lr_and_round_levels_with_lr(sync: str, lr: float) -> None:
    """In round order (see above), an all-async run with `async_lr` 0.3 is the round simulator at lr 0.3; an
    all-round run ignores `async_lr`."""
    layout = parse_layout(LAYOUT, n_layers=2)
    tokens = [shard(p) for p in range(4)]
    ref = simulate(CFG, layout, INNER, OuterConfig(lr=lr), steps_per_round=H, rounds=2, seed=0, tokens=tokens)
    got = simulate_async(
        CFG, layout, INNER, OuterConfig(lr=0.7, async_lr=0.3), AsyncSettings(sync=sync),  # type: ignore[arg-type]
        events=rounds_of(4, 2), budget_steps=2 * H, seed=0, tokens=tokens,
    )  # fmt: skip
    for lv in range(4):
        for m, weights in enumerate(ref.modules[lv]):
            assert same(got.modules[lv][m], weights)


def test_async_lr_and_momentum_are_checked_and_replace_lr_and_momentum_on_async_steps() -> None:
    outer = OuterConfig(lr=0.7, async_lr=0.2, momentum=0.8)
    assert outer.for_async() == OuterConfig(lr=0.2, momentum=0.8)
    assert OuterConfig(lr=0.7).for_async() == OuterConfig(lr=0.7)  # runs created before async_lr
    assert OuterConfig(momentum=0.9, async_momentum=0.0).for_async() == OuterConfig(momentum=0.0)
    assert OuterConfig(lr=0.7, async_lr=0.35, async_momentum=0.8).for_async() == OuterConfig(lr=0.35, momentum=0.8)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="outer async_lr must be finite and > 0"):
            OuterConfig(async_lr=bad)
    for bad in (1.0, -0.1, math.nan):
        with pytest.raises(ValueError, match="outer async_momentum must be in"):
            OuterConfig(async_momentum=bad)


def test_an_async_lease_that_does_not_fit_takes_the_tail_in_whole_steps() -> None:
    """`fitting_steps`: the lease's steps when its range fits, else the whole steps the rest holds when at least
    `min_steps` (None: 1), else 0 (the next epoch)."""
    kw = {"length": 600, "per_step": 32}
    assert fitting_steps(384, steps=4, min_steps=None, **kw) == 4  # 384 + 129 = 513 <= 600
    assert fitting_steps(512, steps=4, min_steps=None, **kw) == 2  # 88 tokens: 2 x 32 + 1 fit
    assert fitting_steps(512, steps=4, min_steps=2, **kw) == 2
    assert fitting_steps(512, steps=4, min_steps=3, **kw) == 0
    assert fitting_steps(576, steps=4, min_steps=None, **kw) == 0  # 24 tokens: not one step
    assert fitting_steps(567, steps=1, min_steps=None, **kw) == 1  # 567 + 33 = 600: exactly fits


@pytest.mark.parametrize(
    ("sync", "min_steps", "steps", "ranges"),
    [
        ("async", None, [4] * 6 + [2], [(0, 4), (128, 4), (256, 4), (384, 4), (512, 2), (0, 4), (128, 2)]),
        ("async", 3, [4] * 6, [(0, 4), (128, 4), (256, 4), (384, 4), (0, 4), (128, 4)]),
        ("round", None, [4] * 6, [(0, 4), (128, 4), (256, 4), (384, 4), (0, 4), (128, 4)]),
    ],
    ids=["async", "async-min-steps", "round"],
)
def test_the_reference_takes_the_shard_tail_as_the_service_does(
    sync: str, min_steps: int | None, steps: list[int], ranges: list[tuple[int, int]]
) -> None:
    """A 600-token shard and leases of H 4 that name no range: after 4 leases 88 tokens are left; an async lease
    takes them in 2 steps unless min_inner_steps is more (the service's leases in
    tests/coordinator/test_async_levels.py, `test_an_async_lease_takes_the_shard_tail_in_fewer_steps`); a round
    lease starts the next epoch."""
    layout = parse_layout("embed:shared, b0-1:shared, head:shared", n_layers=2)
    events: list[Lease | Upload] = []
    for h in steps:
        events += [Lease(0, h), Upload(0)]
    got = simulate_async(
        CFG, layout, InnerConfig(lr=3e-3, warmup_steps=2, total_steps=24, batch_size=2), OUTER,
        AsyncSettings(sync=sync, min_inner_steps=min_steps),  # type: ignore[arg-type]
        events=events, budget_steps=24, seed=0, tokens=[shard(0)],
    )  # fmt: skip
    assert [(u.start, u.steps) for u in got.uploads] == ranges
    assert [u.tokens for u in got.uploads] == [h * 2 * CFG.seq_len for _, h in ranges]


def test_an_overlap_lease_starts_from_the_end_weights_and_moves_onto_its_versions_at_its_step() -> None:
    """An overlap lease (`Lease.through`) trains from the island's own end weights of the path and moves onto its
    versions before inner step `rebase_at`: moved before step 0 it trains what a lease from those versions does
    (end + (version - end) = version up to rounding); moved after the last step its first steps saw the end
    weights instead, so its losses differ. The versions must have landed by its upload, and the island must have
    end weights of the path."""
    layout = parse_layout("embed:shared, b0-1:shared, head:shared", n_layers=2)
    tokens = [shard(0)]
    settings = AsyncSettings(sync="async", dn_period=1)  # one module step per upload

    def run(through: tuple[int, ...], rebase_at: int | None) -> list[float]:
        events: list[Lease | Upload] = [Lease(0, H), Upload(0)]
        for v in (1, 2):
            events += [Lease(0, H, versions=(v, v, v), through=through, rebase_at=rebase_at), Upload(0)]
        got = simulate_async(
            CFG, layout, INNER, OUTER, settings, events=events, budget_steps=3 * H, seed=0, tokens=tokens
        )
        assert [u.base_versions for u in got.uploads] == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]
        plain.append(got.modules[1][0]["blocks.0.attn.qkv.weight"])
        return [u.loss for u in got.uploads]

    plain: list[torch.Tensor] = []
    base = run((), None)
    moved_first = run((0, 1, 2), 0)
    moved_last = run((0, 1, 2), H)
    assert moved_first == pytest.approx(base, abs=1e-5)
    torch.testing.assert_close(plain[1], plain[0], rtol=0, atol=1e-5)
    assert moved_last[0] == base[0] and abs(moved_last[1] - base[1]) > 1e-4
    assert not torch.allclose(plain[2], plain[0], atol=1e-5)

    def fails(events: list[Lease | Upload], match: str) -> None:
        with pytest.raises(ValueError, match=match):
            simulate_async(CFG, layout, INNER, OUTER, settings, events=events, budget_steps=H, seed=0, tokens=tokens)

    fails([Lease(0, H), Upload(0), Lease(0, H, versions=(2, 1, 1), through=(0,), rebase_at=1), Upload(0)],
          "before version 2 of its level 0 landed")  # fmt: skip
    fails([Lease(0, H, versions=(0, 0, 0), through=(1,), rebase_at=1), Upload(0)], "no end weights of path 0")
    fails([Lease(0, H, through=(1,), rebase_at=H + 1)], rf"rebase_at must be in \[0, {H}\]")
    fails([Lease(0, H, rebase_at=1)], "rebase_at without levels")
    fails([Lease(0, H, through=(1, 1), rebase_at=1)], "not distinct levels")
