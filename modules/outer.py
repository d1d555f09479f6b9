"""DiLoCo / DiPaCo outer optimisation as pure tensor functions (DiLoCo Alg. 1; DiPaCo §2.2, Alg. 1).

Each path trains H inner steps from the current module weights; its *outer gradient* (pseudo-gradient) is
`base - trained`. A module averages the outer gradients of the paths that use it this round and takes one
Nesterov momentum step. Functions here never mutate their inputs.

Options (all off by default, so the defaults are DiLoCo's Algorithm 1):

* α weights (DiPaCo §2.7): a path's outer gradient is weighted by the amount of data behind it (tokens
  trained this round, or its shard size). `alpha_weights` turns per-path counts into weights; the per-module
  average renormalises over the paths that actually contributed.
* √n rescale (`OuterConfig.sqrt_rescale`): multiply the weighted mean by √n, n = number of contributing paths.
* plain averaging (`OuterConfig.method = "average"`): the module becomes the weighted mean of the trained
  weights, identical to the Nesterov step with lr 1 and momentum 0.
* outliers (`outlier_scales`): a path's outer gradient for a module whose L2 norm is over `max_norm`, or over
  `max_norm_ratio` x the median norm of the round's contributions to that module, is clipped to the bound or
  refused (`outliers`). A finite but huge upload (every value 3.4e38) otherwise made 4 of 6 modules entirely
  non-finite after one round. `RoundAccumulator.finish` also refuses to return non-finite weights
  (`NonFiniteStep`), so a caller can drop the offending contributions instead of committing them.

`RoundAccumulator` is the one home of a module's round: fold `(outer gradient, weight)` pairs one at a time
(memory O(module), whatever the number of paths), then `finish` averages, rescales and steps. The coordinator's
apply, the reference simulator (`modules.simulate`) and the tests' recomputation all go through it;
`outer_update` is the same thing for gradients already in a list.

Sparse rows (`modules.sparse_rows`, the run field `sparse_rows`): a part may send only some rows of a tensor
(`<name>::rows` next to it). Each row is then averaged over the parts that sent it, and a row no part sent keeps
its weights and its momentum, as a module nobody trained does (`RoundAccumulator.finish`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch

from modules.sparse_rows import is_rows, split_rows

Tensors = dict[str, torch.Tensor]


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """Outer optimizer: SGD with Nesterov momentum, the DiLoCo defaults."""

    lr: float = 0.7
    """Outer learning rate (DiLoCo uses 0.7)."""
    async_lr: float | None = None
    """Outer learning rate of modules on async levels (`modules.asynchrony`); None: `lr`. A run created with
    async levels stores its own (the coordinator's default is half of `lr`: docs/LOG.md, 2026-12-04)."""
    momentum: float = 0.9
    """Nesterov momentum; 0 gives plain outer SGD (lr 1, momentum 0 = plain averaging of trained weights)."""
    async_momentum: float | None = None
    """Nesterov momentum of modules on async levels; None: `momentum`. A run created with async levels stores its
    own (the coordinator's default is 0.6: docs/LOG.md, 2026-12-06)."""
    sqrt_rescale: bool = False
    """Multiply a module's averaged outer gradient by sqrt(number of contributing paths); see `rescale`."""
    method: Literal["nesterov", "average"] = "nesterov"
    """`average`: new weights = base - averaged outer gradient (lr and momentum ignored, no momentum kept)."""
    weighting: Literal["uniform", "tokens"] = "uniform"
    """How a contribution is weighted in its module's average (`contribution_weight`): `uniform` (DiLoCo's plain
    mean) or `tokens` (α weights by the tokens trained for it, DiPaCo §2.7)."""
    max_norm: float | None = 1e4
    """Largest L2 norm of one contribution's outer gradient for one module (None: no absolute bound). The
    default is far above what training produces (an outer gradient is a few steps of weight change) and far
    below what breaks float32 arithmetic."""
    max_norm_ratio: float | None = 10.0
    """Bound relative to the median norm of the round's contributions to the module, applied when at least
    `MEDIAN_MIN_CONTRIBUTIONS` contributed (None: no relative bound)."""
    outliers: Literal["clip", "refuse"] = "clip"
    """What happens to a contribution over a bound: scaled down to the bound, or left out of the round."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"outer lr must be > 0, got {self.lr}")
        if self.async_lr is not None and not (math.isfinite(self.async_lr) and self.async_lr > 0):
            raise ValueError(f"outer async_lr must be finite and > 0 (or None), got {self.async_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum}")
        if self.async_momentum is not None and not 0 <= self.async_momentum < 1:
            raise ValueError(f"outer async_momentum must be in [0, 1) (or None), got {self.async_momentum}")
        if self.method not in ("nesterov", "average"):
            raise ValueError(f"outer method must be 'nesterov' or 'average', got {self.method!r}")
        if self.weighting not in ("uniform", "tokens"):
            raise ValueError(f"outer weighting must be 'uniform' or 'tokens', got {self.weighting!r}")
        if self.max_norm is not None and not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"outer max_norm must be finite and > 0 (or None), got {self.max_norm}")
        if self.max_norm_ratio is not None and not (math.isfinite(self.max_norm_ratio) and self.max_norm_ratio > 1):
            raise ValueError(f"outer max_norm_ratio must be finite and > 1 (or None), got {self.max_norm_ratio}")
        if self.outliers not in ("clip", "refuse"):
            raise ValueError(f"outer outliers must be 'clip' or 'refuse', got {self.outliers!r}")

    def for_async(self) -> OuterConfig:
        """The outer step of an async level's module: this one with `async_lr` as its lr and `async_momentum` as its
        momentum (each when set)."""
        lr = self.lr if self.async_lr is None else self.async_lr
        momentum = self.momentum if self.async_momentum is None else self.async_momentum
        return replace(self, lr=lr, momentum=momentum, async_lr=None, async_momentum=None)


MEDIAN_MIN_CONTRIBUTIONS = 3
"""The relative bound needs a median that one outlier cannot move: at least this many contributions."""


class NonFiniteStep(ValueError):
    """The outer step of a module would produce NaN or Inf weights or momentum (nothing is returned)."""


NORM_CHUNK = 1 << 16
"""Elements per float64 piece in `grad_norm` and `all_finite`: a module's tensors are never copied whole (a 117M
parameter module as float64 squares was 936 MB of temporaries and 7x slower, docs/LOG.md 2026-12-04)."""


def _sum_squares(t: torch.Tensor) -> float:
    return sum(float(piece.double().square().sum()) for piece in t.reshape(-1).split(NORM_CHUNK))


def grad_norm(grad: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of one module's outer gradient over all its tensors (float64: a float32 sum of squares overflows
    for values above ~1e19); inf when any value is not finite. Row ids of a sparse part are not values."""
    total = sum(_sum_squares(t) for name, t in grad.items() if not is_rows(name))
    return math.sqrt(total) if math.isfinite(total) else math.inf


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or Inf in a float32 (or narrower) tensor: its float64 sum is finite exactly then (NaN and Inf carry
    through a sum, and n finite float32 values cannot reach 1e308), found without a boolean copy of the tensor."""
    return math.isfinite(float(t.sum(dtype=torch.float64)))


def outlier_bound(norms: Sequence[float], cfg: OuterConfig) -> float:
    """The largest norm a contribution to one module may have this round: `max_norm`, lowered to
    `max_norm_ratio` x the median of the finite `norms` when at least `MEDIAN_MIN_CONTRIBUTIONS` contributed and
    that median is > 0 (inf when there is no bound)."""
    bound = math.inf if cfg.max_norm is None else cfg.max_norm
    finite = [n for n in norms if math.isfinite(n)]
    if cfg.max_norm_ratio is not None and len(norms) >= MEDIAN_MIN_CONTRIBUTIONS and finite:
        median = statistics.median(finite)
        if median > 0:
            bound = min(bound, cfg.max_norm_ratio * median)
    return bound


def outlier_scales(norms: Sequence[float], cfg: OuterConfig) -> list[float]:
    """The factor each contribution to one module enters the round with: 1.0 as sent, in (0, 1) clipped to
    `outlier_bound` (`outliers="clip"`), 0.0 refused (`outliers="refuse"`, or a norm that is not finite, which
    no factor can bring back)."""
    bound = outlier_bound(norms, cfg)
    scales: list[float] = []
    for norm in norms:
        if not math.isfinite(norm):
            scales.append(0.0)
        elif norm <= bound:
            scales.append(1.0)
        else:
            scales.append(bound / norm if cfg.outliers == "clip" else 0.0)
    return scales


def contribution_weight(cfg: OuterConfig, tokens: float) -> float:
    """Weight of one contribution in its module's average: 1.0 (`uniform`) or the tokens it trained (`tokens`).

    Only ratios matter: `RoundAccumulator.finish` divides by the sum of the weights it was given.
    """
    if cfg.weighting == "tokens":
        return float(tokens)
    return 1.0


def pseudo_gradient(base: Mapping[str, torch.Tensor], trained: Mapping[str, torch.Tensor]) -> Tensors:
    """Outer gradient of one path for one module: base weights minus trained weights."""
    if set(base) != set(trained):
        raise KeyError(f"tensor names differ: {sorted(set(base) ^ set(trained))}")
    return {name: (base[name].float() - trained[name].float()) for name in base}


def accumulate(acc: Tensors | None, grad: Mapping[str, torch.Tensor], weight: float) -> Tensors:
    """Running weighted sum `acc + weight * grad` (one contribution at a time: memory O(module))."""
    if acc is None:
        return {name: t.float() * weight for name, t in grad.items()}
    if set(acc) != set(grad):
        raise KeyError(f"tensor names differ: {sorted(set(acc) ^ set(grad))}")
    return {name: acc[name] + grad[name].float() * weight for name in acc}


def weighted_average(grads: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Tensors:
    """Weighted mean of the outer gradients of the paths that used a module."""
    if not grads or len(grads) != len(weights):
        raise ValueError(f"need one weight per gradient and at least one: {len(grads)} vs {len(weights)}")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to > 0, got {total}")
    acc: Tensors | None = None
    for grad, w in zip(grads, weights, strict=True):
        acc = accumulate(acc, grad, w)
    assert acc is not None
    return {name: t / total for name, t in acc.items()}


def nesterov_step(
    params: Mapping[str, torch.Tensor],
    grad: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor] | None,
    cfg: OuterConfig,
) -> tuple[Tensors, Tensors]:
    """One outer step, same rule as `torch.optim.SGD(nesterov=True)`: returns (new params, new momentum).

    buf = mu * buf + g;  p = p - lr * (g + mu * buf).  A missing momentum buffer is zeros (first round).
    Two new tensors per parameter (the buffer, and the update that becomes the new weights), the same roundings
    as the formula written out (p - lr*u is p + (-lr)*u exactly), so results are bit for bit those of the
    out-of-place form, at about half the time on a 117M-parameter module (bench/bench_outer_step.py).
    """
    new_params: Tensors = {}
    new_mom: Tensors = {}
    for name, p in params.items():
        g = grad[name].float()
        buf = g.clone() if momentum is None else torch.mul(momentum[name].float(), cfg.momentum).add_(g)
        update = torch.mul(buf, cfg.momentum).add_(g)
        new_params[name] = update.mul_(-cfg.lr).add_(p.float()).to(p.dtype)
        new_mom[name] = buf
    return new_params, new_mom


def alpha_weights(counts: Iterable[float]) -> list[float]:
    """Per-path α weights from token counts or shard sizes (DiPaCo §2.7): α_i = n_i / Σ n_j.

    A path with count 0 gets weight 0 (it contributes nothing); at least one count must be > 0. Only the
    ratios matter to `weighted_average`, which renormalises over the paths that contributed to a module.
    """
    values = [float(c) for c in counts]
    bad = [c for c in values if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"token counts must be finite and >= 0, got {bad[0]}")
    total = sum(values)
    if total <= 0:
        raise ValueError(f"token counts must sum to > 0, got {values}")
    return [c / total for c in values]


def rescale(grad: Mapping[str, torch.Tensor], num_contributors: int) -> Tensors:
    """√n rescale of an averaged outer gradient: `g * sqrt(n)`, n = number of contributing paths.

    Formula: with contributions Δ_i and α weights, the module's outer gradient is
    `sqrt(n) * Σ_i α_i Δ_i / Σ_i α_i`; with uniform weights that is `Σ_i Δ_i / sqrt(n)`.
    Why: the outer gradients of different paths are close to uncorrelated beyond their common direction, so
    the norm of their mean shrinks roughly like 1/√n. Without a correction a module shared by many paths
    (e.g. the embedding, shared by all P) would take steps about √P times smaller than a routed module seen by
    one path; multiplying by √n keeps the step size comparable across levels of different sharing. This is
    our reading of the paper's normalisation by the number of paths through a module; it is off by default
    (DiLoCo's plain mean) and a no-op when n = 1.
    """
    if num_contributors < 1:
        raise ValueError(f"need at least 1 contributing path, got {num_contributors}")
    factor = math.sqrt(num_contributors)
    return {name: t.float() * factor for name, t in grad.items()}


class RoundAccumulator:
    """One module's outer round, folded one contribution at a time: `add(grad, weight)` per path that used the
    module, then `finish(params, momentum, cfg)` once.

    Memory is one running sum of the module's size, whatever the number of contributions, so the caller can
    stream outer gradients from disk. A contribution of weight 0 (a path that trained 0 tokens under token
    weighting) counts as absent, also for n in the √n rescale.

    A sparse part (`modules.sparse_rows`: `<name>` full size with zeros on the rows not sent, `<name>::rows` the
    rows sent) adds its weight to the rows it sent only: such a tensor keeps a weight total and a count per row
    (a dense part adds to every row), and its mean divides each row by that row's total. Without sparse parts
    nothing per row is kept and the arithmetic is the dense one, bit for bit.
    """

    __slots__ = ("_count", "_row_count", "_row_total", "_spent", "_sum", "_total")

    def __init__(self) -> None:
        self._sum: Tensors | None = None
        self._spent = False
        """`finish` divided the running sum in place: a second `finish`, `add` or `mean` is an error."""
        self._total = 0.0
        self._count = 0
        self._row_total: dict[str, torch.Tensor] = {}
        """Per sparse tensor: the summed weight of the parts that sent each row (float64, one per row)."""
        self._row_count: dict[str, torch.Tensor] = {}
        """Per sparse tensor: how many parts sent each row (for the √n rescale)."""

    @property
    def count(self) -> int:
        """Contributions folded in with a weight > 0."""
        return self._count

    def add(self, grad: Mapping[str, torch.Tensor], weight: float = 1.0, *, scale: float = 1.0) -> None:
        """Fold in one path's outer gradient for this module with its weight (>= 0, finite) and its outlier
        factor (`outlier_scales`: the gradient is multiplied by it; 0 leaves the contribution out)."""
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"weights must be >= 0 and finite, got {weight}")
        if not 0 <= scale <= 1:
            raise ValueError(f"outlier scale must be in [0, 1], got {scale}")
        self._check_unspent()
        if weight == 0 or scale == 0:
            return
        tensors, rows = split_rows(grad)
        if self._sum is not None and set(self._sum) != set(tensors):  # before anything is counted
            raise KeyError(f"tensor names differ: {sorted(set(self._sum) ^ set(tensors))}")
        for name in sorted(set(rows) | set(self._row_total)):
            if name not in self._row_total:  # the first sparse part of this tensor: every earlier one was dense
                n = tensors[name].shape[0]
                self._row_total[name] = torch.full((n,), self._total, dtype=torch.float64)
                self._row_count[name] = torch.full((n,), self._count, dtype=torch.int64)
            sent = rows.get(name)
            if sent is None:
                self._row_total[name] += weight
                self._row_count[name] += 1
            else:
                self._row_total[name][sent] += weight
                self._row_count[name][sent] += 1
        self._fold(tensors, weight * scale)
        self._total += weight
        self._count += 1

    def _fold(self, tensors: Mapping[str, torch.Tensor], factor: float) -> None:
        """`_sum += factor * tensors` in place (`accumulate`'s arithmetic, bit for bit, without its new sum); the
        names were checked by `add`."""
        if self._sum is None:
            self._sum = accumulate(None, tensors, factor)
            return
        for name, total in self._sum.items():
            t = tensors[name].float()
            total.add_(t if factor == 1.0 else t * factor)  # x * 1.0 is x exactly: no copy for uniform weights

    def _check_unspent(self) -> None:
        if self._spent:
            raise ValueError("this round was finished: a RoundAccumulator folds one round")

    def mean(self) -> Tensors:
        """The weighted mean of what was added (each row of a sparse tensor over the parts that sent it; 0 on the
        rows none sent)."""
        return self._mean(in_place=False)

    def _mean(self, *, in_place: bool) -> Tensors:
        """`mean()`; `in_place` divides the running sum itself (`finish`: the sum is not needed afterwards)."""
        self._check_unspent()
        if self._sum is None:
            raise ValueError("no contribution was added")
        out: Tensors = {}
        for name, t in self._sum.items():
            total = self._row_total.get(name)
            if total is None:
                divisor: float | torch.Tensor = self._total
            else:
                per_row = torch.where(total > 0, total, torch.ones_like(total)).to(t.dtype)
                divisor = per_row.view(-1, *[1] * (t.dim() - 1))
            out[name] = t.div_(divisor) if in_place else t / divisor
        return out

    def _rescaled(self, avg: Tensors) -> Tensors:
        """`rescale` by √n, n per row for a sparse tensor."""
        out = rescale(avg, self._count)
        for name, count in self._row_count.items():
            factor = count.double().sqrt().to(avg[name].dtype)
            out[name] = avg[name].float() * factor.view(-1, *[1] * (avg[name].dim() - 1))
        return out

    def finish(
        self, params: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor] | None, cfg: OuterConfig
    ) -> tuple[Tensors, Tensors | None]:
        """The module's new (params, momentum) after this round.

        No contribution: the module keeps its weights and its momentum buffer is returned as is, neither decayed
        nor applied. This is what `torch.optim.SGD` does for a parameter whose `.grad` is None: it is skipped.
        Treating "no data" as a zero gradient instead would still move the module by lr * mu * buf (stale
        momentum from rounds in which paths did use it) and decay the buffer, so a module nobody trained would
        drift and lose its momentum merely because its paths were idle or failed. With the skip, a missed round
        is as if it never happened for that module (style rule 9: never half-applied). The rows of a sparse
        tensor that no part sent follow the same rule: their weights and momentum come back as they were.

        `method="average"`: new params = params - mean gradient (the weighted mean of the trained weights); the
        momentum is returned unchanged (it is not used).

        Raises `NonFiniteStep` rather than return weights or momentum with NaN/Inf in them.
        """
        if self._sum is None:
            return dict(params), (dict(momentum) if momentum is not None else None)
        avg = self._mean(in_place=True)
        self._spent = True
        if cfg.sqrt_rescale:
            avg = self._rescaled(avg)
        if cfg.method == "average":
            new = {name: (p.float() - avg[name]).to(p.dtype) for name, p in params.items()}
            new_momentum = dict(momentum) if momentum is not None else None
        else:
            new, new_momentum = nesterov_step(params, avg, momentum, cfg)
        for name, total in self._row_total.items():
            untouched = total == 0
            if bool(untouched.any()):
                new[name][untouched] = params[name][untouched].to(new[name].dtype)
                if cfg.method == "nesterov" and new_momentum is not None:  # `average` returned the buffer as is
                    kept = momentum[name][untouched].float() if momentum is not None else 0.0  # none yet: zeros
                    new_momentum[name][untouched] = kept
        for name, tensors in (("weights", new), ("momentum", new_momentum or {})):
            bad = [key for key, t in tensors.items() if not all_finite(t)]
            if bad:
                raise NonFiniteStep(f"the outer step would make the module's {name} non-finite (tensor {bad[0]!r})")
        return new, new_momentum


def outer_update(
    params: Mapping[str, torch.Tensor],
    grads: Sequence[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    momentum: Mapping[str, torch.Tensor] | None,
    cfg: OuterConfig,
) -> tuple[Tensors, Tensors | None]:
    """One module's outer round over gradients already in a list: `outlier_scales` of their norms, then
    `RoundAccumulator` fed in order and finished.

    `grads` holds the outer gradients of the paths that used this module and reported this round, `weights`
    their weights (uniform: all 1.0). Returns (new params, new momentum); see `RoundAccumulator.finish`.
    """
    if len(grads) != len(weights):
        raise ValueError(f"need one weight per gradient: {len(grads)} vs {len(weights)}")
    acc = RoundAccumulator()
    scales = outlier_scales([grad_norm(g) for g in grads], cfg)
    for grad, weight, scale in zip(grads, weights, scales, strict=True):
        acc.add(grad, weight, scale=scale)
    return acc.finish(params, momentum, cfg)
