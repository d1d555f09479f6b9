"""The local multi-domain corpus: text every Debian/Linux machine with Python has, split by document.

Domains are distinct kinds of text (Python source, C headers, manual pages, licences, changelogs), so a prefix
router has real structure to find (DiPaCo §2.4 routes documents by their first tokens). Everything here is
deterministic for a given machine: file lists are sorted, files are chosen by a stable hash of their path, and
the train / held-out split is a stable hash of the document id. Nothing is dropped silently: every skipped
file is counted by reason in the manifest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.troff import troff_to_text

log = logging.getLogger(__name__)

CORPUS_FORMAT = 1
SPLITS = ("train", "heldout")
TRAIN_FILE = "train.jsonl"
HELDOUT_FILE = "heldout.jsonl"
MANIFEST_FILE = "manifest.json"
MIN_DOMAINS = 2
# Raw bytes read from one file before cleaning: bounds the work on huge files (man pages shrink a lot when
# their markup is stripped, hence the headroom over max_doc_bytes).
_READ_FACTOR = 8


class CorpusError(ValueError):
    """The corpus cannot be built (too few domains, bad parameters) or read."""


@dataclass(frozen=True, slots=True)
class DomainSource:
    """Where one domain's documents come from."""

    name: str
    root: Path
    """Document ids are `"{name}/{path relative to root}"`."""
    patterns: tuple[str, ...]
    """`Path.glob` patterns relative to `root`; a pattern starting with `**/` walks the tree instead."""
    exclude_dirs: frozenset[str] = frozenset()
    """Directory names never descended into (and never part of a matched path)."""
    compressed: bool = False
    """Files are gzip-compressed."""
    clean: Callable[[str], str] | None = field(default=None)
    """Text cleaner applied after decoding (e.g. troff to prose)."""


def default_sources() -> list[DomainSource]:
    """The five domains, in the fixed order they are read."""
    share = Path("/usr/share")
    return [
        DomainSource(
            name="python",
            root=Path(sysconfig.get_paths()["stdlib"]),
            patterns=("**/*.py",),
            exclude_dirs=frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}),
        ),
        DomainSource(name="c_headers", root=Path("/usr/include"), patterns=("**/*.h",)),
        # man[1-8] directly under /usr/share/man: translations (/usr/share/man/<locale>/) are skipped.
        DomainSource(
            name="manpages", root=share / "man", patterns=("man[1-8]/*.gz",), compressed=True, clean=troff_to_text
        ),
        DomainSource(name="licenses", root=share, patterns=("common-licenses/*", "doc/*/copyright")),
        DomainSource(name="changelogs", root=share / "doc", patterns=("*/changelog*.gz",), compressed=True),
    ]


def stable_fraction(key: str) -> float:
    """A number in [0, 1) from sha256(key): the same on every machine and Python version."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2**64


def _candidates(source: DomainSource) -> list[str]:
    """Relative paths (POSIX) of the regular files of a domain, sorted."""
    found: set[str] = set()
    if not source.root.is_dir():
        return []
    for pattern in source.patterns:
        if pattern.startswith("**/"):
            tail = pattern[3:]
            for dirpath, dirnames, filenames in os.walk(source.root):
                dirnames[:] = sorted(d for d in dirnames if d not in source.exclude_dirs)
                base = Path(dirpath)
                for name in filenames:
                    path = base / name
                    if path.match(tail) and path.is_file():
                        found.add(path.relative_to(source.root).as_posix())
        else:
            for path in source.root.glob(pattern):
                rel = path.relative_to(source.root)
                if path.is_file() and not source.exclude_dirs.intersection(rel.parts[:-1]):
                    found.add(rel.as_posix())
    return sorted(found)


def _truncate_at_line(data: bytes, max_bytes: int) -> bytes:
    """At most max_bytes, cut just after the last newline; a file with no newline in range is cut hard."""
    if len(data) <= max_bytes:
        return data
    cut = data.rfind(b"\n", 0, max_bytes)
    return data[: cut + 1] if cut >= 0 else data[:max_bytes]


def _decode(data: bytes) -> tuple[str, int]:
    """UTF-8 with replacement; returns the text and how many replacement characters were introduced."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count("\ufffd") - data.count("\ufffd".encode())


