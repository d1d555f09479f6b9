"""Discriminative re-routing (DiPaCo §2.4.2): route by which path actually predicts a document best.

After the paths have trained on the k-means shards, every router-held-out document is scored under every path
(`router.evaluate.score_all_paths`: mean NLL per scored token, prefix excluded), labelled with its best path
(argmin loss, lowest index on ties), and a linear router (multinomial logistic regression on the base router's
prefix features `Router.embed`) is fitted to predict that label from the prefix alone. Because best-path labels
are usually unbalanced (a strong path wins most documents), a per-path offset is then fitted
(`router.balance.fit_bias` with `target`) so that the routed shares of the documents (or of `sizes`, e.g.
tokens) lie within `[min_share, max_share]` x the target shares (default: equal shares). The result is a
`Router` with a linear head (saved as safetensors + JSON, format 2), routing with the same featurizer.

Prior. Each document is also given, with a small weight (`prior_weight`, default 0.01 of a real label), the
path the base router sends it to. This changes little where the losses decide, but gives every path a direction
in feature space even when it is nobody's best (or when all paths are identical, e.g. freshly initialized), so
the balancing offset can still hand it the documents nearest its k-means region instead of arbitrary ones. A
path that neither the labels nor the base routes reach gets a zero weight row and an intercept below every other
path's logit on these documents; only the balancing offset can then send documents to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
from sklearn.linear_model import LogisticRegression
from threadpoolctl import threadpool_limits

from router.balance import BalanceError, fit_bias
from router.evaluate import score_all_paths
from router.router import Router, RouterError

__all__ = ["RefitReport", "best_paths", "refit_report", "refit_router", "routed_loss", "score_all_paths"]


def best_paths(path_losses: np.ndarray) -> np.ndarray:
    """The best path (argmin loss, lowest index on ties) of each row; rows that are all NaN get -1."""
    losses = np.asarray(path_losses, dtype=np.float64)
    valid = ~np.isnan(losses).all(axis=1)
    labels = np.full(losses.shape[0], -1, dtype=np.int64)
    if valid.any():
        labels[valid] = np.nanargmin(losses[valid], axis=1)
    return labels


def routed_loss(path_losses: np.ndarray, routes: np.ndarray, weights: np.ndarray | None = None) -> float:
    """Mean loss when document i goes to path routes[i], weighted by `weights` (scored tokens per document;
    default 1); NaN rows (nothing scored) are left out. exp() of it is the routed perplexity."""
    losses = np.asarray(path_losses, dtype=np.float64)
    w = np.ones(losses.shape[0]) if weights is None else np.asarray(weights, dtype=np.float64)
    picked = losses[np.arange(losses.shape[0]), np.asarray(routes, dtype=np.int64)]
    ok = ~np.isnan(picked) & (w > 0)
    return float((picked[ok] * w[ok]).sum() / w[ok].sum()) if ok.any() else math.nan


@dataclass(frozen=True, slots=True)
class RefitReport:
    """What a refit changed on the documents it was fitted on (in-sample: optimistic for the new router)."""

    documents: int
    """Documents with a loss (rows not all NaN)."""
    changed: int
    """Of those, how many the new router sends to a different path than the base router."""
    label_histogram: list[int]
    """Documents whose best path is p."""
    base_histogram: list[int]
    new_histogram: list[int]
    base_loss: float
    new_loss: float
    oracle_loss: float
    """Every document to its best path: the bound a perfect router would reach."""

    @property
    def base_perplexity(self) -> float:
        return math.exp(self.base_loss)

    @property
    def new_perplexity(self) -> float:
        return math.exp(self.new_loss)

    @property
    def oracle_perplexity(self) -> float:
        return math.exp(self.oracle_loss)


def refit_router(
    path_losses: np.ndarray,
    prefixes: list[str],
    base: Router,
    *,
    target_shares: np.ndarray | None = None,
    sizes: np.ndarray | None = None,
    min_share: float = 0.5,
    max_share: float = 2.0,
    c: float = 10.0,
    prior_weight: float = 0.01,
    max_iter: int = 2000,
    seed: int = 0,
) -> Router:
    """A router with the base router's featurizer and a linear head fitted to each document's best path.

    `path_losses` (docs, paths): mean loss of document i under path p (NaN rows are ignored). `prefixes`: the
    documents (or their prefixes; only the first `base.prefix_tokens` tokens are read). `target_shares` (paths,)
    sums to 1 (default: equal); the balancing offset keeps each path's share of the documents (weighted by
    `sizes`, default 1 each) within `[min_share, max_share]` x its target when reachable, else the closest found.
    `c` is the inverse L2 strength of the logistic regression; `prior_weight` the weight of the base router's
    route of each document as an extra label (see the module doc; 0: none). Deterministic for a given input and seed."""
    losses = np.asarray(path_losses, dtype=np.float64)
    k = base.num_paths
    if losses.ndim != 2 or losses.shape[1] != k:
        raise RouterError(f"path_losses must be (documents, {k}) for a {k}-path router, got {losses.shape}")
    if losses.shape[0] != len(prefixes):
        raise RouterError(f"{losses.shape[0]} rows of losses for {len(prefixes)} documents")
    labels = best_paths(losses)
    keep = np.flatnonzero(labels >= 0)
    if keep.size == 0:
        raise RouterError("no document has a loss under any path: nothing to refit on")
    x = base.embed([prefixes[i] for i in keep])
    y = labels[keep]
    sample_weight = np.ones(len(y))
    if prior_weight > 0:
        prior = base.route([prefixes[i] for i in keep])
        x_fit = np.concatenate([x, x])
        y_fit = np.concatenate([y, prior])
        sample_weight = np.concatenate([sample_weight, np.full(len(y), prior_weight)])
    else:
        x_fit, y_fit = x, y
    present = np.unique(y_fit)
    dims = x.shape[1]
    weight = np.zeros((k, dims), dtype=np.float64)
    intercept = np.zeros(k, dtype=np.float64)
    with threadpool_limits(limits=1):
        if present.size >= 2:
            model = LogisticRegression(C=c, max_iter=max_iter, random_state=seed).fit(
                x_fit, y_fit, sample_weight=sample_weight
            )
            coef = np.asarray(model.coef_, dtype=np.float64)
            b = np.asarray(model.intercept_, dtype=np.float64)
            classes = np.asarray(model.classes_, dtype=np.int64)
            if present.size == 2:  # sklearn's binary form: one row, the logit of classes[1] against classes[0]
                weight[classes[1]], intercept[classes[1]] = coef[0], b[0]
            else:
                weight[classes], intercept[classes] = coef, b
    # Paths nobody prefers: a constant logit below every other path's worst case on these documents.
    absent = np.setdiff1d(np.arange(k), present)
    if absent.size:
        logits = x @ weight[present].T + intercept[present][None, :]
        intercept[absent] = float(logits.min()) - math.log(len(y) + 1.0)
    head = replace(base, head_weight=weight, head_intercept=intercept, bias=None, seed=seed)
    s = head.scores(x)
    w = np.ones(len(y)) if sizes is None else np.asarray(sizes, dtype=np.float64)[keep]
    target = np.full(k, 1.0 / k) if target_shares is None else np.asarray(target_shares, dtype=np.float64)
    try:
        bias = fit_bias(s, w, min_share=min_share, max_share=max_share, strict=False, target=target)
    except BalanceError as exc:
        raise RouterError(f"balancing the refit router: {exc}") from exc
    head.bias = bias
    return head


def refit_report(
    path_losses: np.ndarray, prefixes: list[str], base: Router, new: Router, weights: np.ndarray | None = None
) -> RefitReport:
    """Compare two routers on scored documents: path changes and routed loss (weighted by `weights`)."""
    losses = np.asarray(path_losses, dtype=np.float64)
    labels = best_paths(losses)
    keep = np.flatnonzero(labels >= 0)
    docs = [prefixes[i] for i in keep]
    old_r, new_r = base.route(docs), new.route(docs)
    sub = losses[keep]
    w = None if weights is None else np.asarray(weights, dtype=np.float64)[keep]
    k = base.num_paths
    return RefitReport(
        documents=int(keep.size),
        changed=int((old_r != new_r).sum()),
        label_histogram=np.bincount(labels[keep], minlength=k).astype(int).tolist(),
        base_histogram=np.bincount(old_r, minlength=k).astype(int).tolist(),
        new_histogram=np.bincount(new_r, minlength=k).astype(int).tolist(),
        base_loss=routed_loss(sub, old_r, w),
        new_loss=routed_loss(sub, new_r, w),
        oracle_loss=routed_loss(sub, labels[keep], w),
    )
