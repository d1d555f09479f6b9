from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from router.corpus import iter_jsonl
from router.router import Router, RouterError, _fill_empty_paths, fit_router


@pytest.fixture(scope="module")
def train_texts(corpus_dir: Path) -> list[str]:
    return [d["text"] for d in iter_jsonl(corpus_dir / "train.jsonl")]


def test_saved_router_routes_identically(train_texts: list[str], tmp_path: Path) -> None:
    router = fit_router(train_texts, num_paths=4, seed=0)
    router.save(tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["router.json", "router.safetensors"]
    loaded = Router.load(tmp_path / "r")
    assert loaded.num_paths == 4 and loaded.prefix_tokens == 32
    np.testing.assert_array_equal(loaded.route(train_texts), router.route(train_texts))
    np.testing.assert_array_equal(loaded.centroids, router.centroids)


def test_route_uses_only_the_prefix(train_texts: list[str]) -> None:
    router = fit_router(train_texts, num_paths=3, prefix_tokens=16, seed=1)
    changed = [t.encode()[:16].decode("utf-8", errors="replace") + " and a different tail" for t in train_texts]
    np.testing.assert_array_equal(router.route(changed), router.route(train_texts))


def test_every_path_gets_a_document(train_texts: list[str]) -> None:
    for k in (2, 4, 8):
        labels = fit_router(train_texts, num_paths=k, seed=0).route(train_texts)
        assert set(labels.tolist()) == set(range(k))


def test_duplicate_prefixes_still_fill_every_path() -> None:
    # Ten copies of one prefix and two others: 3 distinct points for 3 paths, each path gets one of them.
    texts = ["import os\n" * 5] * 10 + ["/* a C comment */\n" * 3, "Copyright (c) 1999 someone\n" * 2]
    labels = fit_router(texts, num_paths=3, seed=0).route(texts)
    assert sorted(np.bincount(labels).tolist()) == [1, 1, 10]


def test_empty_path_gets_its_centroid_moved() -> None:
    x = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9], [0.5, 0.5]])
    centroids = np.array([[1.0, 0.0], [0.0, 1.0], [-5.0, -5.0]])  # path 2 is far from every document
    fixed = _fill_empty_paths(x, centroids)
    np.testing.assert_array_equal(fixed[:2], centroids[:2])
    np.testing.assert_array_equal(fixed[2], x[4])  # the document farthest from its own centroid
    assert (centroids[2] == [-5.0, -5.0]).all(), "the input is not modified"


def test_too_few_distinct_prefixes_is_an_error() -> None:
    with pytest.raises(RouterError, match="3 paths a document: only 2 distinct prefixes among 10"):
        fit_router(["same text here"] * 5 + ["other words"] * 5, num_paths=3, seed=0)


def test_fewer_documents_than_paths_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot route 3 documents to 5 paths"):
        fit_router(["a b c", "d e f", "g h i"], num_paths=5)


def test_load_missing_router_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(RouterError, match="no saved router"):
        Router.load(tmp_path)
