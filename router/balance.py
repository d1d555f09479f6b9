"""Balanced routing (DiPaCo §2.4): per-path score offsets so every shard holds a bounded share of the tokens.

Nearest-centroid routing can give one path most of the data. Instead of a constrained assignment that the
router could not reproduce on new documents, we learn one additive offset (bias) per path: a document goes to
`argmin_p (s_p + bias_p)`, where `s_p` is its routing score for path p (`Router.scores`: the squared distance to
centroid p up to a per-document constant, or minus a linear head's logit). The same rule routes training
documents, held-out documents and islands' data, so evaluation sees exactly the routing the shards were cut with.

The offsets are found by a deterministic auction: while a path holds more than `max_share` x its fair share of
tokens, raise its bias just enough to push out its cheapest-to-move documents (those whose second choice is
closest); once no path is over-full, while a path holds less than `min_share` x, lower its bias just enough to
pull in the cheapest documents from elsewhere. Each step fixes the worst violation of its kind; loose bounds
(the defaults, 0.5x and 2x) usually converge in a few steps. When the auction cycles, a dual (sub)gradient
ascent moves all offsets at once. Infeasible bounds (one document larger than the cap) are refused up front.
"""

from __future__ import annotations

import numpy as np

DUAL_STEPS = 5000
"""Fallback iterations (each one argmin over the (N, K) scores) before giving up."""
_EPS = 1e-9
"""Added to a bias move so that the marginal document really changes side (scores are O(1))."""


class BalanceError(ValueError):
    """The share bounds cannot be met."""


def token_shares(labels: np.ndarray, sizes: np.ndarray, num_paths: int) -> np.ndarray:
    """Tokens per path divided by the fair share (total / num_paths)."""
    load = np.bincount(labels, weights=sizes, minlength=num_paths)
    return load / (sizes.sum() / num_paths)


def fit_bias(
    s: np.ndarray,
    sizes: np.ndarray,
    *,
    min_share: float = 0.5,
    max_share: float = 2.0,
    max_steps: int | None = None,
    strict: bool = True,
    target: np.ndarray | None = None,
) -> np.ndarray:
    """Per-path offsets so that `argmin(s + bias)` gives every path between min_share and max_share of its fair
    share of `sizes` (tokens per document). `s` is (N, K) with lower = closer.

    Documents with identical prefixes have identical scores and always share a path, so a group of them
    larger than the cap makes the bounds unreachable. `strict=False` then returns the offsets with the smallest
    total violation found instead of raising.

    `target` (K,) non-negative, summing to 1: the share of `sizes` each path should hold (default: 1/K each);
    the bounds are then `min_share` and `max_share` times each path's own target."""
    n, k = s.shape
    if not 0.0 <= min_share <= 1.0 <= max_share:
        raise BalanceError(f"need 0 <= min_share <= 1 <= max_share, got {min_share} and {max_share}")
    sizes = np.asarray(sizes, dtype=np.float64)
    if target is None:
        fair = np.full(k, sizes.sum() / k)
    else:
        target = np.asarray(target, dtype=np.float64)
        if target.shape != (k,) or (target < 0).any() or abs(float(target.sum()) - 1.0) > 1e-6:
            raise BalanceError(f"target shares must be {k} non-negative numbers summing to 1, got {target}")
        fair = target * sizes.sum()
    lo, hi = min_share * fair, max_share * fair
    if n and sizes.max() > hi.max():
        raise BalanceError(
            f"a document of {int(sizes.max())} tokens exceeds the cap of {hi.max():.0f} tokens per "
            f"path ({max_share} x the fair share {fair.max():.0f}); raise max_share"
        )
    if int((lo > 0).sum()) > n:
        raise BalanceError(f"{n} documents cannot give each of {k} paths at least {min_share} of its share")
    bias = np.zeros(k, dtype=np.float64)
    best_bias, best_violation = bias.copy(), np.inf

    def violation(load: np.ndarray) -> float:
        nonlocal best_bias, best_violation
        v = float(np.abs(load - np.clip(load, lo, hi)).sum())
        if v < best_violation:
            best_bias, best_violation = bias.copy(), v
        return v

    rows = np.arange(n)
    steps = max_steps if max_steps is not None else 10 * k
    for _ in range(steps):
        total = s + bias[None, :]
        labels = np.argmin(total, axis=1)
        load = np.bincount(labels, weights=sizes, minlength=k)
        over, under = (load - hi) / np.maximum(hi, 1e-12), (lo - load) / np.maximum(lo, 1e-12)
        if violation(load) == 0:
            return bias
        best = total[rows, labels]
        pushing = over.max() > 0  # over-full paths first: the mass they shed is what under-full ones need
        if pushing:
            p = int(np.argmax(over))
            members = np.flatnonzero(labels == p)
            rest = np.delete(total[members], p, axis=1)
            margin = rest.min(axis=1) - best[members]  # cost of sending each member to its next choice
            need = load[p] - hi[p]
        else:
            p = int(np.argmax(under))
            members = np.flatnonzero(labels != p)
            margin = total[members, p] - best[members]  # cost of pulling each outsider in
            need = lo[p] - load[p]
        order = np.lexsort((members, margin))  # cheapest first, index order on ties: deterministic
        cum = np.cumsum(sizes[members[order]])
        cut = min(int(np.searchsorted(cum, need)), len(order) - 1)
        step = float(margin[order[cut]]) + _EPS * (1.0 + abs(float(margin[order[cut]])))
        bias[p] += step if pushing else -step
    # The auction can cycle between two under-full neighbours fed only by each other (e.g. product k-means
    # combinations far from the data). Fall back to projected supergradient ascent on the dual of the balanced
    # assignment, which moves all offsets at once; its step shrinks as 1/sqrt(t).
    scale = float(np.median(np.abs(s - s.mean(axis=1, keepdims=True)))) or 1.0
    for t in range(DUAL_STEPS):
        labels = np.argmin(s + bias[None, :], axis=1)
        load = np.bincount(labels, weights=sizes, minlength=k)
        excess = load - np.clip(load, lo, hi)
        if violation(load) == 0:
            return bias
        bias += (0.5 * scale / np.sqrt(1.0 + t)) * excess / np.maximum(fair, 1e-12)
    if not strict:
        return best_bias
    labels = np.argmin(s + best_bias[None, :], axis=1)
    shares = token_shares(labels, sizes, k)
    _, group, inverse = np.unique(np.round(s, 9), axis=0, return_index=True, return_inverse=True)
    largest = np.bincount(inverse.reshape(-1), weights=sizes).max() / fair.max()
    why = (
        f"; documents with one identical prefix hold {largest:.2f} x the fair share and must share a path"
        if largest > max_share
        else ""
    )
    raise BalanceError(
        f"could not balance {k} paths within [{min_share}, {max_share}] of the fair share; "
        f"best shares {np.round(shares, 3).tolist()}{why}"
    )
