"""k-means routing of documents to paths by their prefix (DiPaCo §2.4).

`fit_router` learns the featurizer and `num_paths` centroids; `Router.route` sends each text to its nearest
centroid, plus an optional per-path offset (`bias`, see `router.balance`) that keeps the shards balanced.

Product k-means (paper App. 7.3, `levels=[k1, k2, ...]` with two or more routed levels): the feature dimensions
are cut into one contiguous block per level, one k-means is fitted per level on its block, and path index =
mixed radix of the per-level clusters (first level most significant, as `modules.layout.Layout.path_modules`).
Because a squared distance is the sum of the blocks' squared distances, the nearest of the K1*K2*... concatenated
centroids is exactly the combination of the per-level nearest ones: such a router is stored as that full
centroid table and routes with the same code.

A fitted router is saved as safetensors (idf, svd_components, centroids, bias) plus `router.json` with the
hyper-parameters; nothing is pickled.

Linear head (discriminative re-routing, paper §2.4.2, see `router.refit`): a router may carry `head_weight`
(num_paths, dims) and `head_intercept` (num_paths,); it then routes by `argmin_p (-(x . w_p + b_p) + bias_p)`,
i.e. the highest logit after the balancing offset, and the k-means centroids are kept only as a record. Such a
router is saved with format 2 (format-1 readers refuse it instead of silently routing by the centroids).

Empty clusters: after k-means, every training document is routed with the same code `route` uses; if a path
gets no document its centroid is moved onto the training document farthest from its own centroid (taken from
a path that has at least two), and routing is repeated. If that cannot give every path a document (fewer
distinct prefixes than paths), `fit_router` raises `RouterError`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits

from router.features import FeatureConfig, fit_features, transform
from router.model_features import ModelFeaturizer

ROUTER_FORMAT = 1
HEAD_ROUTER_FORMAT = 2
"""Format written when the router has a linear head; `load` reads both."""
WEIGHTS_FILE = "router.safetensors"
CONFIG_FILE = "router.json"


class RouterError(ValueError):
    """A router cannot be fitted or loaded."""


@dataclass(slots=True)
class Router:
    """Featurizer arrays + k-means centroids; routes texts to path indices."""

    features: FeatureConfig
    seed: int
    idf: np.ndarray
    """(n_features,) inverse document frequencies of the hashed n-grams."""
    components: np.ndarray
    """(dims, n_features) truncated-SVD projection."""
    centroids: np.ndarray
    """(num_paths, dims) k-means centroids."""
    bias: np.ndarray | None = None
    """(num_paths,) offsets added to the squared distances (balancing); None: plain nearest centroid."""
    levels: tuple[int, ...] | None = None
    """Clusters per routed level for product k-means (product = num_paths); None: one k-means."""
    head_weight: np.ndarray | None = None
    """(num_paths, dims) linear head (discriminative re-routing); None: route by the centroids."""
    head_intercept: np.ndarray | None = None
    """(num_paths,) intercepts of the linear head (set together with head_weight)."""
    model: ModelFeaturizer | None = None
    """Features from a path model's hidden states instead of hashed n-grams (see router.model_features)."""

    @property
    def num_paths(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def prefix_tokens(self) -> int:
        return self.features.prefix_tokens

    def embed(self, texts: list[str]) -> np.ndarray:
        """Prefix features, shape (len(texts), dims); only the first prefix_tokens bytes of a text matter."""
        if self.model is not None:
            return self.model.embed(texts, prefix_tokens=self.prefix_tokens).astype(np.float64)
        return transform(texts, self.features, self.idf, self.components)

    def scores(self, x: np.ndarray) -> np.ndarray:
        """(N, num_paths) unbiased routing scores of features `x` (lower = preferred): squared distance to each
        centroid minus |x|^2, or minus the linear head's logits when the router has one."""
        if self.head_weight is not None:
            assert self.head_intercept is not None
            return -(x @ self.head_weight.T + self.head_intercept[None, :])
        return (self.centroids * self.centroids).sum(axis=1)[None, :] - 2.0 * (x @ self.centroids.T)

    def route(self, texts: list[str]) -> np.ndarray:
        """Path index (int64) of each text: its nearest centroid (or highest head logit) after the balancing
        offsets, lowest index on ties."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        if self.head_weight is None:
            return _nearest(self.embed(texts), self.centroids, self.bias)
        s = self.scores(self.embed(texts))
        if self.bias is not None:
            s = s + self.bias[None, :]
        return np.argmin(s, axis=1).astype(np.int64)

    def save(self, directory: Path) -> None:
        """Write `router.safetensors` then `router.json` (the JSON last: complete-or-absent)."""
        directory.mkdir(parents=True, exist_ok=True)
        weights = directory / WEIGHTS_FILE
        tmp = directory / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
        arrays = {"idf": self.idf, "svd_components": self.components, "centroids": self.centroids}
        if self.bias is not None:
            arrays["bias"] = self.bias
        if self.head_weight is not None:
            if (
                self.head_intercept is None
                or self.head_weight.shape != (self.num_paths, self.centroids.shape[1])
                or self.head_intercept.shape != (self.num_paths,)
            ):
                raise RouterError(
                    f"linear head {self.head_weight.shape} / intercept "
                    f"{None if self.head_intercept is None else self.head_intercept.shape} does "
                    f"not fit {self.num_paths} paths x {self.centroids.shape[1]} dims"
                )
            arrays["head_weight"] = self.head_weight
            arrays["head_intercept"] = self.head_intercept
        save_file(arrays, str(tmp))
        os.replace(tmp, weights)
        config: dict[str, Any] = {
            "format": HEAD_ROUTER_FORMAT if self.head_weight is not None else ROUTER_FORMAT,
            "num_paths": self.num_paths,
            "seed": self.seed,
            "features": self.features.to_dict(),
            "levels": list(self.levels) if self.levels else None,
            "balanced": self.bias is not None,
        }
        if self.head_weight is not None:
            config["head"] = True  # absent for k-means routers: their router.json is unchanged
        if self.model is not None:
            self.model.save(directory)
            config["model_features"] = True  # absent for n-gram routers: their router.json is unchanged
        tmp = directory / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / CONFIG_FILE)

    @classmethod
    def load(cls, directory: Path) -> Router:
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        if not config_path.is_file() or not weights_path.is_file():
            raise RouterError(f"no saved router in {directory} (need {CONFIG_FILE} and {WEIGHTS_FILE})")
        config: dict[str, Any] = json.loads(config_path.read_text())
        if config.get("format") not in (ROUTER_FORMAT, HEAD_ROUTER_FORMAT):
            raise RouterError(
                f"{config_path}: router format {config.get('format')}, expected {ROUTER_FORMAT} or {HEAD_ROUTER_FORMAT}"
            )
        arrays = load_file(str(weights_path))
        router = cls(
            features=FeatureConfig(**config["features"]),
            seed=int(config["seed"]),
            idf=arrays["idf"],
            components=arrays["svd_components"],
            centroids=arrays["centroids"],
            bias=arrays.get("bias"),
            levels=tuple(config["levels"]) if config.get("levels") else None,
            head_weight=arrays.get("head_weight"),
            head_intercept=arrays.get("head_intercept"),
        )
        if config.get("model_features"):
            router.model = ModelFeaturizer.load(directory)
        if bool(config.get("head")) != (router.head_weight is not None and router.head_intercept is not None):
            raise RouterError(f"{directory}: {CONFIG_FILE} says head={config.get('head')}, the weights disagree")
        if router.num_paths != config["num_paths"] or router.idf.shape != (router.features.n_features,):
            raise RouterError(
                f"{directory}: arrays do not match {CONFIG_FILE} (centroids {router.centroids.shape}, "
                f"idf {router.idf.shape}, num_paths {config['num_paths']})"
            )
        return router


def _nearest(x: np.ndarray, centroids: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every centroid, so it is left out.
    scores = (centroids * centroids).sum(axis=1)[None, :] - 2.0 * (x @ centroids.T)
    if bias is not None:
        scores = scores + bias[None, :]
    return np.argmin(scores, axis=1).astype(np.int64)


def _fill_empty_paths(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Move the centroid of each empty path onto a document far from its own centroid (see module doc)."""
    centroids = centroids.copy()
    k = centroids.shape[0]
    for _ in range(k):
        labels = _nearest(x, centroids)
        sizes = np.bincount(labels, minlength=k)
        empty = np.flatnonzero(sizes == 0)
        if empty.size == 0:
            return centroids
        dist = ((x - centroids[labels]) ** 2).sum(axis=1)
        donors = sizes[labels] >= 2
        if not donors.any():
            break
        # Farthest documents first; index order breaks ties so the result is deterministic.
        order = np.lexsort((np.arange(len(x)), -np.where(donors, dist, -np.inf)))
        for path, doc in zip(empty, order, strict=False):
            centroids[path] = x[doc]
    labels = _nearest(x, centroids)
    empty = np.flatnonzero(np.bincount(labels, minlength=k) == 0)
    if empty.size:
        raise RouterError(
            f"cannot give every one of {k} paths a document: paths {empty.tolist()} stay empty "
            f"after moving their centroids ({len(x)} documents)"
        )
    return centroids


def _kmeans(x: np.ndarray, k: int, *, seed: int, n_init: int, what: str) -> np.ndarray:
    distinct = len(np.unique(np.round(x, 12), axis=0))
    if distinct < k:
        raise RouterError(
            f"cannot give every one of {k} {what} a document: only {distinct} distinct prefixes "
            f"among {len(x)} documents"
        )
    kmeans = KMeans(n_clusters=k, random_state=seed, n_init=n_init).fit(x)
    return _fill_empty_paths(x, np.asarray(kmeans.cluster_centers_, dtype=np.float64))


def level_blocks(dims: int, num_levels: int) -> list[np.ndarray]:
    """Feature indices of each routed level for product k-means: contiguous, as equal as possible."""
    return [b for b in np.array_split(np.arange(dims), num_levels)]


def product_centroids(per_level: list[np.ndarray], blocks: list[np.ndarray]) -> np.ndarray:
    """(prod K_l, dims) table: row p concatenates level l's centroid digit_l(p) (mixed radix, first level most
    significant) into that level's feature block."""
    ks = [c.shape[0] for c in per_level]
    dims = sum(len(b) for b in blocks)
    grids = np.meshgrid(*[np.arange(k) for k in ks], indexing="ij")  # C order == mixed radix
    digits = [g.reshape(-1) for g in grids]
    table = np.zeros((int(np.prod(ks)), dims), dtype=np.float64)
    for c, block, d in zip(per_level, blocks, digits, strict=True):
        table[:, block] = c[d]
    return table


def fit_router(
    prefixes: list[str],
    *,
    num_paths: int,
    prefix_tokens: int = 32,
    seed: int = 0,
    svd_dims: int = 32,
    n_init: int = 10,
    levels: list[int] | None = None,
    model: ModelFeaturizer | None = None,
) -> Router:
    """Fit the featurizer and k-means (product k-means when `levels` has two or more entries) on the training
    documents (only their prefixes are used). The returned router is unbalanced; see `router.balance`."""
    if num_paths < 1:
        raise RouterError(f"num_paths must be >= 1, got {num_paths}")
    if levels is not None:
        if any(k < 1 for k in levels) or int(np.prod(levels)) != num_paths:
            raise RouterError(f"levels {levels} do not multiply to num_paths={num_paths}")
        if len(levels) < 2:
            levels = None
    if len(prefixes) < num_paths:
        raise RouterError(
            f"cannot route {len(prefixes)} documents to {num_paths} paths: need at least one document per path"
        )
    features = FeatureConfig(prefix_tokens=prefix_tokens, svd_dims=svd_dims)
    # One thread: OpenMP/BLAS reductions in k-means and SVD are otherwise summed in a thread-dependent order,
    # and the shards must be byte-for-byte reproducible. The data is small, so this costs little.
    with threadpool_limits(limits=1):
        idf, components = fit_features(prefixes, features, seed=seed)
        if model is None:
            x = transform(prefixes, features, idf, components)
        else:  # the run's own model (paper §2.4); the n-gram arrays are kept so the router files stay uniform
            x = model.embed(prefixes, prefix_tokens=prefix_tokens).astype(np.float64)
        if levels is None:
            centroids = _kmeans(x, num_paths, seed=seed, n_init=n_init, what="paths")
        else:
            if x.shape[1] < len(levels):
                raise RouterError(f"{x.shape[1]} feature dimensions cannot be split over {len(levels)} levels")
            blocks = level_blocks(x.shape[1], len(levels))
            per_level = [
                _kmeans(x[:, b], k, seed=seed + i, n_init=n_init, what=f"clusters of level {i}")
                for i, (b, k) in enumerate(zip(blocks, levels, strict=True))
            ]
            centroids = product_centroids(per_level, blocks)
    return Router(
        features=features,
        seed=seed,
        idf=idf,
        components=components,
        centroids=centroids,
        levels=tuple(levels) if levels else None,
        model=model,
    )
