"""Shards: the train split routed to one token file per path, plus the router and a manifest (written last).

Each shard `path-{i:04d}.tokens` holds the byte tokens of its documents (in corpus order), each followed by EOS,
as little-endian uint16. The output is byte-for-byte deterministic for the same corpus and parameters. The
manifest records the purity by domain (and that of a random assignment of the same sizes), the product k-means
levels, and the balance: each shard's token share relative to the fair share, before and after balancing.

Options (all off by default; off, the output is exactly the above): a held-out slice per shard for early
stopping (`path-{i:04d}.heldout.tokens`), top-2 overlapping training shards (paper §2.4.4), and a byte-level BPE
tokenizer trained on the train split (`router.bpe`, saved as `tokenizer.json`). See `shard_corpus`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from router.balance import BalanceError, fit_bias, token_shares
from router.corpus import MANIFEST_FILE, TRAIN_FILE, CorpusError, iter_jsonl
from router.model_features import ModelFeaturizer
from router.router import Router, fit_router
from router.tokenizer import TOKEN_DTYPE, ByteTokenizer

if TYPE_CHECKING:
    from router.bpe import BPETokenizer

log = logging.getLogger(__name__)

SHARDS_FORMAT = 1
ROUTER_DIR = "router"
TOKENIZER_JSON = "tokenizer.json"
"""The BPE tokenizer saved with BPE shards (same name as `router.bpe.TOKENIZER_FILE`)."""
RANDOM_PURITY_TRIALS = 20
"""Random assignments averaged for the purity baseline."""


class ShardError(ValueError):
    """Shards cannot be written, or the files on disk do not match their manifest."""


TOKENIZERS = ("byte", "bpe")


def shard_file_name(path_index: int) -> str:
    return f"path-{path_index:04d}.tokens"


def heldout_file_name(path_index: int) -> str:
    return f"path-{path_index:04d}.heldout.tokens"


def _domain_codes(domains: list[str]) -> tuple[np.ndarray, int]:
    _, codes = np.unique(np.asarray(domains, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64), int(codes.max()) + 1 if len(codes) else 0


def _purity_codes(labels: np.ndarray, codes: np.ndarray, num_domains: int) -> float:
    if len(codes) == 0:
        return 0.0
    table = np.zeros((int(labels.max()) + 1, num_domains), dtype=np.int64)
    np.add.at(table, (labels, codes), 1)
    return float(table.max(axis=1).sum() / len(codes))


def purity(labels: np.ndarray, domains: list[str]) -> float:
    """Fraction of documents whose domain is the majority domain of their shard."""
    codes, num_domains = _domain_codes(domains)
    return _purity_codes(np.asarray(labels, dtype=np.int64), codes, num_domains)


def random_purity(
    labels: np.ndarray, domains: list[str], *, seed: int, trials: int = RANDOM_PURITY_TRIALS
) -> float:
    """Mean purity of random assignments with the same shard sizes (the labels, shuffled)."""
    rng = np.random.default_rng(seed)
    codes, num_domains = _domain_codes(domains)
    labels = np.asarray(labels, dtype=np.int64)
    return float(np.mean([_purity_codes(rng.permutation(labels), codes, num_domains) for _ in range(trials)]))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _scan(train: Path, prefix_tokens: int, tok: ByteTokenizer | BPETokenizer) -> tuple[list[str], np.ndarray,
                                                                                        list[str]]:
    """Pass 1: the prefix text, token count (+ EOS) and domain of every document; texts are not kept. The
    routing prefix is always the first `prefix_tokens` bytes of the text, whatever the shard tokenizer."""
    byte_tok = ByteTokenizer()
    prefix_texts: list[str] = []
    sizes: list[int] = []
    domains: list[str] = []
    for doc, tokens in _iter_tokens(train, tok, sizes_only=True):
        prefix_texts.append(byte_tok.prefix_text(doc["text"], prefix_tokens))
        sizes.append(len(tokens))
        domains.append(str(doc.get("domain", "")))
    return prefix_texts, np.asarray(sizes, dtype=np.int64), domains


BPE_BATCH_DOCS = 256
"""Documents per `encode_batch` call of the BPE tokenizer (bounded memory, parallel encoding)."""


def _iter_tokens(train: Path, tok: ByteTokenizer | BPETokenizer, *, sizes_only: bool = False
                 ) -> Iterator[tuple[dict[str, Any], np.ndarray | bytes]]:
    """Each document of `train` (in order) with its tokens + EOS (`TOKEN_DTYPE`); with `sizes_only` and the byte
    tokenizer, the UTF-8 bytes + one placeholder byte instead (same length, no copy to uint16)."""
    if isinstance(tok, ByteTokenizer):
        for doc in iter_jsonl(train):
            if sizes_only:
                yield doc, doc["text"].encode("utf-8") + b"\0"
            else:
                yield doc, tok.encode_array(doc["text"], eos=True)
        return
    batch: list[dict[str, Any]] = []
    for doc in iter_jsonl(train):
        batch.append(doc)
        if len(batch) == BPE_BATCH_DOCS:
            yield from zip(batch, tok.encode_batch_arrays([d["text"] for d in batch], eos=True), strict=True)
            batch = []
    if batch:
        yield from zip(batch, tok.encode_batch_arrays([d["text"] for d in batch], eos=True), strict=True)


def _route_scores(router: Router, prefix_texts: list[str], batch_docs: int) -> np.ndarray:
    """(N, K) unbiased scores of every document, featurized in batches (bounded memory)."""
    out = np.empty((len(prefix_texts), router.num_paths), dtype=np.float64)
    for b in range(0, len(prefix_texts), batch_docs):
        out[b : b + batch_docs] = router.scores(router.embed(prefix_texts[b : b + batch_docs]))
    return out


def shard_corpus(
    corpus_dir: Path,
    out_dir: Path,
    *,
    num_paths: int,
    prefix_tokens: int = 32,
    seed: int = 0,
    min_tokens_per_shard: int = 0,
    balance: bool = True,
    strict_balance: bool = False,
    min_share: float = 0.5,
    max_share: float = 2.0,
    levels: list[int] | None = None,
    fit_sample: int = 50_000,
    batch_docs: int = 4096,
    router: Router | None = None,
    heldout_docs_per_shard: int = 0,
    overlap_top2: bool = False,
    tokenizer: str = "byte",
    vocab_size: int = 8192,
    featurizer: ModelFeaturizer | None = None,
) -> dict[str, Any]:
    """Fit the router on the train split, write one token file per path, the router and the manifest.

    Streams the train split twice and never holds the texts: pass 1 keeps each document's prefix, token count
    and domain (tens of bytes per document); the router is fitted on `fit_sample` documents at most (a seeded
    random subset), balanced on all of them (`balance`: every path gets between `min_share` and `max_share`
    times its fair share of tokens, see `router.balance`), then pass 2 appends each document's tokens to its
    shard. When the bounds cannot be met (typically: many documents share one prefix, so they must share a
    path), `strict_balance` raises `ShardError`; otherwise the closest balance found is used, a warning is
    logged and the manifest says `"satisfied": false`. `levels=[2, 2]` fits product k-means (one k-means per
    routed level, path = mixed radix).

    `router`: shard with this router instead of fitting one (e.g. a refit router from `router.refit`); it must
    have `num_paths` paths and read `prefix_tokens` tokens, and is not modified. With `balance`, an offset is
    added to its own `bias` (nothing when its routing already meets the bounds on the train split); without,
    it routes as it is. The router used is saved with the shards as always.

    `heldout_docs_per_shard=N > 0`: the last N documents (in corpus order) routed to each path are written to
    `path-XXXX.heldout.tokens` instead of its training shard (for early stopping); the manifest records each
    under `shards[i]["heldout"]` (file, sha256, num_tokens, num_documents, domains). A path with N or fewer
    documents raises `ShardError`.

    `overlap_top2` (paper §2.4.4, training only): every training document is also appended to the shard of its
    second-best path (by the same biased scores that route it), so shards overlap and each document is in
    exactly two training shards. Routing (the saved router, balance, purity, held-out slices) is top-1 and
    unchanged; shard `num_documents`/`num_tokens`/`domains` count what is in the file, and
    `num_secondary_documents` how many of those came as second choice.

    `tokenizer="bpe"`: train a byte-level BPE of `vocab_size` tokens on the train split (`router.bpe`), save it
    as `tokenizer.json` next to the shards and write BPE token ids (EOS = 0) instead of bytes; the manifest
    records it (`"tokenizer": {"kind", "file", "sha256", "vocab_size"}`) and `"eos"`. Balancing counts BPE
    tokens; routing still reads the first `prefix_tokens` bytes of each text. The defaults (0, False,
    "byte") write exactly what they always did.
    """
    corpus_manifest = corpus_dir / MANIFEST_FILE
    if not corpus_manifest.is_file():
        raise CorpusError(f"no corpus manifest at {corpus_manifest}; build the corpus first")
    if fit_sample < 1 or batch_docs < 1:
        raise ShardError(f"fit_sample={fit_sample} and batch_docs={batch_docs} must be >= 1")
    if heldout_docs_per_shard < 0:
        raise ShardError(f"heldout_docs_per_shard={heldout_docs_per_shard} must be >= 0")
    if overlap_top2 and num_paths < 2:
        raise ShardError("overlap_top2 needs at least 2 paths")
    if tokenizer not in TOKENIZERS:
        raise ShardError(f"unknown tokenizer {tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
    train = corpus_dir / TRAIN_FILE
    tok: ByteTokenizer | BPETokenizer
    if tokenizer == "bpe":
        from router.bpe import BPEError, train_bpe

        try:
            tok = train_bpe((doc["text"] for doc in iter_jsonl(train)), vocab_size=vocab_size)
        except BPEError as exc:
            raise ShardError(str(exc)) from exc
    else:
        tok = ByteTokenizer()
    prefix_texts, sizes, domains = _scan(train, prefix_tokens, tok)
    n = len(prefix_texts)
    if n > fit_sample:
        fit_idx = np.sort(np.random.default_rng(seed).choice(n, size=fit_sample, replace=False))
        fit_texts = [prefix_texts[i] for i in fit_idx]
    else:
        fit_texts = prefix_texts
    given = router is not None
    if router is not None:
        if router.num_paths != num_paths or router.prefix_tokens != prefix_tokens:
            raise ShardError(f"the given router has {router.num_paths} paths and reads {router.prefix_tokens} "
                             f"tokens; asked for {num_paths} paths and {prefix_tokens} tokens")
        router = dataclasses.replace(router)
        fit_texts = []
        levels = list(router.levels) if router.levels else None
    else:
        router = fit_router(fit_texts, num_paths=num_paths, prefix_tokens=prefix_tokens, seed=seed,
                            levels=levels, model=featurizer)
    s = _route_scores(router, prefix_texts, batch_docs)
    # A given router's own offsets are the starting point ("unbalanced" = routed as given); balancing adds to them.
    start = router.bias if given and router.bias is not None else np.zeros(num_paths)
    if balance:
        try:
            delta = fit_bias(s + start[None, :], sizes, min_share=min_share, max_share=max_share,
                             strict=strict_balance)
        except BalanceError as exc:
            raise ShardError(f"balancing {n} documents over {num_paths} paths: {exc}") from exc
        router.bias = start + delta if given else delta
    unbalanced = np.argmin(s + start[None, :], axis=1)
    biased = s + (router.bias[None, :] if router.bias is not None else 0.0)
    labels = np.argmin(biased, axis=1)
    second: np.ndarray | None = None
    if overlap_top2:
        # Second-best path: the best one once the top-1 is ruled out (lowest index on ties, like argmin).
        biased = np.array(biased, dtype=np.float64, copy=True)
        biased[np.arange(n), labels] = np.inf
        second = np.argmin(biased, axis=1)
    del s, biased

    shares = token_shares(labels, sizes, num_paths)
    satisfied = bool(((shares >= min_share - 1e-12) & (shares <= max_share + 1e-12)).all())
    if balance and not satisfied:
        log.warning("shards: token shares %s are outside [%s, %s] (the closest balance found); see the "
                    "manifest", np.round(shares, 3).tolist(), min_share, max_share)
    routed_docs = np.bincount(labels, minlength=num_paths)
    empty = np.flatnonzero(routed_docs == 0).tolist()
    if empty:
        raise ShardError(f"paths {empty} get no document (product k-means combinations nobody falls in); "
                         "turn balancing on or use fewer paths")
    heldout = np.zeros(n, dtype=bool)
    if heldout_docs_per_shard:
        few = [(p, int(c)) for p, c in enumerate(routed_docs) if c <= heldout_docs_per_shard]
        if few:
            listed = ", ".join(f"path {p}: {c} documents" for p, c in few)
            raise ShardError(f"cannot hold out {heldout_docs_per_shard} documents per shard and keep some for "
                             f"training: {listed}")
        for p in range(num_paths):
            heldout[np.flatnonzero(labels == p)[-heldout_docs_per_shard:]] = True
    trained = ~heldout
    num_tokens = np.bincount(labels[trained], weights=sizes[trained], minlength=num_paths).astype(np.int64)
    num_docs = np.bincount(labels[trained], minlength=num_paths)
    if second is not None:
        num_tokens += np.bincount(second[trained], weights=sizes[trained], minlength=num_paths).astype(np.int64)
        num_docs += np.bincount(second[trained], minlength=num_paths)
    too_small = [(i, int(n)) for i, n in enumerate(num_tokens) if n < min_tokens_per_shard]
    if too_small:
        listed = ", ".join(f"path {i}: {n} tokens" for i, n in too_small)
        raise ShardError(f"shards below min_tokens_per_shard={min_tokens_per_shard}: {listed}")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # complete-or-absent
    router.save(out_dir / ROUTER_DIR)
    tokenizer_entry: dict[str, Any] | None = None
    if not isinstance(tok, ByteTokenizer):
        tmp_tok = out_dir / f".{TOKENIZER_JSON}.tmp-{os.getpid()}"
        tok.save(tmp_tok)
        os.replace(tmp_tok, out_dir / TOKENIZER_JSON)
        tokenizer_entry = {"kind": "bpe", "file": TOKENIZER_JSON, "vocab_size": tok.vocab_size,
                           "sha256": _sha256_file(out_dir / TOKENIZER_JSON)}
    # Files 0..K-1: training shards; K..2K-1: held-out slices (only when asked for).
    targets = [out_dir / shard_file_name(p) for p in range(num_paths)]
    if heldout_docs_per_shard:
        targets += [out_dir / heldout_file_name(p) for p in range(num_paths)]
    tmps = [out_dir / f".{t.name}.tmp-{os.getpid()}" for t in targets]
    digests = [hashlib.sha256() for _ in targets]
    with ExitStack() as stack:
        files = [stack.enter_context(open(t, "wb", buffering=1 << 20)) for t in tmps]
        for i, (_, tokens) in enumerate(_iter_tokens(train, tok)):  # pass 2: the same file, the same order
            if i >= n:
                raise ShardError(f"{train} changed while sharding (more than {n} documents)")
            assert isinstance(tokens, np.ndarray)
            data = tokens.tobytes()
            if len(data) != 2 * sizes[i]:
                raise ShardError(f"{train} changed while sharding (document {i})")
            dests = [num_paths + labels[i]] if heldout[i] else [labels[i]]
            if second is not None and not heldout[i]:
                dests.append(second[i])
            for dest in dests:
                digests[dest].update(data)
                files[dest].write(data)
        for fh in files:
            fh.flush()
            os.fsync(fh.fileno())
    for tmp, target in zip(tmps, targets, strict=True):
        os.replace(tmp, target)

    codes, num_domains = _domain_codes(domains)
    shards: list[dict[str, Any]] = []
    domain_array = np.asarray(domains, dtype=object)
    for path_index in range(num_paths):
        members = (labels == path_index) & trained
        shard_domains = Counter(domain_array[members].tolist())
        entry: dict[str, Any] = {
            "path_index": path_index, "file": targets[path_index].name,
            "sha256": digests[path_index].hexdigest(), "num_tokens": int(num_tokens[path_index]),
            "num_documents": int(num_docs[path_index]),
        }
        if second is not None:
            extra = (second == path_index) & trained
            shard_domains.update(domain_array[extra].tolist())
            entry["num_secondary_documents"] = int(extra.sum())
        entry["domains"] = dict(sorted(shard_domains.items()))
        if heldout_docs_per_shard:
            held = (labels == path_index) & heldout
            entry["heldout"] = {
                "file": targets[num_paths + path_index].name,
                "sha256": digests[num_paths + path_index].hexdigest(),
                "num_tokens": int(sizes[held].sum()), "num_documents": int(held.sum()),
                "domains": dict(sorted(Counter(domain_array[held].tolist()).items())),
            }
        shards.append(entry)
    manifest: dict[str, Any] = {
        "format": SHARDS_FORMAT,
        "num_paths": num_paths,
        "prefix_tokens": prefix_tokens,
        "seed": seed,
        "token_dtype": TOKEN_DTYPE.str,
        "eos": int(tok.EOS),
        "corpus_manifest_sha256": _sha256_file(corpus_manifest),
        "router_dir": ROUTER_DIR,
        "shards": shards,
        "purity": _purity_codes(labels, codes, num_domains),
        "purity_random": random_purity(labels, domains, seed=seed),
        "levels": list(levels) if levels and len(levels) >= 2 else [num_paths],
        "fit_documents": len(fit_texts),
        **({"router_given": True, "router_head": router.head_weight is not None} if given else {}),
        **({"heldout_docs_per_shard": heldout_docs_per_shard} if heldout_docs_per_shard else {}),
        **({"overlap_top2": True} if second is not None else {}),
        **({"tokenizer": tokenizer_entry} if tokenizer_entry is not None else {}),
        "balance": {
            "enabled": balance, "min_share": min_share, "max_share": max_share,
            "satisfied": satisfied,
            "token_shares": [round(float(x), 6) for x in shares],
            "unbalanced_token_shares": [round(float(x), 6) for x in token_shares(unbalanced, sizes, num_paths)],
            "moved_documents": int((labels != unbalanced).sum()),
        },
    }
    tmp = out_dir / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST_FILE)
    log.info("shards: %d paths, purity %.3f (random %.3f), token shares %s", num_paths, manifest["purity"],
             manifest["purity_random"], manifest["balance"]["token_shares"])
    return manifest


def load_manifest(out_dir: Path) -> dict[str, Any]:
    """Read a shard manifest and check every shard file's size and sha256 against it."""
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        raise ShardError(f"no shard manifest at {path}")
    manifest: dict[str, Any] = json.loads(path.read_text())
    for shard in manifest["shards"]:
        _verify_token_file(out_dir, shard, f"path {shard['path_index']}")
        if "heldout" in shard:
            _verify_token_file(out_dir, shard["heldout"], f"the held-out slice of path {shard['path_index']}")
    entry = manifest.get("tokenizer")
    if entry is not None:
        file = out_dir / entry["file"]
        if not file.is_file():
            raise ShardError(f"tokenizer file {file} is missing")
        actual = _sha256_file(file)
        if actual != entry["sha256"]:
            raise ShardError(f"tokenizer file {file} has sha256 {actual}, manifest says {entry['sha256']}")
    return manifest


def _verify_token_file(out_dir: Path, entry: dict[str, Any], what: str) -> None:
    file = out_dir / entry["file"]
    if not file.is_file():
        raise ShardError(f"shard file {file} for {what} is missing")
    expected_size = entry["num_tokens"] * TOKEN_DTYPE.itemsize
    if file.stat().st_size != expected_size:
        raise ShardError(
            f"shard file {file} has {file.stat().st_size} bytes, manifest says {expected_size} "
            f"({entry['num_tokens']} tokens)"
        )
    actual = _sha256_file(file)
    if actual != entry["sha256"]:
        raise ShardError(f"shard file {file} has sha256 {actual}, manifest says {entry['sha256']}")
