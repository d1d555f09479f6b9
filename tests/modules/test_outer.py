"""The outer math: pseudo-gradient, weighted averaging, α weights, √n rescale, Nesterov, no-contribution rule."""

from __future__ import annotations

import math

import pytest
import torch

from modules import (
    InnerConfig,
    NonFiniteStep,
    OuterConfig,
    RoundAccumulator,
    accumulate,
    all_finite,
    alpha_weights,
    batches_from_tokens,
    build_path,
    contribution_weight,
    decode,
    encode,
    flavour,
    grad_norm,
    init_level_modules,
    make_optimizer,
    nesterov_step,
    outer_update,
    outlier_scales,
    parse_layout,
    pseudo_gradient,
    rescale,
    split_state,
    train_steps,
    weighted_average,
)


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def grad_set(seed: int) -> dict[str, torch.Tensor]:
    return {"w": rand(4, 3, seed=seed), "b": rand(3, seed=seed + 100)}


def test_pseudo_gradient_is_base_minus_trained() -> None:
    base, trained = grad_set(0), grad_set(1)
    g = pseudo_gradient(base, trained)
    for name in base:
        assert torch.equal(g[name], base[name] - trained[name])
    with pytest.raises(KeyError, match="tensor names differ"):
        pseudo_gradient(base, {"w": trained["w"]})


def test_weighted_average_and_accumulate() -> None:
    grads = [grad_set(s) for s in range(3)]
    avg = weighted_average(grads, [1.0, 2.0, 5.0])
    for name in avg:
        want = (grads[0][name] + 2 * grads[1][name] + 5 * grads[2][name]) / 8
        torch.testing.assert_close(avg[name], want, rtol=0, atol=1e-6)
    acc = accumulate(None, grads[0], 2.0)
    acc = accumulate(acc, grads[1], 3.0)
    torch.testing.assert_close(acc["w"], 2 * grads[0]["w"] + 3 * grads[1]["w"])
    with pytest.raises(ValueError, match="need one weight per gradient"):
        weighted_average(grads, [1.0])
    with pytest.raises(ValueError, match="at least one"):
        weighted_average([], [])
    with pytest.raises(ValueError, match="weights must sum to > 0"):
        weighted_average(grads[:1], [0.0])


def test_outer_functions_do_not_mutate_inputs() -> None:
    params, g, mom = grad_set(0), grad_set(1), grad_set(2)
    copies = [{n: t.clone() for n, t in d.items()} for d in (params, g, mom)]
    nesterov_step(params, g, mom, OuterConfig())
    outer_update(params, [g, g], [1.0, 1.0], mom, OuterConfig(sqrt_rescale=True))
    for d, c in zip((params, g, mom), copies, strict=True):
        for n in d:
            assert torch.equal(d[n], c[n])


def test_nesterov_step_equals_torch_sgd_over_three_rounds() -> None:
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    start = grad_set(0)
    ours = {n: t.clone() for n, t in start.items()}
    mom = None
    torch_params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
    opt = torch.optim.SGD(list(torch_params.values()), lr=0.7, momentum=0.9, nesterov=True)
    for r in range(3):
        g = grad_set(10 + r)
        ours, mom = nesterov_step(ours, g, mom, cfg)
        for name, p in torch_params.items():
            p.grad = g[name].clone()
        opt.step()
        for name, p in torch_params.items():
            torch.testing.assert_close(ours[name], p.detach(), rtol=0, atol=1e-6)
            torch.testing.assert_close(mom[name], opt.state[p]["momentum_buffer"], rtol=0, atol=1e-6)


def test_momentum_state_is_serialisable() -> None:
    _, mom = nesterov_step(grad_set(0), grad_set(1), None, OuterConfig())
    back = decode(encode(mom))
    assert back.keys() == mom.keys()
    for n in mom:
        assert torch.equal(back[n], mom[n])
    p1, m1 = nesterov_step(grad_set(0), grad_set(2), mom, OuterConfig())
    p2, m2 = nesterov_step(grad_set(0), grad_set(2), back, OuterConfig())
    assert all(torch.equal(p1[n], p2[n]) and torch.equal(m1[n], m2[n]) for n in p1)


def test_outer_config_defaults_and_validation() -> None:
    cfg = OuterConfig()
    assert (cfg.lr, cfg.momentum, cfg.sqrt_rescale, cfg.method) == (0.7, 0.9, False, "nesterov")
    with pytest.raises(ValueError, match="outer lr must be > 0"):
        OuterConfig(lr=0)
    with pytest.raises(ValueError, match=r"outer momentum must be in \[0, 1\)"):
        OuterConfig(momentum=1.0)
    with pytest.raises(ValueError, match="outer method must be 'nesterov' or 'average', got 'adam'"):
        OuterConfig(method="adam")  # type: ignore[arg-type]


