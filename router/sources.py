"""User corpora in ordinary formats, streamed into the corpus layout (`train.jsonl`, `heldout.jsonl`, manifest).

Formats: a directory (or one file) of `.txt` / `.md` documents, one document per file, the domain being the
first sub-directory under the root; JSON lines (one object per line, text in `text_field`); parquet with a text
column (needs `pyarrow`, imported only when used). Nothing is loaded whole: documents are read one at a time
(parquet in record batches) and appended to the split files.

The domain of a JSON-lines or parquet document (what the shard manifest's per-domain counts and purity are
computed on) is its `domain_field` (`dipaco router corpus --domain-field lang`). Named explicitly, the field is
expected: a document without it takes the file's name as its domain and is counted (`without_domain_field` in
the manifest), and a source in which no document has it is a `CorpusError` (a typo must not silently give one
domain per file). Not named (None), a `domain` field is used where present, else the file's name.

Bad input never crashes the build and is never dropped silently: each skipped document is counted by reason in
the manifest (`unreadable`, `binary`, `invalid_json`, `missing_text`, `empty`, `too_short`, `duplicate`), and
invalid UTF-8 is replaced (U+FFFD) and counted (`utf8_replacements`). A missing source, an unknown format, a
parquet file without the text column, or a source with no usable document is a `CorpusError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from router.corpus import (
    CORPUS_FORMAT,
    HELDOUT_FILE,
    MANIFEST_FILE,
    TRAIN_FILE,
    CorpusError,
    stable_fraction,
)

log = logging.getLogger(__name__)

Format = Literal["txt", "jsonl", "parquet"]
FORMATS: tuple[str, ...] = ("txt", "jsonl", "parquet")
TEXT_SUFFIXES = (".txt", ".md")
PARQUET_BATCH = 1024
DEFAULT_DOMAIN_FIELD = "domain"
"""Read for the domain when no domain field is named, where a document has it."""


@dataclass(slots=True)
class SourceStats:
    documents: int = 0
    utf8_replacements: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    missing_domain: int = 0
    """Documents without the named domain field (they take the file's name)."""
    with_domain: int = 0
    """Documents that had the named domain field."""

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        log.debug("source: skipped %s: %s", where, reason)


@dataclass(frozen=True, slots=True)
class Document:
    id: str
    domain: str
    text: str


def infer_format(path: Path) -> Format:
    if path.is_dir():
        if any(path.rglob("*.parquet")):
            return "parquet"
        if any(path.rglob("*.jsonl")):
            return "jsonl"
        return "txt"
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "txt"


def _decode(data: bytes, stats: SourceStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        stats.utf8_replacements += text.count("\ufffd") - data.count("\ufffd".encode())
        return text


def _files(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes and p.is_file())


def _domain(root: Path, path: Path) -> str:
    if root.is_file():
        return root.stem
    parts = path.relative_to(root).parts
    return parts[0] if len(parts) > 1 else root.name


def _iter_txt(root: Path, stats: SourceStats) -> Iterator[Document]:
    for path in _files(root, TEXT_SUFFIXES):
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError as exc:
            stats.skip("unreadable", f"{path}: {exc}")
            continue
        if b"\x00" in data:
            stats.skip("binary", str(path))
            continue
        yield Document(id=rel, domain=_domain(root, path), text=_decode(data, stats))


def _domain_of(value: object, *, fallback: str, named: bool, stats: SourceStats) -> str:
    """A document's domain: its field's value, else the fallback (counted when the field was named)."""
    if value is not None:
        stats.with_domain += 1
        return str(value)
    if named:
        stats.missing_domain += 1
    return fallback


def _iter_jsonl(root: Path, stats: SourceStats, text_field: str, domain_field: str | None) -> Iterator[Document]:
    field_name = domain_field or DEFAULT_DOMAIN_FIELD
    for path in _files(root, (".jsonl",)):
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        try:
            fh = open(path, "rb")  # noqa: SIM115 - closed below; lines are decoded one by one
        except OSError as exc:
            stats.skip("unreadable", f"{path}: {exc}")
            continue
        with fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    obj = json.loads(_decode(raw, stats))
                except json.JSONDecodeError:
                    stats.skip("invalid_json", where)
                    continue
                text = obj.get(text_field) if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    stats.skip("missing_text", where)
                    continue
                domain = _domain_of(
                    obj.get(field_name), fallback=path.stem, named=domain_field is not None, stats=stats
                )
                yield Document(id=f"{rel}:{lineno}", domain=domain, text=text)


def _iter_parquet(root: Path, stats: SourceStats, text_field: str, domain_field: str | None) -> Iterator[Document]:
    field_name = domain_field or DEFAULT_DOMAIN_FIELD
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise CorpusError("reading parquet needs pyarrow: pip install pyarrow") from exc
    for path in _files(root, (".parquet",)):
        rel = path.name if root.is_file() else path.relative_to(root).as_posix()
        try:
            pf = pq.ParquetFile(path)
        except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
            stats.skip("unreadable", f"{path}: {exc}")
            continue
        names = pf.schema_arrow.names
        if text_field not in names:
            raise CorpusError(f"{path}: no column {text_field!r} (columns: {names}); pass --text-field")
        if domain_field is not None and domain_field not in names:
            raise CorpusError(f"{path}: no column {domain_field!r} (columns: {names}); check --domain-field")
        columns = [text_field] + ([field_name] if field_name in names else [])
        row = 0
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH, columns=columns):
            data = batch.to_pydict()
            domains = data.get(field_name, [None] * batch.num_rows)
            for text, domain in zip(data[text_field], domains, strict=True):
                if isinstance(text, bytes):
                    text = _decode(text, stats)
                if not isinstance(text, str):
                    stats.skip("missing_text", f"{path} row {row}")
                else:
                    name = _domain_of(domain, fallback=path.stem, named=domain_field is not None, stats=stats)
                    yield Document(id=f"{rel}:{row}", domain=name, text=text)
                row += 1


def iter_documents(
    source: Path,
    *,
    fmt: Format | None = None,
    text_field: str = "text",
    domain_field: str | None = None,
    stats: SourceStats | None = None,
) -> Iterator[Document]:
    """Stream the documents of a source (skips are counted in `stats`). `domain_field`: see the module doc."""
    if not source.exists():
        raise CorpusError(f"source {source} does not exist")
    fmt = fmt or infer_format(source)
    stats = stats if stats is not None else SourceStats()
    if fmt == "txt" and domain_field is not None:
        raise CorpusError(
            f"a domain field ({domain_field!r}) applies to jsonl and parquet sources; a .txt/.md document's domain "
            "is its first sub-directory"
        )
    if fmt == "txt":
        yield from _iter_txt(source, stats)
    elif fmt == "jsonl":
        yield from _iter_jsonl(source, stats, text_field, domain_field)
    elif fmt == "parquet":
        yield from _iter_parquet(source, stats, text_field, domain_field)
    else:
        raise CorpusError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")


def build_corpus_from(
    source: Path,
    out_dir: Path,
    *,
    fmt: Format | None = None,
    text_field: str = "text",
    domain_field: str | None = None,
    heldout_fraction: float = 0.1,
    min_doc_bytes: int = 64,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Stream a source into `train.jsonl` / `heldout.jsonl` (split by a stable hash of the document id, each in
    source order) and write the manifest last. `min_doc_bytes` (default 64) keeps documents longer than the
    32-token prefix; `domain_field`: see the module doc; `extra`: more manifest entries (e.g. how the source was
    made)."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise CorpusError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    if min_doc_bytes < 1:
        raise CorpusError(f"min_doc_bytes must be >= 1, got {min_doc_bytes}")
    if not source.exists():
        raise CorpusError(f"source {source} does not exist")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # complete-or-absent
    fmt_used = fmt or infer_format(source)
    stats = SourceStats()
    seen: set[bytes] = set()
    files = {"train": out_dir / TRAIN_FILE, "heldout": out_dir / HELDOUT_FILE}
    tmps = {s: out_dir / f".{p.name}.tmp-{os.getpid()}" for s, p in files.items()}
    digests = {s: hashlib.sha256() for s in files}
    splits: dict[str, dict[str, Any]] = {s: {"file": p.name, "documents": 0, "bytes": 0} for s, p in files.items()}
    domains: dict[str, dict[str, Any]] = {}
    try:
        with open(tmps["train"], "wb") as train_fh, open(tmps["heldout"], "wb") as heldout_fh:
            handles = {"train": train_fh, "heldout": heldout_fh}
            for doc in iter_documents(source, fmt=fmt, text_field=text_field, domain_field=domain_field, stats=stats):
                data = doc.text.encode("utf-8")
                if not doc.text.strip():
                    stats.skip("empty", doc.id)
                    continue
                if len(data) < min_doc_bytes:
                    stats.skip("too_short", doc.id)
                    continue
                digest = hashlib.sha256(data).digest()[:16]
                if digest in seen:
                    stats.skip("duplicate", doc.id)
                    continue
                seen.add(digest)
                split = "heldout" if stable_fraction(f"split/{doc.id}") < heldout_fraction else "train"
                line = (
                    json.dumps({"id": doc.id, "domain": doc.domain, "text": doc.text}, ensure_ascii=False).encode(
                        "utf-8"
                    )
                    + b"\n"
                )
                handles[split].write(line)
                digests[split].update(line)
                splits[split]["documents"] += 1
                splits[split]["bytes"] += len(data)
                entry = domains.setdefault(doc.domain, {s: {"documents": 0, "bytes": 0} for s in files})
                entry[split]["documents"] += 1
                entry[split]["bytes"] += len(data)
                stats.documents += 1
            for fh in handles.values():
                fh.flush()
                os.fsync(fh.fileno())
        if stats.documents == 0:
            raise CorpusError(f"no usable document in {source} (skipped: {stats.skipped or 'none'})")
        if domain_field is not None and stats.with_domain == 0:
            raise CorpusError(
                f"no document of {source} has the domain field {domain_field!r}; check --domain-field (without it, "
                "a 'domain' field is used where present, else the file name)"
            )
        for split, path in files.items():
            os.replace(tmps[split], path)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)
    for split in files:
        splits[split]["sha256"] = digests[split].hexdigest()
    manifest: dict[str, Any] = {
        "format": CORPUS_FORMAT,
        "source": {
            "path": str(source),
            "format": fmt_used,
            "text_field": text_field,
            **({"domain_field": domain_field} if domain_field is not None else {}),
        },
        "parameters": {"heldout_fraction": heldout_fraction, "min_doc_bytes": min_doc_bytes},
        "splits": splits,
        "domains": dict(sorted(domains.items())),
        "missing_domains": [],
        "skipped": dict(sorted(stats.skipped.items())),
        "utf8_replacements": stats.utf8_replacements,
        **({"without_domain_field": stats.missing_domain} if domain_field is not None else {}),
        **(extra or {}),
    }
    tmp = out_dir / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST_FILE)
    log.info("corpus from %s: %d documents, skipped %s", source, stats.documents, stats.skipped or "none")
    return manifest
