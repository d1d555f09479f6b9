"""A second, multilingual corpus given in source order: the translated manual pages of a Debian machine.

Translations live in `/usr/share/man/<lang>/man<N>/*.gz` (troff, UTF-8). Most come from the `manpages-l10n`
packages, one per language: `manpages-de`, `manpages-fr`, `manpages-es`, `manpages-it`, `manpages-pl`,
`manpages-pt-br`, `manpages-ro`, `manpages-ru`, `manpages-uk`, `manpages-nl`, `manpages-sv`, `manpages-da`,
`manpages-cs`, `manpages-fi`, `manpages-hu`, `manpages-id`, `manpages-el`, `manpages-mk`, `manpages-nb`,
`manpages-sr`, `manpages-vi`; plus `manpages-ja`, `manpages-tr`, `manpages-zh`, and the translations that
ordinary packages ship with their own pages (dpkg, apt, man-db, procps, xz-utils, ...). Nothing is downloaded:
`apt-get install manpages-de manpages-fr ...` adds languages, and this module reads what is installed.

The corpus is deliberately **in source order**, as users' corpora often are: every document of one language,
then the next (languages sorted by name, pages by path, a page's pieces in order). Each page is cleaned to prose
(`router.troff`) and cut at line boundaries into documents of at most `max_doc_bytes` bytes, so a document is a
few paragraphs of one page, in one language. `write_manpages_jsonl` writes them as JSON lines
(`{"id", "lang", "text"}`); `build_manpages_corpus` then builds the usual corpus layout from that file exactly as
`dipaco router corpus --from FILE --domain-field lang` would (`router.sources.build_corpus_from`), so its
train split keeps the languages in blocks. Shards are shuffled when they are written (`router.shards`), which is
what makes such a corpus train well.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from router.corpus import CorpusError
from router.sources import build_corpus_from
from router.troff import troff_to_text

log = logging.getLogger(__name__)

MAN_ROOT = Path("/usr/share/man")
SOURCE_FILE = "manpages-source.jsonl"
"""The source-ordered JSON-lines file `build_manpages_corpus` writes into the corpus directory."""
DOMAIN_FIELD = "lang"
MIN_LANGUAGES = 2


def manpage_languages(root: Path = MAN_ROOT, *, min_pages: int = 30) -> dict[str, int]:
    """{language directory: compressed pages} for every translation under `root` with at least `min_pages`
    pages, sorted by name (`man1` ... `man9` hold the untranslated pages and are not languages)."""
    if not root.is_dir():
        return {}
    found: dict[str, int] = {}
    for entry in sorted(root.iterdir()):
        if not entry.is_dir() or entry.name.startswith("man"):
            continue
        pages = len(_pages(entry))
        if pages >= min_pages:
            found[entry.name] = pages
    return found


def _pages(lang_dir: Path) -> list[Path]:
    return sorted(p for p in lang_dir.glob("man*/*.gz") if p.is_file())


def split_text(text: str, *, max_doc_bytes: int) -> list[str]:
    """Cut `text` at line boundaries into pieces of at most `max_doc_bytes` UTF-8 bytes (a longer line is a
    piece of its own, cut at a character boundary)."""
    pieces: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        data = line.encode("utf-8")
        while len(data) > max_doc_bytes:  # one very long line: cut it hard, on a character boundary
            cut = data[:max_doc_bytes].decode("utf-8", errors="ignore")
            if current:
                pieces.append("".join(current))
                current, size = [], 0
            pieces.append(cut)
            data = data[len(cut.encode("utf-8")) :]
        line = data.decode("utf-8")
        if size + len(data) > max_doc_bytes and current:
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(data)
    if current:
        pieces.append("".join(current))
    return [p for p in pieces if p.strip()]


def iter_manpage_documents(
    root: Path, languages: Sequence[str], *, max_doc_bytes: int, min_doc_bytes: int, skipped: dict[str, int]
) -> Iterator[dict[str, str]]:
    """The documents of each language in turn (source order); unreadable pages and too-short pieces are counted
    in `skipped` by reason."""
    for lang in languages:
        for page in _pages(root / lang):
            rel = page.relative_to(root).as_posix()
            try:
                with gzip.open(page, "rb") as fh:
                    raw = fh.read()
            except (OSError, EOFError, zlib.error) as exc:
                log.debug("manpages: cannot read %s: %s", page, exc)
                skipped["unreadable"] = skipped.get("unreadable", 0) + 1
                continue
            text = troff_to_text(raw.decode("utf-8", errors="replace"))
            for k, piece in enumerate(split_text(text, max_doc_bytes=max_doc_bytes)):
                if len(piece.encode("utf-8")) < min_doc_bytes:
                    skipped["too_short"] = skipped.get("too_short", 0) + 1
                    continue
                yield {"id": f"{rel}#{k}", DOMAIN_FIELD: lang, "text": piece}


def write_manpages_jsonl(
    path: Path,
    *,
    root: Path = MAN_ROOT,
    languages: Sequence[str] | None = None,
    min_pages: int = 30,
    max_doc_bytes: int = 2000,
    min_doc_bytes: int = 200,
) -> dict[str, Any]:
    """Write the source-ordered JSON-lines file (write then rename); returns a summary: languages with their
    documents and bytes, and the skips. `languages` None: every translation with `min_pages` pages or more.
    Fewer than two languages with documents raises `CorpusError` naming the packages to install."""
    if not 0 < min_doc_bytes <= max_doc_bytes:
        raise CorpusError(f"need 0 < min_doc_bytes <= max_doc_bytes, got {min_doc_bytes} and {max_doc_bytes}")
    available = manpage_languages(root, min_pages=1)
    if languages is None:
        chosen = [lang for lang, pages in available.items() if pages >= min_pages]
    else:
        unknown = [lang for lang in languages if lang not in available]
        if unknown:
            raise CorpusError(
                f"no translated manual pages for {unknown} under {root} (found: {sorted(available) or 'none'}); "
                "install them, e.g. apt-get install manpages-de manpages-fr"
            )
        chosen = list(dict.fromkeys(languages))
    summary: dict[str, Any] = {"root": str(root), "languages": {}, "skipped": {}}
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(tmp, "wb") as fh:
            for doc in iter_manpage_documents(
                root, chosen, max_doc_bytes=max_doc_bytes, min_doc_bytes=min_doc_bytes, skipped=summary["skipped"]
            ):
                fh.write(json.dumps(doc, ensure_ascii=False).encode("utf-8") + b"\n")
                entry = summary["languages"].setdefault(doc[DOMAIN_FIELD], {"documents": 0, "bytes": 0})
                entry["documents"] += 1
                entry["bytes"] += len(doc["text"].encode("utf-8"))
        if len(summary["languages"]) < MIN_LANGUAGES:
            raise CorpusError(
                f"translated manual pages in {len(summary['languages'])} language(s) under {root} "
                f"({sorted(summary['languages']) or 'none'}, of {chosen or 'none'} with >= {min_pages} pages); need "
                f"at least {MIN_LANGUAGES}: apt-get install manpages-de manpages-fr manpages-es ... (see "
                "docs/QUALITY.md), or lower min_pages"
            )
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("manpages: %s", {k: v["documents"] for k, v in summary["languages"].items()})
    return summary


def build_manpages_corpus(
    out_dir: Path,
    *,
    root: Path = MAN_ROOT,
    languages: Sequence[str] | None = None,
    min_pages: int = 30,
    max_doc_bytes: int = 2000,
    min_doc_bytes: int = 200,
    heldout_fraction: float = 0.1,
) -> dict[str, Any]:
    """The multilingual corpus in `out_dir`: `manpages-source.jsonl` (source order), then `train.jsonl`,
    `heldout.jsonl` and the manifest from it (domain = the `lang` field), as `dipaco router corpus --from`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / SOURCE_FILE
    summary = write_manpages_jsonl(
        source,
        root=root,
        languages=languages,
        min_pages=min_pages,
        max_doc_bytes=max_doc_bytes,
        min_doc_bytes=min_doc_bytes,
    )
    made = {
        "root": summary["root"],
        "parameters": {"min_pages": min_pages, "max_doc_bytes": max_doc_bytes, "min_doc_bytes": min_doc_bytes},
        "skipped": dict(sorted(summary["skipped"].items())),
    }
    return build_corpus_from(
        source,
        out_dir,
        fmt="jsonl",
        domain_field=DOMAIN_FIELD,
        heldout_fraction=heldout_fraction,
        min_doc_bytes=1,  # pieces under min_doc_bytes were left out (and counted) above
        extra={"manpages": made},
    )