def test_alpha_weights() -> None:
    assert alpha_weights([100, 300]) == [0.25, 0.75]
    assert alpha_weights([0, 5]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="must sum to > 0"):
        alpha_weights([0, 0])
    with pytest.raises(ValueError, match="finite and >= 0, got -1.0"):
        alpha_weights([3, -1])


def test_alpha_weighted_update_uses_token_ratios() -> None:
    params, g1, g2 = grad_set(0), grad_set(1), grad_set(2)
    cfg = OuterConfig(lr=1.0, momentum=0.0)
    new, _ = outer_update(params, [g1, g2], alpha_weights([1000, 3000]), None, cfg)
    for n in params:
        torch.testing.assert_close(new[n], params[n] - (0.25 * g1[n] + 0.75 * g2[n]), rtol=0, atol=1e-6)


def test_sqrt_rescale_formula() -> None:
    params = grad_set(0)
    grads = [grad_set(s) for s in (1, 2, 3)]
    weights = [1.0, 2.0, 3.0]
    cfg = OuterConfig(lr=0.5, momentum=0.0, sqrt_rescale=True)
    new, _ = outer_update(params, grads, weights, None, cfg)
    mean = weighted_average(grads, weights)
    for n in params:
        torch.testing.assert_close(new[n], params[n] - 0.5 * math.sqrt(3) * mean[n], rtol=0, atol=1e-6)
    # uniform weights: sqrt(n) * mean == sum / sqrt(n)
    uni, _ = outer_update(params, grads, [1.0] * 3, None, OuterConfig(lr=1.0, momentum=0.0, sqrt_rescale=True))
    for n in params:
        total = sum(g[n] for g in grads)
        torch.testing.assert_close(uni[n], params[n] - total / math.sqrt(3), rtol=0, atol=1e-6)
    # one contributor: no-op; weight-0 contributors do not count in n
    one, _ = outer_update(params, grads[:1], [1.0], None, OuterConfig(sqrt_rescale=True))
    ref, _ = outer_update(params, grads[:1], [1.0], None, OuterConfig())
    two, _ = outer_update(params, grads[:2], [1.0, 0.0], None, OuterConfig(sqrt_rescale=True))
    assert all(torch.equal(one[n], ref[n]) and torch.equal(two[n], ref[n]) for n in params)
    with pytest.raises(ValueError, match="at least 1 contributing path"):
        rescale(grads[0], 0)


def test_plain_average_equals_sgd_lr1_momentum0_and_mean_of_trained_weights() -> None:
    base = grad_set(0)
    trained = [grad_set(s) for s in (1, 2, 3)]
    grads = [pseudo_gradient(base, t) for t in trained]
    weights = [1.0, 1.0, 2.0]
    avg_new, avg_mom = outer_update(base, grads, weights, None, OuterConfig(method="average"))
    sgd_new, _ = outer_update(base, grads, weights, None, OuterConfig(lr=1.0, momentum=0.0))
    assert avg_mom is None
    for n in base:
        torch.testing.assert_close(avg_new[n], sgd_new[n], rtol=0, atol=1e-6)
        want = (trained[0][n] + trained[1][n] + 2 * trained[2][n]) / 4
        torch.testing.assert_close(avg_new[n], want, rtol=0, atol=1e-6)


def test_module_without_contribution_is_unchanged_and_keeps_momentum() -> None:
    params, mom = grad_set(0), grad_set(1)
    new, new_mom = outer_update(params, [], [], mom, OuterConfig())
    assert new_mom is not None
    assert all(torch.equal(new[n], params[n]) and torch.equal(new_mom[n], mom[n]) for n in params)
    new, new_mom = outer_update(params, [grad_set(2)], [0.0], mom, OuterConfig())
    assert new_mom is not None
    assert all(torch.equal(new[n], params[n]) and torch.equal(new_mom[n], mom[n]) for n in params)
    new, none_mom = outer_update(params, [], [], None, OuterConfig())
    assert none_mom is None and all(torch.equal(new[n], params[n]) for n in params)
    with pytest.raises(ValueError, match="weights must be >= 0"):
        outer_update(params, [grad_set(2)], [-1.0], mom, OuterConfig())


