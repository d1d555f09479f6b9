from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from router.corpus import CorpusError, DomainSource, build_local_corpus, default_sources, iter_jsonl
from router.troff import troff_to_text


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_local_corpus(tmp_path / "a", max_docs_per_domain=15)
    b = build_local_corpus(tmp_path / "b", max_docs_per_domain=15)
    assert a == b
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert sorted(_files(tmp_path / "a")) == ["heldout.jsonl", "manifest.json", "train.jsonl"]


def test_manifest_describes_the_files(corpus_dir: Path) -> None:
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    available = [s.name for s in default_sources()]
    # Every domain of this machine is present (those without files are listed as missing, never dropped).
    assert sorted([*manifest["domains"], *manifest["missing_domains"]]) == sorted(available)
    assert len(manifest["domains"]) >= 2
    for split in ("train", "heldout"):
        info = manifest["splits"][split]
        data = (corpus_dir / info["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"]
        docs = list(iter_jsonl(corpus_dir / info["file"]))
        assert len(docs) == info["documents"]
        assert sum(len(d["text"].encode()) for d in docs) == info["bytes"]
        for name, entry in manifest["domains"].items():
            assert entry[split]["documents"] == sum(d["domain"] == name for d in docs)
    for entry in manifest["domains"].values():
        assert entry["train"]["documents"] > 0
        assert all(isinstance(n, int) and n > 0 for n in entry["skipped"].values())


def test_splits_are_disjoint_and_docs_respect_limits(corpus_dir: Path) -> None:
    train = list(iter_jsonl(corpus_dir / "train.jsonl"))
    heldout = list(iter_jsonl(corpus_dir / "heldout.jsonl"))
    assert heldout, "a 10% held-out split of a few hundred documents is never empty"
    assert not {d["id"] for d in train} & {d["id"] for d in heldout}
    assert not {d["text"] for d in train} & {d["text"] for d in heldout}
    for doc in train + heldout:
        assert set(doc) == {"id", "domain", "text"}
        assert doc["id"].startswith(doc["domain"] + "/")
        assert 200 <= len(doc["text"].encode()) <= 6000


def _source(root: Path, name: str, texts: dict[str, str]) -> DomainSource:
    (root / name).mkdir(parents=True)
    for fname, text in texts.items():
        (root / name / fname).write_text(text)
    return DomainSource(name=name, root=root / name, patterns=("*.txt",))


def test_skips_are_counted_and_lines_kept_whole(tmp_path: Path) -> None:
    long_lines = "".join(f"line {i:04d} of a long file\n" for i in range(100))
    sources = [
        _source(tmp_path / "src", "alpha", {"a.txt": long_lines, "short.txt": "tiny\n", "dup.txt": long_lines}),
        _source(tmp_path / "src", "beta", {"b.txt": "beta text\n" * 40}),
        DomainSource(name="gamma", root=tmp_path / "nowhere", patterns=("*.txt",)),
    ]
    manifest = build_local_corpus(
        tmp_path / "out", min_doc_bytes=100, max_doc_bytes=500, heldout_fraction=0.0, sources=sources
    )
    assert manifest["domains"]["alpha"]["skipped"] == {"duplicate": 1, "too_short": 1}
    assert manifest["missing_domains"] == ["gamma"]
    docs = {d["id"]: d["text"] for d in iter_jsonl(tmp_path / "out" / "train.jsonl")}
    alpha = next(t for i, t in docs.items() if i.startswith("alpha/"))
    assert len(alpha.encode()) <= 500 and alpha.endswith("\n") and long_lines.startswith(alpha)


def test_fewer_than_two_domains_is_an_error(tmp_path: Path) -> None:
    sources = [_source(tmp_path / "src", "only", {"a.txt": "x\n" * 200})]
    with pytest.raises(CorpusError, match="need at least 2"):
        build_local_corpus(tmp_path / "out", sources=sources)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_invalid_utf8_is_replaced_and_counted(tmp_path: Path) -> None:
    (tmp_path / "src" / "bad").mkdir(parents=True)
    (tmp_path / "src" / "bad" / "x.txt").write_bytes(b"caf\xe9 au lait\n" * 30)
    sources = [
        DomainSource(name="bad", root=tmp_path / "src" / "bad", patterns=("*.txt",)),
        _source(tmp_path / "src", "good", {"g.txt": "fine text\n" * 30}),
    ]
    manifest = build_local_corpus(tmp_path / "out", heldout_fraction=0.0, sources=sources)
    assert manifest["domains"]["bad"]["utf8_replacements"] == 30


def test_troff_becomes_prose() -> None:
    src = '.\\" a comment\n.TH LS 1\n.SH NAME\nls \\- list \\fBdirectory\\fR contents\n.PP\nMore text.\n'
    assert troff_to_text(src) == "NAME\nls - list directory contents\nMore text.\n"
