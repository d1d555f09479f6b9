"""Shared router fixtures: one small local corpus and its 4-path shards per test session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.corpus import build_local_corpus
from router.shards import ShardOptions, shard_corpus

DOCS_PER_DOMAIN = 100


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    build_local_corpus(out, max_docs_per_domain=DOCS_PER_DOMAIN)
    return out


@pytest.fixture(scope="session")
def shards4(corpus_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("shards4")
    return out, shard_corpus(corpus_dir, out, ShardOptions(num_paths=4))
