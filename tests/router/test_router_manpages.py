"""The multilingual built-in corpus: translated manual pages, read in source order (one language, then the next)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from router.corpus import CorpusError, iter_jsonl
from router.manpages import MAN_ROOT, SOURCE_FILE, build_manpages_corpus, manpage_languages, split_text
from router.troff import troff_to_text

PAGE = """.TH LS 1
.SH {name}
{body}
.PP
{body2}
"""


def write_pages(root: Path, lang: str, pages: int, body: str) -> None:
    for i in range(pages):
        d = root / lang / "man1"
        d.mkdir(parents=True, exist_ok=True)
        text = PAGE.format(name=f"NAME {i}", body=f"{body} page {i}. " * 8, body2=f"{body} again {i}. " * 8)
        (d / f"page{i}.1.gz").write_bytes(gzip.compress(text.encode("utf-8")))


def test_corpus_keeps_languages_in_blocks_with_their_domain(tmp_path: Path) -> None:
    root = tmp_path / "man"
    write_pages(root, "de", 4, "Die Datei f\\(:ur den Benutzer")
    write_pages(root, "fr", 3, "Le fichier de l'utilisateur")
    (root / "man1").mkdir(parents=True)  # untranslated pages are not a language
    assert manpage_languages(root, min_pages=1) == {"de": 4, "fr": 3}
    manifest = build_manpages_corpus(tmp_path / "corpus", root=root, min_pages=1, heldout_fraction=0.0)
    assert sorted(manifest["domains"]) == ["de", "fr"]
    assert manifest["source"]["domain_field"] == "lang" and manifest["without_domain_field"] == 0
    docs = list(iter_jsonl(tmp_path / "corpus" / "train.jsonl"))
    langs = [d["domain"] for d in docs]
    assert langs == sorted(langs)  # source order: every German document, then every French one
    assert "für den Benutzer" in docs[0]["text"]  # groff's composite glyph, composed
    assert (tmp_path / "corpus" / SOURCE_FILE).is_file()


def test_too_few_languages_and_unknown_ones_are_clear_errors(tmp_path: Path) -> None:
    root = tmp_path / "man"
    write_pages(root, "de", 2, "Nur Deutsch hier")
    with pytest.raises(CorpusError, match="need at least 2: apt-get install manpages-de"):
        build_manpages_corpus(tmp_path / "c", root=root, min_pages=1)
    with pytest.raises(CorpusError, match=r"no translated manual pages for \['xx'\]"):
        build_manpages_corpus(tmp_path / "c", root=root, languages=["de", "xx"], min_pages=1)
    assert not (tmp_path / "c" / "manifest.json").exists()


def test_split_text_cuts_at_lines_within_the_byte_bound() -> None:
    text = "".join(f"line {i} äöü\n" for i in range(50)) + "x" * 500 + "\n"
    pieces = split_text(text, max_doc_bytes=120)
    assert all(len(p.encode("utf-8")) <= 120 for p in pieces)
    assert "".join(pieces).replace("\n", "") == text.replace("\n", "")


def test_troff_named_glyphs_of_translated_pages() -> None:
    assert troff_to_text("Gr\\(:o\\(sse, caf\\('e, \\(/lód\\[u00E9]\n").strip() == "Größe, café, łódé"


@pytest.mark.skipif(len(manpage_languages(MAN_ROOT)) < 2, reason="fewer than two translations under /usr/share/man")
def test_this_machines_manpages_build(tmp_path: Path) -> None:
    langs = list(manpage_languages(MAN_ROOT))[:2]
    manifest = build_manpages_corpus(tmp_path / "c", languages=langs)
    assert sorted(manifest["domains"]) == sorted(langs)
    assert manifest["splits"]["train"]["documents"] > 100