@dataclass(slots=True)
class _DomainStats:
    candidates: int = 0
    visited: int = 0
    replacements: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _read_domain(
    source: DomainSource,
    *,
    max_docs: int,
    max_doc_bytes: int,
    min_doc_bytes: int,
    seen: set[str],
) -> tuple[list[dict[str, str]], _DomainStats]:
    stats = _DomainStats()
    rels = _candidates(source)
    stats.candidates = len(rels)
    # Choose files by a stable hash of their id rather than a seeded shuffle: adding a file elsewhere does not
    # change which of the existing ones are picked.
    order = sorted(rels, key=lambda rel: hashlib.sha256(f"{source.name}/{rel}".encode()).hexdigest())
    docs: list[dict[str, str]] = []
    limit = max_doc_bytes * _READ_FACTOR
    for rel in order:
        if len(docs) >= max_docs:
            break
        stats.visited += 1
        path = source.root / rel
        try:
            if source.compressed:
                with gzip.open(path, "rb") as fh:
                    raw = fh.read(limit)
            else:
                with open(path, "rb") as fh:
                    raw = fh.read(limit)
        except (OSError, EOFError, zlib.error) as exc:
            log.debug("corpus: cannot read %s: %s", path, exc)
            stats.skip("unreadable")
            continue
        if b"\x00" in raw:
            stats.skip("binary")
            continue
        if len(raw) == limit:
            raw = raw[: raw.rfind(b"\n") + 1] or raw  # do not clean half a line
        text, bad = _decode(raw)
        if source.clean is not None:
            text = source.clean(text)
        data = _truncate_at_line(text.encode("utf-8"), max_doc_bytes)
        text, cut_bad = _decode(data)  # a hard cut can split a character
        if len(data) < min_doc_bytes:
            stats.skip("too_short")
            continue
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:  # symlinked doc dirs, identical licences: keep one copy, held-out stays clean
            stats.skip("duplicate")
            continue
        seen.add(digest)
        stats.replacements += bad + cut_bad
        docs.append({"id": f"{source.name}/{rel}", "domain": source.name, "text": text})
    if len(docs) < max_docs:
        log.info("corpus: domain %s has only %d documents (asked for %d)", source.name, len(docs), max_docs)
    return docs, stats


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _jsonl_bytes(docs: Iterable[dict[str, str]]) -> bytes:
    return b"".join(json.dumps(d, ensure_ascii=False).encode("utf-8") + b"\n" for d in docs)