def test_shared_module_gets_weighted_mean_of_its_three_paths() -> None:
    # 4 paths; the module is used by paths 0, 1 and 3 (3 of 4). Path 2 uses another module.
    base = grad_set(0)
    grads = [grad_set(10 + p) for p in range(4)]
    weights = [1.0, 2.0, 7.0, 3.0]
    users = [0, 1, 3]
    cfg = OuterConfig(lr=1.0, momentum=0.0)
    new, _ = outer_update(base, [grads[p] for p in users], [weights[p] for p in users], None, cfg)
    for n in base:
        want = (1.0 * grads[0][n] + 2.0 * grads[1][n] + 3.0 * grads[3][n]) / 6.0
        torch.testing.assert_close(base[n] - new[n], want, rtol=0, atol=1e-6)
    # and through the Nesterov step: the first step applies g * (1 + mu) with lr
    new, mom = outer_update(base, [grads[p] for p in users], [weights[p] for p in users], None, OuterConfig())
    assert mom is not None
    for n in base:
        want = (1.0 * grads[0][n] + 2.0 * grads[1][n] + 3.0 * grads[3][n]) / 6.0
        torch.testing.assert_close(mom[n], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(new[n], base[n] - 0.7 * 1.9 * want, rtol=0, atol=1e-6)


def test_one_path_lr1_momentum0_equals_plain_adamw() -> None:
    cfg = flavour("debug")
    layout = parse_layout("embed:shared, b0-1:shared, head:shared", n_layers=cfg.n_layers)
    inner = InnerConfig(batch_size=2, warmup_steps=2, total_steps=20)
    h = 4
    tokens = torch.arange(h * inner.batch_size * cfg.seq_len + 1) * 7 % cfg.vocab_size
    batches = batches_from_tokens(tokens, batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=h)
    modules = init_level_modules(cfg, layout, seed=0)

    plain = build_path(cfg, modules)
    train_steps(plain, make_optimizer(plain, inner), batches, inner, first_step=0)

    path = build_path(cfg, modules)
    train_steps(path, make_optimizer(path, inner), batches, inner, first_step=0)
    trained = split_state(path.state_dict(), layout)
    outer = OuterConfig(lr=1.0, momentum=0.0)
    for lv, base in enumerate(modules):
        new, _ = outer_update(base, [pseudo_gradient(base, trained[lv])], [1.0], None, outer)
        for name, t in new.items():
            assert not torch.equal(t, base[name])
            torch.testing.assert_close(t, plain.state_dict()[name], rtol=0, atol=1e-6)


def test_round_accumulator_streams_the_same_round_as_outer_update() -> None:
    params, mom = grad_set(0), grad_set(1)
    grads = [grad_set(10 + p) for p in range(3)]
    weights = [2.0, 0.0, 5.0]
    for cfg in (OuterConfig(), OuterConfig(sqrt_rescale=True, lr=0.5, momentum=0.5), OuterConfig(method="average")):
        acc = RoundAccumulator()
        for g, w in zip(grads, weights, strict=True):
            acc.add(g, w)
        assert acc.count == 2  # the weight-0 contribution counts as absent
        got, got_mom = acc.finish(params, mom, cfg)
        want, want_mom = outer_update(params, grads, weights, mom, cfg)
        assert got_mom is not None and want_mom is not None
        for n in params:
            assert torch.equal(got[n], want[n]) and torch.equal(got_mom[n], want_mom[n])
        # by hand: weighted mean over the two kept paths, sqrt(2) when asked for
        mean = {n: (2.0 * grads[0][n] + 5.0 * grads[2][n]) / 7.0 for n in params}
        scale = math.sqrt(2) if cfg.sqrt_rescale else 1.0
        if cfg.method == "average":
            for n in params:
                torch.testing.assert_close(got[n], params[n] - scale * mean[n], rtol=0, atol=1e-6)
        else:
            ref, _ = nesterov_step(params, {n: scale * mean[n] for n in params}, mom, cfg)
            for n in params:
                torch.testing.assert_close(got[n], ref[n], rtol=0, atol=1e-6)
    empty = RoundAccumulator()
    same, same_mom = empty.finish(params, mom, OuterConfig())
    assert same_mom is not None and all(torch.equal(same[n], params[n]) for n in params)
    with pytest.raises(ValueError, match="no contribution"):
        empty.mean()
    with pytest.raises(ValueError, match="weights must be >= 0 and finite"):
        empty.add(grads[0], math.nan)


def test_contribution_weight_follows_the_weighting() -> None:
    assert contribution_weight(OuterConfig(), 4096) == 1.0
    assert contribution_weight(OuterConfig(weighting="tokens"), 4096) == 4096.0
    assert contribution_weight(OuterConfig(weighting="tokens"), 0) == 0.0
    with pytest.raises(ValueError, match="outer weighting must be 'uniform' or 'tokens', got 'shards'"):
        OuterConfig(weighting="shards")  # type: ignore[arg-type]


def test_outliers_are_clipped_to_the_bound_or_refused() -> None:
    cfg = OuterConfig(max_norm=10.0, max_norm_ratio=4.0)
    # absolute bound (2 contributions: no median), a non-finite norm is always refused
    assert outlier_scales([3.0, 20.0], cfg) == [1.0, 0.5]
    assert outlier_scales([3.0, math.inf], cfg) == [1.0, 0.0]
    # relative bound: 4 x the median (2.0) = 8 < 10
    assert outlier_scales([1.0, 2.0, 2.0, 16.0], cfg) == [1.0, 1.0, 1.0, 0.5]
    refuse = OuterConfig(max_norm=10.0, max_norm_ratio=4.0, outliers="refuse")
    assert outlier_scales([1.0, 2.0, 2.0, 16.0], refuse) == [1.0, 1.0, 1.0, 0.0]
    # no bounds at all, and a zero median leaves only the absolute bound
    assert outlier_scales([1.0, 1e30], OuterConfig(max_norm=None, max_norm_ratio=None)) == [1.0, 1.0]
    assert outlier_scales([0.0, 0.0, 5.0], cfg) == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="outer max_norm_ratio must be finite and > 1"):
        OuterConfig(max_norm_ratio=0.5)


