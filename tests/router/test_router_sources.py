from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from router.cli import app
from router.corpus import CorpusError, iter_jsonl
from router.router import RouterError
from router.shards import ShardOptions, shard_corpus
from router.sources import build_corpus_from, iter_documents

LONG = "a document long enough to keep: " * 4


def _all_docs(out: Path) -> list[dict[str, str]]:
    return list(iter_jsonl(out / "train.jsonl")) + list(iter_jsonl(out / "heldout.jsonl"))


def test_text_directory_counts_every_skip(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "news").mkdir(parents=True)
    (src / "code").mkdir()
    (src / "news" / "a.txt").write_text("news " + LONG)
    (src / "news" / "b.md").write_text("more news " + LONG)
    (src / "code" / "c.txt").write_bytes(b"caf\xe9 " + LONG.encode())  # invalid UTF-8: replaced, counted
    (src / "code" / "empty.txt").write_text("   \n")
    (src / "code" / "short.txt").write_text("too short")
    (src / "code" / "dup.txt").write_text("news " + LONG)
    (src / "code" / "bin.txt").write_bytes(b"\x00\x01" * 50)
    (src / "code" / "ignored.bin").write_text(LONG)
    unreadable = src / "code" / "locked.txt"
    unreadable.write_text("locked " + LONG)
    unreadable.chmod(0)
    can_read = os.access(unreadable, os.R_OK)  # root reads it anyway
    try:
        manifest = build_corpus_from(src, tmp_path / "out", heldout_fraction=0.0)
    finally:
        unreadable.chmod(0o644)
    docs = _all_docs(tmp_path / "out")
    expected = {"binary": 1, "duplicate": 1, "empty": 1, "too_short": 1, **({} if can_read else {"unreadable": 1})}
    assert manifest["skipped"] == expected
    assert len(docs) + sum(expected.values()) == 8  # every .txt/.md file is kept or counted
    assert len(docs) == (4 if can_read else 3)
    assert manifest["utf8_replacements"] == 1
    assert {d["domain"] for d in docs} == {"news", "code"}
    assert manifest["splits"]["train"]["documents"] == len(docs)


def test_jsonl_with_bad_lines(tmp_path: Path) -> None:
    lines = [json.dumps({"text": f"doc {i} " + LONG, "domain": "d" + str(i % 2)}) for i in range(20)]
    lines += ["{not json", json.dumps({"body": LONG}), json.dumps(["a list"]), "", json.dumps({"text": 5})]
    (tmp_path / "c.jsonl").write_bytes(
        "\n".join(lines).encode() + b"\n" + b'{"text": "bad \xff ' + LONG.encode() + b'"}\n'
    )
    manifest = build_corpus_from(tmp_path / "c.jsonl", tmp_path / "out", heldout_fraction=0.2)
    assert manifest["skipped"] == {"invalid_json": 1, "missing_text": 3}
    assert manifest["utf8_replacements"] == 1
    docs = _all_docs(tmp_path / "out")
    assert len(docs) == 21 and manifest["splits"]["heldout"]["documents"] > 0
    again = build_corpus_from(tmp_path / "c.jsonl", tmp_path / "again", heldout_fraction=0.2)
    assert again["splits"] == manifest["splits"]  # deterministic split


