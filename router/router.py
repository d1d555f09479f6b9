"""k-means routing of documents to paths by their prefix (DiPaCo §2.4).

`fit_router` learns the featurizer and `num_paths` centroids; `Router.route` sends each text to its nearest
centroid. A fitted router is saved as safetensors (idf, svd_components, centroids) plus `router.json` with the
hyper-parameters; nothing is pickled.

Empty clusters: after k-means, every training document is routed with the same code `route` uses; if a path
gets no document its centroid is moved onto the training document farthest from its own centroid (taken from
a path that has at least two), and routing is repeated. If that cannot give every path a document (fewer
distinct prefixes than paths), `fit_router` raises `ValueError`.
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

ROUTER_FORMAT = 1
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

    @property
    def num_paths(self) -> int:
        return int(self.centroids.shape[0])

    @property
    def prefix_tokens(self) -> int:
        return self.features.prefix_tokens

    def embed(self, texts: list[str]) -> np.ndarray:
        """Prefix features, shape (len(texts), dims); only the first prefix_tokens bytes of a text matter."""
        return transform(texts, self.features, self.idf, self.components)

    def route(self, texts: list[str]) -> np.ndarray:
        """Path index (int64) of each text: its nearest centroid, lowest index on ties."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        return _nearest(self.embed(texts), self.centroids)

    def save(self, directory: Path) -> None:
        """Write `router.safetensors` then `router.json` (the JSON last: complete-or-absent)."""
        directory.mkdir(parents=True, exist_ok=True)
        weights = directory / WEIGHTS_FILE
        tmp = directory / f".{WEIGHTS_FILE}.tmp-{os.getpid()}"
        save_file({"idf": self.idf, "svd_components": self.components, "centroids": self.centroids}, str(tmp))
        os.replace(tmp, weights)
        config = {"format": ROUTER_FORMAT, "num_paths": self.num_paths, "seed": self.seed,
                  "features": self.features.to_dict()}
        tmp = directory / f".{CONFIG_FILE}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, directory / CONFIG_FILE)

    @classmethod
    def load(cls, directory: Path) -> Router:
        config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
        if not config_path.is_file() or not weights_path.is_file():
            raise RouterError(f"no saved router in {directory} (need {CONFIG_FILE} and {WEIGHTS_FILE})")
        config: dict[str, Any] = json.loads(config_path.read_text())
        if config.get("format") != ROUTER_FORMAT:
            raise RouterError(
                f"{config_path}: router format {config.get('format')}, expected {ROUTER_FORMAT}"
            )
        arrays = load_file(str(weights_path))
        router = cls(features=FeatureConfig(**config["features"]), seed=int(config["seed"]),
                     idf=arrays["idf"], components=arrays["svd_components"], centroids=arrays["centroids"])
        if router.num_paths != config["num_paths"] or router.idf.shape != (router.features.n_features,):
            raise RouterError(
                f"{directory}: arrays do not match {CONFIG_FILE} (centroids {router.centroids.shape}, "
                f"idf {router.idf.shape}, num_paths {config['num_paths']})"
            )
        return router


def _nearest(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    # |x - c|^2 = |x|^2 - 2 x.c + |c|^2; |x|^2 is the same for every centroid, so it is left out.
    scores = (centroids * centroids).sum(axis=1)[None, :] - 2.0 * (x @ centroids.T)
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


def fit_router(
    prefixes: list[str],
    *,
    num_paths: int,
    prefix_tokens: int = 32,
    seed: int = 0,
    svd_dims: int = 32,
    n_init: int = 10,
) -> Router:
    """Fit the featurizer and k-means on the training documents (only their prefixes are used)."""
    if num_paths < 1:
        raise RouterError(f"num_paths must be >= 1, got {num_paths}")
    if len(prefixes) < num_paths:
        raise RouterError(
            f"cannot route {len(prefixes)} documents to {num_paths} paths: "
            "need at least one document per path"
        )
    features = FeatureConfig(prefix_tokens=prefix_tokens, svd_dims=svd_dims)
    # One thread: OpenMP/BLAS reductions in k-means and SVD are otherwise summed in a thread-dependent order,
    # and the shards must be byte-for-byte reproducible. The data is small, so this costs little.
    with threadpool_limits(limits=1):
        idf, components = fit_features(prefixes, features, seed=seed)
        x = transform(prefixes, features, idf, components)
        distinct = len(np.unique(np.round(x, 12), axis=0))
        if distinct < num_paths:
            raise RouterError(
                f"cannot give every one of {num_paths} paths a document: only {distinct} distinct prefixes "
                f"among {len(prefixes)} documents"
            )
        kmeans = KMeans(n_clusters=num_paths, random_state=seed, n_init=n_init).fit(x)
    centroids = _fill_empty_paths(x, np.asarray(kmeans.cluster_centers_, dtype=np.float64))
    return Router(features=features, seed=seed, idf=idf, components=components, centroids=centroids)