def test_a_huge_finite_upload_is_clipped_and_the_round_stays_finite() -> None:
    """Every value 3.4e38 (finite in float32) used to be averaged in as is and left the module non-finite after
    the Nesterov step; clipped to max_norm it moves the module by a bounded step."""
    params, good = grad_set(0), grad_set(1)
    huge = {n: torch.full_like(t, 3.4e38) for n, t in good.items()}
    assert math.isinf(grad_norm(huge)) is False and grad_norm(huge) > 1e38
    cfg = OuterConfig()
    new, mom = outer_update(params, [good, huge], [1.0, 1.0], None, cfg)
    assert mom is not None
    assert all(bool(torch.isfinite(t).all()) for t in (*new.values(), *mom.values()))
    step = math.sqrt(sum(float(((new[n] - params[n]).double() ** 2).sum()) for n in params))
    assert step < 0.7 * 1.9 * (cfg.max_norm or 0) + 10  # lr x (1 + mu) x the clipped mean, at most


def test_a_step_that_would_be_non_finite_raises() -> None:
    params = {"w": torch.full((2,), 3.0e38)}
    acc = RoundAccumulator()
    acc.add({"w": torch.full((2,), -3.0e38)}, 1.0)
    with pytest.raises(NonFiniteStep, match="non-finite"):
        acc.finish(params, None, OuterConfig(max_norm=None))


def test_the_in_place_outer_step_is_the_written_out_formula_bit_for_bit() -> None:
    """`RoundAccumulator` folds in place and `nesterov_step` makes two tensors per parameter; the roundings are
    those of `acc + w * g`, `sum / total`, `mu * m + g`, `g + mu * buf`, `p - lr * u` written out (the form they
    replaced), for uniform and for token weights, over tensors larger than one norm chunk."""
    shapes = {"w": (300, 257), "b": (257,)}
    gen = torch.Generator().manual_seed(7)
    params = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    mom = {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen) * 0.01 for n, s in shapes.items()} for _ in range(3)]
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    for weights in ([1.0, 1.0, 1.0], [1000.0, 17.0, 250.5]):
        acc = RoundAccumulator()
        for g, w in zip(grads, weights, strict=True):
            acc.add(g, w)
        new, new_mom = acc.finish(params, mom, cfg)
        assert new_mom is not None
        total = {n: grads[0][n] * weights[0] for n in shapes}
        for g, w in zip(grads[1:], weights[1:], strict=True):
            total = {n: total[n] + g[n] * w for n in shapes}
        for n in shapes:
            avg = total[n] / sum(weights)
            buf = mom[n] * cfg.momentum + avg
            assert torch.equal(new_mom[n], buf)
            assert torch.equal(new[n], params[n] - cfg.lr * (avg + cfg.momentum * buf))
    assert grad_norm(params) == pytest.approx(math.sqrt(sum(float((t.double() ** 2).sum()) for t in params.values())))


def test_a_finished_round_refuses_more_work_and_changes_nothing() -> None:
    params, g = grad_set(0), grad_set(1)
    acc = RoundAccumulator()
    acc.add(g)
    acc.finish(params, None, OuterConfig())
    for again in (lambda: acc.add(g), acc.mean, lambda: acc.finish(params, None, OuterConfig())):
        with pytest.raises(ValueError, match="this round was finished"):
            again()
    assert acc.count == 1


def test_a_part_with_other_tensor_names_is_refused_before_it_counts() -> None:
    acc = RoundAccumulator()
    acc.add(grad_set(0))
    with pytest.raises(KeyError, match="tensor names differ"):
        acc.add({"w": grad_set(1)["w"]})
    assert acc.count == 1
    torch.testing.assert_close(acc.mean()["b"], grad_set(0)["b"], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_all_finite_finds_one_bad_value_among_many_and_no_false_alarm_at_float32_max(bad: float) -> None:
    big = torch.full((200_000,), 3.4e38)  # a float32 sum would overflow; the float64 one cannot
    assert all_finite(big) and all_finite(-big)
    big[123_457] = bad
    assert not all_finite(big)
