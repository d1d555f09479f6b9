from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from modules import ModelConfig
from modules.model import PathModel
from router.corpus import iter_jsonl
from router.evaluate import evaluate_routed
from router.refit import best_paths, refit_report, refit_router, routed_loss, score_all_paths
from router.router import HEAD_ROUTER_FORMAT, Router, RouterError
from router.shards import ROUTER_DIR

# The `dipaco router refit` command (it scores with a run's paths, so it talks to the coordinator) is tested in
# tests/test_router_commands.py.
MODEL = {"d_model": 32, "seq_len": 48, "n_heads": 2, "n_layers": 2}


def load_router(shards_dir: Path) -> Router:
    return Router.load(shards_dir / ROUTER_DIR)


@pytest.fixture(scope="module")
def heldout(corpus_dir: Path) -> list[str]:
    return [d["text"] for d in iter_jsonl(corpus_dir / "heldout.jsonl")]


def _shifted_losses(base: Router, docs: list[str], shift: int = 1) -> np.ndarray:
    """Losses that prefer path (k-means route + shift) % K for every document, with some noise."""
    k = base.num_paths
    routes = base.route(docs)
    rng = np.random.default_rng(0)
    losses = 3.0 + 0.1 * rng.random((len(docs), k))
    losses[np.arange(len(docs)), (routes + shift) % k] -= 1.0
    return losses


def test_refit_follows_the_losses(shards4: tuple[Path, dict[str, Any]], heldout: list[str]) -> None:
    base = load_router(shards4[0])
    losses = _shifted_losses(base, heldout)
    new = refit_router(losses, heldout, base)
    old_routes, new_routes = base.route(heldout), new.route(heldout)
    agree = float(np.mean(new_routes == best_paths(losses)))
    assert agree > 0.9, agree
    assert float(np.mean(new_routes == old_routes)) < 0.1
    # Without balancing the linear head reproduces the labels exactly (k-means regions are linear).
    free = refit_router(losses, heldout, base, min_share=0.0, max_share=100.0)
    assert np.array_equal(free.route(heldout), best_paths(losses))
    report = refit_report(losses, heldout, base, new)
    assert report.changed == int((new_routes != old_routes).sum()) and report.documents == len(heldout)
    assert report.new_loss < report.base_loss and report.oracle_loss <= report.new_loss
    assert routed_loss(losses, best_paths(losses)) == pytest.approx(report.oracle_loss)
    # Deterministic.
    again = refit_router(losses, heldout, base)
    assert again.head_weight is not None and new.head_weight is not None
    assert np.array_equal(again.head_weight, new.head_weight)
    assert again.bias is not None and new.bias is not None and np.array_equal(again.bias, new.bias)


def test_refit_shares_respect_the_target(shards4: tuple[Path, dict[str, Any]], heldout: list[str]) -> None:
    base = load_router(shards4[0])
    # Path 0 is best for every document: balancing alone must spread them to the target shares.
    losses = np.full((len(heldout), 4), 3.0)
    losses[:, 0] = 2.0
    losses[::3, 1] = 1.0  # some structure so the regression has two classes
    target = np.array([0.4, 0.2, 0.3, 0.1])
    new = refit_router(losses, heldout, base, target_shares=target, min_share=0.8, max_share=1.25)
    shares = np.bincount(new.route(heldout), minlength=4) / len(heldout)
    assert np.all(shares >= 0.8 * target - 1e-9) and np.all(shares <= 1.25 * target + 1e-9), shares
    with pytest.raises(RouterError, match="path_losses must be"):
        refit_router(losses[:, :3], heldout, base)
    with pytest.raises(RouterError, match="rows of losses"):
        refit_router(losses[:5], heldout, base)


def test_refit_router_save_load(shards4: tuple[Path, dict[str, Any]], heldout: list[str], tmp_path: Path) -> None:
    base = load_router(shards4[0])
    new = refit_router(_shifted_losses(base, heldout, shift=2), heldout, base)
    new.save(tmp_path / "r")
    config = json.loads((tmp_path / "r" / "router.json").read_text())
    assert config["format"] == HEAD_ROUTER_FORMAT and config["head"] is True
    loaded = Router.load(tmp_path / "r")
    for name in ("idf", "components", "centroids", "bias", "head_weight", "head_intercept"):
        assert np.array_equal(getattr(loaded, name), getattr(new, name)), name
    assert np.array_equal(loaded.route(heldout), new.route(heldout))
    # k-means routers keep format 1 and no head.
    assert "head" not in json.loads((shards4[0] / "router" / "router.json").read_text())


def test_score_all_paths_matches_routed_evaluation(heldout: list[str]) -> None:
    cfg = ModelConfig.from_dict(MODEL)
    models = []
    for seed in range(2):
        torch.manual_seed(seed)
        models.append(PathModel(cfg))
    docs = [*heldout[:10], "short"]
    losses = score_all_paths(models, docs, prefix_tokens=32, context=cfg.seq_len)
    assert losses.shape == (11, 2) and np.isnan(losses[-1]).all() and not np.isnan(losses[:-1]).any()
    assert not np.allclose(losses[:-1, 0], losses[:-1, 1])
    routes = np.arange(10) % 2

    class Fixed:
        num_paths, prefix_tokens = 2, 32

        def route(self, texts: list[str]) -> np.ndarray:
            return np.array([routes[docs.index(t)] for t in texts], dtype=np.int64)

    result = evaluate_routed(models, Fixed(), docs, context=cfg.seq_len)
    scored = np.array([len(d.encode()) + 1 - 32 for d in docs[:10]], dtype=np.float64)
    assert routed_loss(losses[:10], routes, scored) == pytest.approx(result.loss, rel=1e-9)
    assert np.allclose(
        score_all_paths(lambda p: models[p], docs, num_paths=2, context=cfg.seq_len), losses, equal_nan=True
    )
