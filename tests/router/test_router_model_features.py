"""Routing on a path model's own hidden states (paper §2.4) instead of hashed n-grams."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from modules import ModelConfig, init_state
from router.cli import app
from router.model_features import FeaturizerError, ModelFeaturizer, load_exported
from router.router import Router, fit_router
from router.shards import ShardOptions, load_manifest, shard_corpus

CFG = ModelConfig(vocab_size=257, seq_len=64, d_model=32, n_layers=2, n_heads=2, block="gpt2")
LLAMA = ModelConfig.from_dict({**CFG.to_dict(), "block": "llama"})
BLOCKS = pytest.mark.parametrize("cfg", [CFG, LLAMA], ids=["gpt2", "llama"])
TEXTS = [f"def function_{i}(x):\n    return x + {i}\n" for i in range(12)] + [
    f"Copyright (C) {2000 + i} The Authors. Permission is hereby granted" for i in range(12)
]


def featurizer(cfg: ModelConfig = CFG) -> ModelFeaturizer:
    return ModelFeaturizer.from_state(cfg, init_state(cfg, seed=0))


@BLOCKS
def test_embed_reads_only_the_prefix_and_ignores_padding(cfg: ModelConfig) -> None:
    f = featurizer(cfg)
    x = f.embed(TEXTS, prefix_tokens=16)
    assert x.shape == (24, 32) and np.allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-5)
    same_prefix = f.embed([t + " and a different ending" for t in TEXTS], prefix_tokens=16)
    np.testing.assert_allclose(x, same_prefix, atol=1e-6)
    # a short text alone and batched with longer ones (right padding) gets the same features
    alone = f.embed(["ab"], prefix_tokens=16)
    batched = f.embed(["ab", "a much longer text than two bytes"], prefix_tokens=16)[:1]
    np.testing.assert_allclose(alone, batched, atol=1e-5)
    with pytest.raises(FeaturizerError, match="longer than the model's 64"):
        f.embed(TEXTS, prefix_tokens=65)


@BLOCKS
def test_features_are_the_mean_final_norm_state(cfg: ModelConfig) -> None:
    f = featurizer(cfg)
    ids = torch.tensor([list(TEXTS[0].encode())[:16]])
    want = torch.nn.functional.normalize(f.model.hidden(ids).mean(1), dim=1)
    np.testing.assert_allclose(f.embed(TEXTS[:1], prefix_tokens=16), want.detach().numpy(), atol=1e-6)


def test_a_config_without_block_is_a_gpt2_featurizer(tmp_path: Path) -> None:
    # featurizers saved before `block` existed are gpt2 paths, whatever the default block is now
    legacy = {k: v for k, v in CFG.to_dict().items() if k not in ("block", "tie_embeddings")}
    save_file(init_state(CFG, seed=0), str(tmp_path / "featurizer.safetensors"))
    (tmp_path / "featurizer.json").write_text(json.dumps(legacy))
    assert ModelFeaturizer.load(tmp_path).cfg.block == "gpt2"


def test_router_with_model_features_saves_and_loads(tmp_path: Path) -> None:
    router = fit_router(TEXTS, num_paths=2, prefix_tokens=16, seed=0, model=featurizer())
    routes = router.route(TEXTS)
    assert set(routes.tolist()) == {0, 1}
    router.save(tmp_path / "r")
    assert json.loads((tmp_path / "r" / "router.json").read_text())["model_features"] is True
    loaded = Router.load(tmp_path / "r")
    assert loaded.model is not None
    np.testing.assert_array_equal(loaded.route(TEXTS), routes)


def _export(directory: Path, cfg: ModelConfig = CFG) -> Path:
    """The layout `dipaco export` writes: model.safetensors + config.json."""
    directory.mkdir()
    save_file(init_state(cfg, seed=0), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg.to_dict()))
    return directory


@BLOCKS
def test_shards_routed_by_an_exported_path(corpus_dir: Path, tmp_path: Path, cfg: ModelConfig) -> None:
    exported = _export(tmp_path / "exported", cfg)
    assert load_exported(exported).cfg == cfg
    manifest = shard_corpus(corpus_dir, tmp_path / "s", ShardOptions(num_paths=3), featurizer=load_exported(exported))
    assert load_manifest(tmp_path / "s")["num_paths"] == 3 == len(manifest["shards"])
    assert all(s["num_documents"] > 0 for s in manifest["shards"])
    assert Router.load(tmp_path / "s" / "router").model is not None
    again = shard_corpus(corpus_dir, tmp_path / "s2", ShardOptions(num_paths=3), featurizer=load_exported(exported))
    assert [s["sha256"] for s in again["shards"]] == [s["sha256"] for s in manifest["shards"]]


def test_cli_features_model(corpus_dir: Path, tmp_path: Path) -> None:
    exported = _export(tmp_path / "exported")
    runner = CliRunner()
    ok = runner.invoke(
        app,
        [
            "shard",
            "--corpus",
            str(corpus_dir),
            "--out",
            str(tmp_path / "s"),
            "--paths",
            "2",
            "--features-model",
            str(exported),
        ],
    )
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(
        app,
        [
            "shard",
            "--corpus",
            str(corpus_dir),
            "--out",
            str(tmp_path / "t"),
            "--paths",
            "2",
            "--features-model",
            str(tmp_path / "missing"),
        ],
    )
    assert bad.exit_code == 1 and "no featurizer model" in bad.output
