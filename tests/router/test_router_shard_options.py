"""shard_corpus options: per-shard held-out slices, top-2 overlapping training shards, the BPE tokenizer."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from router.bpe import EOS_TOKEN, BPETokenizer, train_bpe
from router.cli import app
from router.corpus import build_local_corpus, iter_jsonl
from router.router import Router
from router.shards import ShardError, ShardOptions, document_key, document_order, load_manifest, shard_corpus
from router.tokenizer import TOKEN_DTYPE, ByteTokenizer


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("small_corpus")
    build_local_corpus(out, max_docs_per_domain=20)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_heldout_slices_are_deterministic_and_verified(
    corpus_dir: Path, tmp_path: Path, shards4: tuple[Path, dict[str, Any]]
) -> None:
    base_dir, base = shards4
    a = shard_corpus(corpus_dir, tmp_path / "a", ShardOptions(num_paths=4, heldout_docs_per_shard=3))
    b = shard_corpus(corpus_dir, tmp_path / "b", ShardOptions(num_paths=4, heldout_docs_per_shard=3))
    assert a == b and _files(tmp_path / "a") == _files(tmp_path / "b")
    assert load_manifest(tmp_path / "a") == a and a["heldout_docs_per_shard"] == 3
    # Routing is unchanged; each path's training shard + held-out slice is exactly its default shard.
    assert (tmp_path / "a" / "router" / "router.safetensors").read_bytes() == (
        base_dir / "router" / "router.safetensors"
    ).read_bytes()
    assert a["purity"] == base["purity"] and a["balance"] == base["balance"]
    for shard, full in zip(a["shards"], base["shards"], strict=True):
        held = shard["heldout"]
        assert held["file"] == f"path-{shard['path_index']:04d}.heldout.tokens" and held["num_documents"] == 3
        train_bytes = (tmp_path / "a" / shard["file"]).read_bytes()
        held_bytes = (tmp_path / "a" / held["file"]).read_bytes()
        assert train_bytes + held_bytes == (base_dir / full["file"]).read_bytes()
        assert hashlib.sha256(held_bytes).hexdigest() == held["sha256"]
        tokens = np.frombuffer(held_bytes, dtype=TOKEN_DTYPE)
        assert tokens.size == held["num_tokens"] and int((tokens == ByteTokenizer.EOS).sum()) == 3
        assert shard["num_documents"] + 3 == full["num_documents"]
        assert shard["num_tokens"] + held["num_tokens"] == full["num_tokens"]
        assert sum(held["domains"].values()) == 3
    # Tampering with a held-out slice is detected.
    target = tmp_path / "a" / a["shards"][2]["heldout"]["file"]
    data = bytearray(target.read_bytes())
    data[0] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"path-0002\.heldout\.tokens has sha256"):
        load_manifest(tmp_path / "a")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_paths": 0}, "num_paths=0 must be >= 1"),
        ({"prefix_tokens": 0}, "prefix_tokens=0 must be >= 1"),
        ({"fit_sample": 0}, "fit_sample=0 and batch_docs=4096 must be >= 1"),
        ({"batch_docs": 0}, "fit_sample=50000 and batch_docs=0 must be >= 1"),
        ({"min_share": 1.5}, "need 0 <= min_share <= 1 <= max_share, got 1.5 and 2.0"),
        ({"max_share": 0.9}, "need 0 <= min_share <= 1 <= max_share, got 0.5 and 0.9"),
        ({"min_tokens_per_shard": -1}, "min_tokens_per_shard=-1 must be >= 0"),
        ({"heldout_docs_per_shard": -1}, "heldout_docs_per_shard=-1 must be >= 0"),
        ({"num_paths": 1, "overlap_top2": True}, "overlap_top2 needs at least 2 paths, got num_paths=1"),
        ({"tokenizer": "wordpiece"}, "unknown tokenizer 'wordpiece'; use one of byte, bpe"),
        ({"tokenizer": "bpe", "vocab_size": 70_000}, r"vocab_size=70000 must be in \[257, 65535\]"),
    ],
)
def test_options_name_the_bad_value(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ShardError, match=message):
        ShardOptions(**{"num_paths": 2, **fields})


def test_options_are_keyword_only_and_vocab_size_is_for_bpe() -> None:
    with pytest.raises(TypeError):
        ShardOptions(2)  # type: ignore[call-arg]
    assert ShardOptions(num_paths=2, vocab_size=70_000).tokenizer == "byte"  # ignored with byte tokens


def test_heldout_needs_training_documents_left(corpus_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ShardError, match="cannot hold out 100000 documents per shard"):
        shard_corpus(corpus_dir, tmp_path / "s", ShardOptions(num_paths=2, heldout_docs_per_shard=100_000))
    assert not (tmp_path / "s").exists()  # refused before anything is written


def test_overlap_top2_puts_every_document_in_two_shards(
    corpus_dir: Path, tmp_path: Path, shards4: tuple[Path, dict[str, Any]]
) -> None:
    base_dir, base = shards4
    out = tmp_path / "o"
    m = shard_corpus(corpus_dir, out, ShardOptions(num_paths=4, overlap_top2=True))
    assert m["overlap_top2"] is True and load_manifest(out) == m
    # Top-1 routing (the saved router, balance, purity) is unchanged.
    assert (out / "router" / "router.safetensors").read_bytes() == (
        base_dir / "router" / "router.safetensors"
    ).read_bytes()
    assert m["purity"] == base["purity"] and m["balance"] == base["balance"]
    router = Router.load(out / "router")
    train = [d["text"] for d in iter_jsonl(corpus_dir / "train.jsonl")]
    assert router.bias is not None
    s = router.scores(router.embed(train)) + router.bias[None, :]
    top1 = np.argmin(s, axis=1)
    np.testing.assert_array_equal(top1, router.route(train))
    s[np.arange(len(train)), top1] = np.inf
    top2 = np.argmin(s, axis=1)
    assert (top1 != top2).all()
    tok = ByteTokenizer()
    total_docs = 0
    keys = np.asarray([document_key(t, seed=0) for t in train], dtype=np.uint64)
    in_order = np.argsort(document_order(keys, shuffle=True))  # the shard order: by rank
    for p, shard in enumerate(m["shards"]):
        expected = b"".join(tok.encode_array(train[i], eos=True).tobytes() for i in in_order if p in (top1[i], top2[i]))
        assert (out / shard["file"]).read_bytes() == expected
        assert shard["num_secondary_documents"] == int((top2 == p).sum())
        assert shard["num_documents"] == int((top1 == p).sum() + (top2 == p).sum())
        total_docs += shard["num_documents"]
    assert total_docs == 2 * len(train)  # every document in exactly two shards


def test_bpe_tokenizer_round_trip_and_eos() -> None:
    texts = ["hello world, hello routing", "def f(x):\n    return x + 1\n", "naïve café ✓ " * 3] * 20
    tok = train_bpe(iter(texts), vocab_size=300)
    assert tok.vocab_size <= 300 and tok.EOS == 0
    for t in texts[:3] + [f"a{EOS_TOKEN}b", ""]:
        ids = tok.encode_array(t, eos=True)
        assert ids.dtype == TOKEN_DTYPE and ids[-1] == tok.EOS and int((ids == tok.EOS).sum()) == 1
        assert tok.decode(ids) == t


def test_bpe_shards_are_deterministic(small_corpus: Path, tmp_path: Path) -> None:
    corpus_dir = small_corpus
    a = shard_corpus(corpus_dir, tmp_path / "a", ShardOptions(num_paths=2, tokenizer="bpe", vocab_size=600))
    b = shard_corpus(corpus_dir, tmp_path / "b", ShardOptions(num_paths=2, tokenizer="bpe", vocab_size=600))
    assert a == b and _files(tmp_path / "a") == _files(tmp_path / "b")
    assert load_manifest(tmp_path / "a") == a
    entry = a["tokenizer"]
    assert entry["kind"] == "bpe" and entry["file"] == "tokenizer.json" and entry["vocab_size"] == 600
    assert hashlib.sha256((tmp_path / "a" / "tokenizer.json").read_bytes()).hexdigest() == entry["sha256"]
    assert a["eos"] == 0
    tok = BPETokenizer.load(tmp_path / "a" / "tokenizer.json")
    router = Router.load(tmp_path / "a" / "router")
    train = [d["text"] for d in iter_jsonl(corpus_dir / "train.jsonl")]
    labels = router.route(train)
    keys = np.asarray([document_key(t, seed=0) for t in train], dtype=np.uint64)
    in_order = np.argsort(document_order(keys, shuffle=True))
    for p, shard in enumerate(a["shards"]):
        tokens = np.fromfile(tmp_path / "a" / shard["file"], dtype=TOKEN_DTYPE)
        assert tokens.size == shard["num_tokens"] and int(tokens.max()) < 600 and tokens[-1] == tok.EOS
        ends = np.flatnonzero(tokens == tok.EOS)
        docs = [tok.decode(d) for d in np.split(tokens, ends + 1)[:-1]]
        assert docs == [train[i] for i in in_order if labels[i] == p]  # round trip, in the shard order
    (tmp_path / "a" / "tokenizer.json").write_text("{}")
    with pytest.raises(ShardError, match="tokenizer file .* has sha256"):
        load_manifest(tmp_path / "a")


def test_shard_command_options(small_corpus: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "shard",
            "--corpus",
            str(small_corpus),
            "--out",
            str(tmp_path / "s"),
            "--paths",
            "2",
            "--heldout-docs-per-shard",
            "1",
            "--overlap-top2",
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "400",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "held out 1 documents per shard" in result.output and "BPE tokenizer" in result.output
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["overlap_top2"] and manifest["heldout_docs_per_shard"] == 1
    assert manifest["tokenizer"]["vocab_size"] <= 400
    assert load_manifest(tmp_path / "s") == manifest
    result = runner.invoke(
        app,
        ["shard", "--corpus", str(small_corpus), "--out", str(tmp_path / "t"), "--paths", "2", "--tokenizer", "nope"],
    )
    assert result.exit_code == 1 and "unknown tokenizer" in result.output