def build_local_corpus(
    out_dir: Path,
    *,
    max_docs_per_domain: int = 400,
    max_doc_bytes: int = 6000,
    min_doc_bytes: int = 200,
    heldout_fraction: float = 0.1,
    sources: list[DomainSource] | None = None,
) -> dict[str, Any]:
    """Build `train.jsonl`, `heldout.jsonl` and (last) `manifest.json` in out_dir; return the manifest.

    `sources` defaults to `default_sources()`; a domain with no files is skipped with a warning, and fewer
    than two non-empty domains raises `CorpusError`.
    """
    if max_docs_per_domain < 1:
        raise CorpusError(f"max_docs_per_domain must be >= 1, got {max_docs_per_domain}")
    if not 0 < min_doc_bytes <= max_doc_bytes:
        raise CorpusError(f"need 0 < min_doc_bytes <= max_doc_bytes, got {min_doc_bytes} and {max_doc_bytes}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise CorpusError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    sources = default_sources() if sources is None else sources
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise CorpusError(f"domain names must be unique, got {names}")

    collected = _collect(
        sources,
        max_docs=max_docs_per_domain,
        max_doc_bytes=max_doc_bytes,
        min_doc_bytes=min_doc_bytes,
        heldout_fraction=heldout_fraction,
    )
    if len(collected.domains) < MIN_DOMAINS:
        raise CorpusError(
            f"only {len(collected.domains)} domain(s) with documents ({sorted(collected.domains)}); need at least "
            f"{MIN_DOMAINS}. Missing: {collected.missing}"
        )

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # complete-or-absent: no stale manifest over new data
    splits = _write_splits(out_dir, collected.split_docs)
    manifest: dict[str, Any] = {
        "format": CORPUS_FORMAT,
        "parameters": {
            "max_docs_per_domain": max_docs_per_domain,
            "max_doc_bytes": max_doc_bytes,
            "min_doc_bytes": min_doc_bytes,
            "heldout_fraction": heldout_fraction,
        },
        "splits": splits,
        "domains": collected.domains,
        "missing_domains": collected.missing,
    }
    _write_atomic(out_dir / MANIFEST_FILE, json.dumps(manifest, indent=2, sort_keys=True).encode() + b"\n")
    return manifest


@dataclass(slots=True)
class _Collected:
    split_docs: dict[str, list[dict[str, str]]]
    """The documents of each split, domain after domain in source order."""
    domains: dict[str, Any]
    """The manifest entry of each domain that has documents."""
    missing: list[str]
    """Domains with no usable file."""


def _collect(
    sources: list[DomainSource], *, max_docs: int, max_doc_bytes: int, min_doc_bytes: int, heldout_fraction: float
) -> _Collected:
    """Read every domain in order (one with no usable file is skipped with a warning) and split its documents
    between train and held-out by a stable hash of their id."""
    seen: set[str] = set()  # sha256 of every document kept so far, across domains
    collected = _Collected(split_docs={s: [] for s in SPLITS}, domains={}, missing=[])
    for source in sources:
        docs, stats = _read_domain(
            source, max_docs=max_docs, max_doc_bytes=max_doc_bytes, min_doc_bytes=min_doc_bytes, seen=seen
        )
        if not docs:
            log.warning(
                "corpus: domain %s has no usable files under %s (%d candidates); skipped",
                source.name,
                source.root,
                stats.candidates,
            )
            collected.missing.append(source.name)
            continue
        entry: dict[str, Any] = {
            "root": str(source.root),
            "candidates": stats.candidates,
            "visited": stats.visited,
            "skipped": dict(sorted(stats.skipped.items())),
            "utf8_replacements": stats.replacements,
        }
        for split in SPLITS:
            entry[split] = {"documents": 0, "bytes": 0}
        for doc in docs:
            split = "heldout" if stable_fraction(f"split/{doc['id']}") < heldout_fraction else "train"
            collected.split_docs[split].append(doc)
            entry[split]["documents"] += 1
            entry[split]["bytes"] += len(doc["text"].encode("utf-8"))
        collected.domains[source.name] = entry
        log.info(
            "corpus: %s: %d train + %d held-out documents, skipped %s",
            source.name,
            entry["train"]["documents"],
            entry["heldout"]["documents"],
            entry["skipped"] or "none",
        )
    return collected


def _write_splits(out_dir: Path, split_docs: dict[str, list[dict[str, str]]]) -> dict[str, Any]:
    """Write each split's JSON-lines file (write then rename); returns their manifest entries."""
    splits: dict[str, Any] = {}
    for split, filename in (("train", TRAIN_FILE), ("heldout", HELDOUT_FILE)):
        docs = split_docs[split]
        data = _jsonl_bytes(docs)
        _write_atomic(out_dir / filename, data)
        splits[split] = {
            "file": filename,
            "sha256": hashlib.sha256(data).hexdigest(),
            "documents": len(docs),
            "bytes": sum(len(d["text"].encode("utf-8")) for d in docs),
        }
    return splits


def iter_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Stream the objects of a JSON-lines file, one per non-empty line."""
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: not valid JSON: {exc}") from exc


def load_corpus_manifest(corpus_dir: Path) -> Mapping[str, Any]:
    path = corpus_dir / MANIFEST_FILE
    if not path.is_file():
        raise CorpusError(f"no corpus manifest at {path}; build the corpus first")
    data: dict[str, Any] = json.loads(path.read_text())
    return data