def test_parquet_streams_in_batches(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    texts = [f"row {i} " + LONG for i in range(2500)] + ["", None]
    table = pa.table({"content": texts, "domain": ["x" if i % 3 else "y" for i in range(len(texts))]})
    pq.write_table(table, tmp_path / "c.parquet", row_group_size=500)
    with pytest.raises(CorpusError, match="no column 'text'"):
        build_corpus_from(tmp_path / "c.parquet", tmp_path / "bad")
    manifest = build_corpus_from(tmp_path / "c.parquet", tmp_path / "out", text_field="content")
    assert manifest["skipped"] == {"empty": 1, "missing_text": 1}
    assert sum(manifest["splits"][s]["documents"] for s in ("train", "heldout")) == 2500
    assert sorted(manifest["domains"]) == ["x", "y"]


def test_fewer_documents_than_paths_and_missing_source(tmp_path: Path) -> None:
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": f"{i} " + LONG}) for i in range(3)) + "\n")
    build_corpus_from(tmp_path / "c.jsonl", tmp_path / "out", heldout_fraction=0.0)
    with pytest.raises(RouterError, match="cannot route 3 documents to 4 paths"):
        shard_corpus(tmp_path / "out", tmp_path / "s", ShardOptions(num_paths=4))
    with pytest.raises(CorpusError, match="does not exist"):
        list(iter_documents(tmp_path / "nope"))
    (tmp_path / "e.jsonl").write_text("{}\n")
    with pytest.raises(CorpusError, match=r"no usable document .*missing_text"):
        build_corpus_from(tmp_path / "e.jsonl", tmp_path / "e")
    assert not (tmp_path / "e" / "manifest.json").exists()


def test_corpus_command_from_jsonl_then_shard_with_levels(tmp_path: Path) -> None:
    words = ["alpha", "beta", "gamma", "delta"]
    lines = [
        json.dumps({"body": f"{words[i % 4]} {i} {words[i % 4]} " + LONG, "domain": words[i % 4]}) for i in range(80)
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    result = CliRunner().invoke(
        app,
        [
            "corpus",
            "--out",
            str(tmp_path / "c"),
            "--from",
            str(tmp_path / "c.jsonl"),
            "--format",
            "jsonl",
            "--text-field",
            "body",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "alpha" in result.output and "total" in result.output
    result = CliRunner().invoke(
        app, ["shard", "--corpus", str(tmp_path / "c"), "--out", str(tmp_path / "s"), "--paths", "4", "--levels", "2,2"]
    )
    assert result.exit_code == 0, result.output
    assert "token share" in result.output
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["levels"] == [2, 2]
    result = CliRunner().invoke(
        app, ["corpus", "--out", str(tmp_path / "x"), "--from", str(tmp_path / "c.jsonl"), "--format", "csv"]
    )
    assert result.exit_code == 1 and "unknown format 'csv'" in result.output


def test_domain_field_names_the_domain_and_a_typo_is_an_error(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    rows = [{"text": f"{lang} {i} " + LONG, "lang": lang} for lang in ("de", "fr") for i in range(3)]
    rows.append({"text": "no language " + LONG})  # takes the file's name, and is counted
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    manifest = build_corpus_from(src, tmp_path / "out", domain_field="lang", heldout_fraction=0.0)
    assert sorted(manifest["domains"]) == ["de", "docs", "fr"]
    assert manifest["domains"]["de"]["train"]["documents"] == 3
    assert manifest["without_domain_field"] == 1
    assert manifest["source"]["domain_field"] == "lang"
    assert {d["domain"] for d in _all_docs(tmp_path / "out")} == {"de", "fr", "docs"}
    # A field no document has is a typo, not one domain per file: an error, and no corpus is left behind.
    with pytest.raises(CorpusError, match="no document of .* has the domain field 'language'"):
        build_corpus_from(src, tmp_path / "typo", domain_field="language", heldout_fraction=0.0)
    assert not (tmp_path / "typo" / "manifest.json").exists()
    # Not named: a 'domain' field where present, else the file's name, and nothing is counted as missing.
    src.write_text(json.dumps({"text": "x " + LONG, "domain": "news"}) + "\n" + json.dumps({"text": "y " + LONG}))
    manifest = build_corpus_from(src, tmp_path / "default", heldout_fraction=0.0)
    assert sorted(manifest["domains"]) == ["docs", "news"] and "without_domain_field" not in manifest


def test_domain_field_from_the_command_line(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"{i} " + LONG, "lang": "sv"}) + "\n" for i in range(4)))
    result = CliRunner().invoke(
        app, ["corpus", "--from", str(src), "--out", str(tmp_path / "c"), "--domain-field", "lang"]
    )
    assert result.exit_code == 0, result.output
    assert list(json.loads((tmp_path / "c" / "manifest.json").read_text())["domains"]) == ["sv"]
    result = CliRunner().invoke(app, ["corpus", "--out", str(tmp_path / "d"), "--domain-field", "lang"])
    assert result.exit_code != 0 and "use it with --from" in result.output
