from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from router.balance import BalanceError, fit_bias, token_shares
from router.corpus import iter_jsonl
from router.router import Router, RouterError, fit_router, level_blocks
from router.shards import ShardError, ShardOptions, shard_corpus


def test_bias_brings_every_path_within_bounds() -> None:
    rng = np.random.default_rng(0)
    # Path 0 is nearest for 80% of the documents.
    s = rng.normal(size=(500, 4))
    s[:400, 0] -= 3.0
    sizes = rng.integers(50, 200, size=500).astype(float)
    before = token_shares(np.argmin(s, axis=1), sizes, 4)
    assert before.max() > 2.0
    bias = fit_bias(s, sizes, min_share=0.5, max_share=2.0)
    shares = token_shares(np.argmin(s + bias, axis=1), sizes, 4)
    assert shares.min() >= 0.5 and shares.max() <= 2.0
    np.testing.assert_array_equal(fit_bias(s, sizes), bias)  # deterministic
    tight = token_shares(np.argmin(s + fit_bias(s, sizes, min_share=0.9, max_share=1.1), axis=1), sizes, 4)
    assert tight.min() >= 0.9 and tight.max() <= 1.1


def test_identical_prefixes_cannot_be_split() -> None:
    s = np.array([[0.0, 1.0]] * 9 + [[1.0, 0.0]])  # nine identical documents
    sizes = np.ones(10)
    with pytest.raises(BalanceError, match="identical prefix hold 1.80 x the fair share"):
        fit_bias(s, sizes, min_share=0.5, max_share=1.5)
    bias = fit_bias(s, sizes, min_share=0.5, max_share=1.5, strict=False)
    assert token_shares(np.argmin(s + bias, axis=1), sizes, 2).tolist() == [1.8, 0.2]
    with pytest.raises(BalanceError, match="exceeds the cap"):
        fit_bias(np.zeros((2, 2)), np.array([100.0, 1.0]), max_share=1.5)


def test_shards_are_balanced_on_the_local_corpus(corpus_dir: Path, tmp_path: Path) -> None:
    for k in (4, 8):
        manifest = shard_corpus(corpus_dir, tmp_path / str(k), ShardOptions(num_paths=k))
        balance = manifest["balance"]
        assert balance["enabled"] and balance["satisfied"]
        assert all(0.5 <= x <= 2.0 for x in balance["token_shares"]), balance
        tokens = [s["num_tokens"] for s in manifest["shards"]]
        fair = sum(tokens) / k
        assert min(tokens) >= 0.5 * fair and max(tokens) <= 2.0 * fair
        assert manifest["purity"] > manifest["purity_random"] + 0.2
        router = Router.load(tmp_path / str(k) / "router")
        assert router.bias is not None and router.bias.shape == (k,)


def test_product_kmeans_routes_by_mixed_radix(corpus_dir: Path) -> None:
    texts = [d["text"] for d in iter_jsonl(corpus_dir / "train.jsonl")]
    router = fit_router(texts, num_paths=6, levels=[2, 3], seed=0)
    dims = router.components.shape[0]
    assert router.centroids.shape == (6, dims) and router.levels == (2, 3)
    x = router.embed(texts)
    blocks = level_blocks(dims, 2)
    # Level l's centroids are the distinct rows of the table restricted to its block.
    c0 = router.centroids[[0, 3]][:, blocks[0]]
    c1 = router.centroids[[0, 1, 2]][:, blocks[1]]
    d0 = np.argmin(((x[:, None, blocks[0]] - c0[None]) ** 2).sum(-1), axis=1)
    d1 = np.argmin(((x[:, None, blocks[1]] - c1[None]) ** 2).sum(-1), axis=1)
    np.testing.assert_array_equal(router.route(texts), d0 * 3 + d1)
    with pytest.raises(RouterError, match=r"levels \[2, 2\] do not multiply to num_paths=3"):
        fit_router(texts, num_paths=3, levels=[2, 2])


def test_shard_corpus_with_levels(corpus_dir: Path, tmp_path: Path) -> None:
    manifest = shard_corpus(corpus_dir, tmp_path / "s", ShardOptions(num_paths=4, levels=[2, 2]))
    assert manifest["levels"] == [2, 2] and len(manifest["shards"]) == 4
    assert manifest["balance"]["satisfied"]
    config = json.loads((tmp_path / "s" / "router" / "router.json").read_text())
    assert config["levels"] == [2, 2] and config["balanced"] is True


def test_fit_on_a_sample_is_deterministic(corpus_dir: Path, tmp_path: Path) -> None:
    a = shard_corpus(corpus_dir, tmp_path / "a", ShardOptions(num_paths=3, fit_sample=300, batch_docs=100))
    b = shard_corpus(corpus_dir, tmp_path / "b", ShardOptions(num_paths=3, fit_sample=300, batch_docs=7))
    assert a == b and a["fit_documents"] == 300
    for shard in a["shards"]:
        assert (tmp_path / "a" / shard["file"]).read_bytes() == (tmp_path / "b" / shard["file"]).read_bytes()


def test_strict_balance_names_the_problem(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="balancing .* over 4 paths: could not balance"):
        options = ShardOptions(num_paths=4, min_share=0.999, max_share=1.001, strict_balance=True)
        shard_corpus(corpus_dir, tmp_path / "s", options)
    assert not (tmp_path / "s" / "manifest.json").exists()
