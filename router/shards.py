"""Shards: the train split routed to one token file per path, plus the router and a manifest (written last).

Each shard `path-{i:04d}.tokens` holds the byte tokens of its documents, each followed by EOS, as little-endian
uint16. The output is byte-for-byte deterministic for the same corpus and options. The manifest records the
purity by domain (and that of a random assignment of the same sizes), the product k-means levels, the balance
(each shard's token share relative to the fair share, before and after balancing) and the document order.

Order. Islands read a shard front to back (the data cursor of a run), so whatever order the documents are
written in is the order a path learns them in. Corpora often come in source order (all of one language, then the
next; one crawl after another): written in that order, every round of a path, and of a dense run's single
shard, sees one block of the corpus and forgets the one before. So by default (`shuffle=True`) every file (each
path's training shard and held-out slice) is written in a seeded random order of its documents: any prefix of
a shard is then a fair sample of it, whatever the input order. The order is a sort of the documents by a key,
`blake2b(seed, document text)` (`document_key`), computed while pass 1 reads each text: deterministic for a seed
on every machine, recorded in the manifest (`"order"`), 8 bytes per document and no text held. Because the key
is the text's, not its position, the same documents given in any order are written in the same order: a corpus
delivered one language after another and the same corpus shuffled give byte-identical shards when their
routing agrees (always for one path). Pass 2 still streams the train split once, in corpus order, and writes
each document's tokens at its precomputed offset in its file (`os.pwrite`); the files are hashed by reading them
back. `shuffle=False` keeps
corpus order (the format before shuffling existed).

Options (`ShardOptions`; all off by default and, off, the output is exactly the above): a held-out slice per
shard for early stopping (`path-{i:04d}.heldout.tokens`: the last N documents of the path in the shard order, so
a random sample when shuffled), top-2 overlapping training shards (paper §2.4.4), and a byte-level BPE tokenizer
trained on the train split (`router.bpe`, saved as `tokenizer.json`) or given.

`shard_corpus` runs one function per stage, in this order: train the tokenizer (BPE only), scan the train split
(pass 1), fit the router (or take a given one), score every document, assign it (route, balance, top-2), hold
out slices and check the sizes, then write the router, the tokenizer, the token files (pass 2) and the manifest.
Every check comes before the first write.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from router.balance import BalanceError, fit_bias, token_shares
from router.bpe import MAX_VOCAB_SIZE, MIN_VOCAB_SIZE, TOKENIZER_FILE, BPEError, BPETokenizer, train_bpe
from router.corpus import MANIFEST_FILE, TRAIN_FILE, CorpusError, iter_jsonl
from router.model_features import ModelFeaturizer
from router.purity import purity, random_purity
from router.router import Router, fit_router
from router.tokenizer import TOKEN_DTYPE, ByteTokenizer

log = logging.getLogger(__name__)

SHARDS_FORMAT = 1
ROUTER_DIR = "router"
TOKENIZERS = ("byte", "bpe")
ORDER_KEY = "blake2b-64(dipaco-shard-order/{seed}/{document text, UTF-8})"
"""How a shuffled shard orders its documents (`document_key`), as the manifest records it. Shards written with
the earlier key (by document index) still load; their manifest names that key."""
BPE_BATCH_DOCS = 256
"""Documents per `encode_batch` call of the BPE tokenizer (bounded memory, parallel encoding)."""


class ShardError(ValueError):
    """Shards cannot be written, or the files on disk do not match their manifest."""


@dataclass(kw_only=True, slots=True)
class ShardOptions:
    """How `shard_corpus` cuts the train split. Only `num_paths` is required; with every other field at its
    default the output is the plain format of the module docstring."""

    num_paths: int
    """Paths, one training shard each (k-means clusters; with `levels`, their product)."""
    prefix_tokens: int = 32
    """Documents are routed by their first this-many bytes, whatever the shard tokenizer."""
    seed: int = 0
    """Seeds the fit sample, the SVD, k-means and the random-purity baseline."""
    levels: list[int] | None = None
    """Product k-means: clusters per routed level, e.g. [2, 2] (their product must be `num_paths`); None: one
    k-means. Ignored with a given router, which keeps its own."""
    fit_sample: int = 50_000
    """The router is fitted on at most this many documents (a seeded random subset), which bounds the fit's
    memory; every document is still balanced and written."""
    batch_docs: int = 4096
    """Documents featurized per batch when scoring (bounds memory; the output does not depend on it)."""
    balance: bool = True
    """Fit per-path offsets so every shard holds between `min_share` and `max_share` x its fair share of tokens
    (`router.balance`); with a given router they are added to its own offsets."""
    min_share: float = 0.5
    """Least tokens per shard / fair share. Also what the manifest's `"satisfied"` is checked against."""
    max_share: float = 2.0
    """Most tokens per shard / fair share."""
    strict_balance: bool = False
    """When the bounds cannot be met (typically many documents share one prefix, so they must share a path):
    raise `ShardError`. Off: use the closest balance found, log a warning, the manifest says `"satisfied": false`."""
    min_tokens_per_shard: int = 0
    """Raise `ShardError` when a training shard would hold fewer tokens (0: no floor)."""
    heldout_docs_per_shard: int = 0
    """N > 0: the last N documents routed to each path, in the shard order (a seeded random sample when
    shuffled, else the last in corpus order), go to `path-XXXX.heldout.tokens` instead of its training shard
    (early stopping). A path with N or fewer documents raises `ShardError`."""
    overlap_top2: bool = False
    """Paper §2.4.4, training only: every training document is also appended to the shard of its second-best path
    (by the same biased scores that route it). Routing (router, balance, purity, held-out slices) stays top-1."""
    shuffle: bool = True
    """Write every shard and held-out slice in a random order of its documents, seeded by `seed` (see the module
    doc: why, and how it stays streaming); False: corpus order."""
    tokenizer: str = "byte"
    """"byte" (bytes + EOS 256), or "bpe": a byte-level BPE trained on the train split, saved as `tokenizer.json`
    (EOS 0). Balancing counts the shard tokenizer's tokens; routing always reads bytes. A tokenizer object given
    to `shard_corpus` is used instead of either."""
    vocab_size: int = 8192
    """BPE vocabulary size (with `tokenizer="bpe"` only); at most 65535 so ids fit the uint16 shard files."""

    def __post_init__(self) -> None:
        if self.num_paths < 1:
            raise ShardError(f"num_paths={self.num_paths} must be >= 1")
        if self.prefix_tokens < 1:
            raise ShardError(f"prefix_tokens={self.prefix_tokens} must be >= 1")
        if self.fit_sample < 1 or self.batch_docs < 1:
            raise ShardError(f"fit_sample={self.fit_sample} and batch_docs={self.batch_docs} must be >= 1")
        if not 0.0 <= self.min_share <= 1.0 <= self.max_share:
            raise ShardError(f"need 0 <= min_share <= 1 <= max_share, got {self.min_share} and {self.max_share}")
        if self.min_tokens_per_shard < 0:
            raise ShardError(f"min_tokens_per_shard={self.min_tokens_per_shard} must be >= 0")
        if self.heldout_docs_per_shard < 0:
            raise ShardError(f"heldout_docs_per_shard={self.heldout_docs_per_shard} must be >= 0")
        if self.overlap_top2 and self.num_paths < 2:
            raise ShardError(f"overlap_top2 needs at least 2 paths, got num_paths={self.num_paths}")
        if self.tokenizer not in TOKENIZERS:
            raise ShardError(f"unknown tokenizer {self.tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
        if self.tokenizer == "bpe" and not MIN_VOCAB_SIZE <= self.vocab_size <= MAX_VOCAB_SIZE:
            raise ShardError(f"vocab_size={self.vocab_size} must be in [{MIN_VOCAB_SIZE}, {MAX_VOCAB_SIZE}]")


def shard_file_name(path_index: int) -> str:
    return f"path-{path_index:04d}.tokens"


def heldout_file_name(path_index: int) -> str:
    return f"path-{path_index:04d}.heldout.tokens"


def shard_corpus(
    corpus_dir: Path,
    out_dir: Path,
    options: ShardOptions,
    *,
    router: Router | None = None,
    featurizer: ModelFeaturizer | None = None,
    tokenizer: ByteTokenizer | BPETokenizer | None = None,
) -> dict[str, Any]:
    """Fit the router on the train split, write one token file per path, the router and the manifest (last).

    Streams the train split twice and never holds the texts: pass 1 keeps each document's prefix, token count
    and domain (tens of bytes per document); pass 2 appends each document's tokens to its shard. See
    `ShardOptions` for what each option changes.

    `router`: shard with this router instead of fitting one (e.g. a refit router from `router.refit`); it must
    have `num_paths` paths and read `prefix_tokens` tokens, and is not modified. With `balance`, an offset is
    added to its own `bias` (nothing when its routing already meets the bounds on the train split); without,
    it routes as it is. The router used is saved with the shards as always. `featurizer`: fit the router on a
    path model's hidden states instead of hashed n-grams (`router.model_features`; ignored with `router`).
    `tokenizer`: cut the shards with this tokenizer instead of the one `options` names (e.g. the BPE tokenizer of
    other shards of the same corpus, so that runs on both share a vocabulary); saved with the shards as always.
    """
    corpus_manifest = _corpus_manifest(corpus_dir)
    train = corpus_dir / TRAIN_FILE
    tok = tokenizer if tokenizer is not None else _tokenizer(train, options)
    scan = _scan(train, tok, prefix_tokens=options.prefix_tokens, seed=options.seed)
    fitted = _fit(scan.prefix_texts, options, router=router, featurizer=featurizer)
    scores = _score(fitted.router, scan.prefix_texts, batch_docs=options.batch_docs)
    assignment = _assign(fitted, scores, scan.sizes, options)
    del scores  # (N, K) floats that pass 2 does not need
    rank = document_order(scan.keys, shuffle=options.shuffle)
    split = _hold_out(assignment, scan.sizes, rank, options)

    # Every check has passed. Complete-or-absent: the old manifest goes first, the new one comes last.
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)
    fitted.router.save(out_dir / ROUTER_DIR)
    tokenizer_entry = _save_tokenizer(out_dir, tok)
    written = _write_token_files(out_dir, train, tok, assignment, split, sizes=scan.sizes, rank=rank, options=options)
    manifest = _manifest(
        options,
        corpus_manifest=corpus_manifest,
        eos=int(tok.EOS),
        tokenizer_entry=tokenizer_entry,
        fitted=fitted,
        scan=scan,
        assignment=assignment,
        split=split,
        written=written,
    )
    _write_manifest(out_dir, manifest)
    log.info(
        "shards: %d paths, purity %.3f (random %.3f), token shares %s",
        options.num_paths,
        manifest["purity"],
        manifest["purity_random"],
        manifest["balance"]["token_shares"],
    )
    return manifest


# ------------------------------------------------------------------------------------------------ the stages


@dataclass(frozen=True, slots=True)
class _Scan:
    """What pass 1 keeps of every document (the texts themselves are not kept)."""

    prefix_texts: list[str]
    """The routing prefix: the first `prefix_tokens` bytes of the text, whatever the shard tokenizer."""
    sizes: np.ndarray
    """(N,) int64 shard tokens of each document, EOS included."""
    domains: list[str]
    keys: np.ndarray
    """(N,) uint64 order key of each document (`document_key`)."""


@dataclass(frozen=True, slots=True)
class _Fitted:
    router: Router
    """Fitted here, or a copy of the given router: `_assign` may set its `bias`."""
    given: bool
    fit_documents: int
    """Documents the router was fitted on (0 for a given router)."""
    levels: list[int] | None


@dataclass(frozen=True, slots=True)
class _Assignment:
    labels: np.ndarray
    """(N,) path of each document (top-1, after balancing)."""
    unbalanced: np.ndarray
    """(N,) path of each document before balancing (a given router: with its own offsets)."""
    second: np.ndarray | None
    """(N,) second-best path of each document with `overlap_top2`, else None."""
    shares: np.ndarray
    """(K,) tokens routed to each path / fair share."""
    satisfied: bool
    """Every share is within [min_share, max_share]."""


@dataclass(frozen=True, slots=True)
class _Split:
    heldout: np.ndarray
    """(N,) bool: the document goes to its path's held-out slice instead of the training shards."""
    num_tokens: np.ndarray
    """(K,) int64 tokens in each training shard (second choices included)."""
    num_documents: np.ndarray
    """(K,) documents in each training shard (second choices included)."""


@dataclass(frozen=True, slots=True)
class _Written:
    files: list[str]
    """Token file names: 0..K-1 the training shards, K..2K-1 the held-out slices (only when asked for)."""
    sha256: list[str]
    """Hex digest of each file of `files`."""


def _corpus_manifest(corpus_dir: Path) -> Path:
    path = corpus_dir / MANIFEST_FILE
    if not path.is_file():
        raise CorpusError(f"no corpus manifest at {path}; build the corpus first")
    return path


def _tokenizer(train: Path, options: ShardOptions) -> ByteTokenizer | BPETokenizer:
    """The shard tokenizer; a BPE one is trained on the train split (an extra pass over it)."""
    if options.tokenizer != "bpe":
        return ByteTokenizer()
    try:
        return train_bpe((doc["text"] for doc in iter_jsonl(train)), vocab_size=options.vocab_size)
    except BPEError as exc:
        raise ShardError(str(exc)) from exc


def _scan(train: Path, tok: ByteTokenizer | BPETokenizer, *, prefix_tokens: int, seed: int) -> _Scan:
    """Pass 1: the prefix text, token count (+ EOS), domain and order key of every document."""
    byte_tok = ByteTokenizer()
    prefix_texts: list[str] = []
    sizes: list[int] = []
    domains: list[str] = []
    keys: list[int] = []
    for doc, tokens in _iter_tokens(train, tok, sizes_only=True):
        prefix_texts.append(byte_tok.prefix_text(doc["text"], prefix_tokens))
        sizes.append(len(tokens))
        domains.append(str(doc.get("domain", "")))
        keys.append(document_key(doc["text"], seed=seed))
    return _Scan(
        prefix_texts=prefix_texts,
        sizes=np.asarray(sizes, dtype=np.int64),
        domains=domains,
        keys=np.asarray(keys, dtype=np.uint64),
    )


def _fit(
    prefix_texts: list[str], options: ShardOptions, *, router: Router | None, featurizer: ModelFeaturizer | None
) -> _Fitted:
    """A copy of the given router (checked against the options), or one fitted on at most `fit_sample`
    prefixes (a seeded random subset, in corpus order)."""
    if router is not None:
        if router.num_paths != options.num_paths or router.prefix_tokens != options.prefix_tokens:
            raise ShardError(
                f"the given router has {router.num_paths} paths and reads {router.prefix_tokens} tokens; "
                f"asked for {options.num_paths} paths and {options.prefix_tokens} tokens"
            )
        levels = list(router.levels) if router.levels else None
        return _Fitted(router=dataclasses.replace(router), given=True, fit_documents=0, levels=levels)
    n = len(prefix_texts)
    if n > options.fit_sample:
        fit_idx = np.sort(np.random.default_rng(options.seed).choice(n, size=options.fit_sample, replace=False))
        fit_texts = [prefix_texts[i] for i in fit_idx]
    else:
        fit_texts = prefix_texts
    fitted = fit_router(
        fit_texts,
        num_paths=options.num_paths,
        prefix_tokens=options.prefix_tokens,
        seed=options.seed,
        levels=options.levels,
        model=featurizer,
    )
    return _Fitted(router=fitted, given=False, fit_documents=len(fit_texts), levels=options.levels)


def _score(router: Router, prefix_texts: list[str], *, batch_docs: int) -> np.ndarray:
    """(N, K) unbiased routing scores of every document, featurized in batches (bounded memory)."""
    out = np.empty((len(prefix_texts), router.num_paths), dtype=np.float64)
    for b in range(0, len(prefix_texts), batch_docs):
        out[b : b + batch_docs] = router.scores(router.embed(prefix_texts[b : b + batch_docs]))
    return out


def _assign(fitted: _Fitted, scores: np.ndarray, sizes: np.ndarray, options: ShardOptions) -> _Assignment:
    """Route every document: with `balance`, first set `fitted.router.bias` to offsets that keep every path's
    tokens within the share bounds; then the top-1 path (and with `overlap_top2` the second-best) by the
    biased scores, lowest index on ties."""
    router, num_paths = fitted.router, options.num_paths
    # A given router's own offsets are the starting point ("unbalanced" = routed as given); balancing adds to them.
    start = router.bias if fitted.given and router.bias is not None else np.zeros(num_paths)
    if options.balance:
        try:
            delta = fit_bias(
                scores + start[None, :],
                sizes,
                min_share=options.min_share,
                max_share=options.max_share,
                strict=options.strict_balance,
            )
        except BalanceError as exc:
            raise ShardError(f"balancing {len(sizes)} documents over {num_paths} paths: {exc}") from exc
        router.bias = start + delta if fitted.given else delta
    unbalanced = np.argmin(scores + start[None, :], axis=1)
    biased = scores + (router.bias[None, :] if router.bias is not None else 0.0)  # a new array: ours to change
    labels = np.argmin(biased, axis=1)
    second: np.ndarray | None = None
    if options.overlap_top2:
        # Second-best path: the best one once the top-1 is ruled out (lowest index on ties, like argmin).
        biased[np.arange(len(labels)), labels] = np.inf
        second = np.argmin(biased, axis=1)

    shares = token_shares(labels, sizes, num_paths)
    satisfied = bool(((shares >= options.min_share - 1e-12) & (shares <= options.max_share + 1e-12)).all())
    if options.balance and not satisfied:
        log.warning(
            "shards: token shares %s are outside [%s, %s] (the closest balance found); see the manifest",
            np.round(shares, 3).tolist(),
            options.min_share,
            options.max_share,
        )
    return _Assignment(labels=labels, unbalanced=unbalanced, second=second, shares=shares, satisfied=satisfied)


def document_key(text: str, *, seed: int) -> int:
    """A document's sort key in a shuffled shard: the first 8 bytes of blake2b(seed, its UTF-8 text),
    little-endian. The same for a seed on every machine and version (unlike a library RNG stream), and a function
    of the text alone, so the order does not depend on where the document sat in the corpus."""
    salt = f"dipaco-shard-order/{seed}/".encode()
    return int.from_bytes(hashlib.blake2b(salt + text.encode("utf-8"), digest_size=8).digest(), "little")


def document_order(keys: np.ndarray, *, shuffle: bool) -> np.ndarray:
    """(n,) int64 rank of each document in the order shards are written: sorted by its `document_key` when
    `shuffle` (identical texts, the only ties, keep corpus order among themselves), else corpus order (rank =
    index). Within each file documents follow increasing rank."""
    n = len(keys)
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(np.asarray(keys, dtype=np.uint64), kind="stable")] = np.arange(n, dtype=np.int64)
    return rank


def _hold_out(assignment: _Assignment, sizes: np.ndarray, rank: np.ndarray, options: ShardOptions) -> _Split:
    """Mark the held-out slice of every path (its last documents by `rank`) and count what its training shard
    gets. Raises `ShardError` when a path gets no document, too few to hold `heldout_docs_per_shard` out, or under
    `min_tokens_per_shard` tokens."""
    labels, second, num_paths = assignment.labels, assignment.second, options.num_paths
    routed_docs = np.bincount(labels, minlength=num_paths)
    empty = np.flatnonzero(routed_docs == 0).tolist()
    if empty:
        raise ShardError(
            f"paths {empty} get no document (product k-means combinations nobody falls in); "
            "turn balancing on or use fewer paths"
        )
    held_out_per_path = options.heldout_docs_per_shard
    heldout = np.zeros(len(labels), dtype=bool)
    if held_out_per_path:
        few = [(p, int(c)) for p, c in enumerate(routed_docs) if c <= held_out_per_path]
        if few:
            listed = ", ".join(f"path {p}: {c} documents" for p, c in few)
            raise ShardError(
                f"cannot hold out {held_out_per_path} documents per shard and keep some for training: {listed}"
            )
        for p in range(num_paths):
            members = np.flatnonzero(labels == p)
            heldout[members[np.argsort(rank[members], kind="stable")][-held_out_per_path:]] = True

    trained = ~heldout
    num_tokens = np.bincount(labels[trained], weights=sizes[trained], minlength=num_paths).astype(np.int64)
    num_documents = np.bincount(labels[trained], minlength=num_paths)
    if second is not None:
        num_tokens += np.bincount(second[trained], weights=sizes[trained], minlength=num_paths).astype(np.int64)
        num_documents += np.bincount(second[trained], minlength=num_paths)
    too_small = [(p, int(t)) for p, t in enumerate(num_tokens) if t < options.min_tokens_per_shard]
    if too_small:
        listed = ", ".join(f"path {p}: {t} tokens" for p, t in too_small)
        raise ShardError(f"shards below min_tokens_per_shard={options.min_tokens_per_shard}: {listed}")
    return _Split(heldout=heldout, num_tokens=num_tokens, num_documents=num_documents)


def _save_tokenizer(out_dir: Path, tok: ByteTokenizer | BPETokenizer) -> dict[str, Any] | None:
    """Save a BPE tokenizer next to the shards (write then rename); its manifest entry, None for byte tokens."""
    if isinstance(tok, ByteTokenizer):
        return None
    tmp = out_dir / f".{TOKENIZER_FILE}.tmp-{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, out_dir / TOKENIZER_FILE)
    return {
        "kind": "bpe",
        "file": TOKENIZER_FILE,
        "vocab_size": tok.vocab_size,
        "sha256": _sha256_file(out_dir / TOKENIZER_FILE),
    }


@dataclass(frozen=True, slots=True)
class _Layout:
    """Where pass 2 writes every document: one file (and with top-2 a second training file), at a token offset."""

    file: np.ndarray
    """(N,) file of each document: 0..K-1 its training shard, K..2K-1 its held-out slice."""
    offset: np.ndarray
    """(N,) token offset of the document in `file`."""
    second_file: np.ndarray | None
    """(N,) the training shard of its second-best path (top-2), -1 for a held-out document; None without top-2."""
    second_offset: np.ndarray | None
    file_tokens: np.ndarray
    """(2K,) tokens of every file."""


def _file_layout(assignment: _Assignment, split: _Split, *, sizes: np.ndarray, rank: np.ndarray) -> _Layout:
    """Each file holds its documents in increasing `rank`, back to back: sort the (document, file) entries by
    file then rank; a document's offset is the tokens of the entries before it in its file."""
    labels, second, heldout = assignment.labels, assignment.second, split.heldout
    n, num_paths = len(labels), len(split.num_tokens)
    file = np.where(heldout, num_paths + labels, labels).astype(np.int64)
    entry_doc, entry_file = np.arange(n, dtype=np.int64), file
    extra = np.flatnonzero(~heldout) if second is not None else np.zeros(0, dtype=np.int64)
    if second is not None:
        entry_doc = np.concatenate([entry_doc, extra])
        entry_file = np.concatenate([entry_file, second[extra].astype(np.int64)])
    order = np.lexsort((rank[entry_doc], entry_file))  # by file, then rank
    entry_sizes = sizes[entry_doc]
    file_tokens = np.bincount(entry_file, weights=entry_sizes, minlength=2 * num_paths).astype(np.int64)
    file_start = np.concatenate([[0], np.cumsum(file_tokens)[:-1]])
    sorted_sizes = entry_sizes[order]
    offsets = np.empty(len(order), dtype=np.int64)
    offsets[order] = np.cumsum(sorted_sizes) - sorted_sizes - file_start[entry_file[order]]
    assert (file_tokens[:num_paths] == split.num_tokens).all()
    second_file = second_offset = None
    if second is not None:
        second_file = np.full(n, -1, dtype=np.int64)
        second_offset = np.zeros(n, dtype=np.int64)
        second_file[extra] = second[extra]
        second_offset[extra] = offsets[n:]
    return _Layout(
        file=file, offset=offsets[:n], second_file=second_file, second_offset=second_offset, file_tokens=file_tokens
    )


def _write_token_files(
    out_dir: Path,
    train: Path,
    tok: ByteTokenizer | BPETokenizer,
    assignment: _Assignment,
    split: _Split,
    *,
    sizes: np.ndarray,
    rank: np.ndarray,
    options: ShardOptions,
) -> _Written:
    """Pass 2: write the tokens of every document into its training shard (and its second-best path's) or its
    held-out slice, at the offset `_file_layout` gives it (streaming the train split in corpus order, in bounded
    memory). Each file is written under a temporary name, read back for its sha256, and renamed once every file
    is complete."""
    num_paths = options.num_paths
    targets = [out_dir / shard_file_name(p) for p in range(num_paths)]
    if options.heldout_docs_per_shard:
        targets += [out_dir / heldout_file_name(p) for p in range(num_paths)]
    layout = _file_layout(assignment, split, sizes=sizes, rank=rank)
    tmps = [out_dir / f".{t.name}.tmp-{os.getpid()}" for t in targets]
    item = TOKEN_DTYPE.itemsize
    n = len(sizes)
    seen = 0
    try:
        with ExitStack() as stack:
            files = [stack.enter_context(open(t, "wb")) for t in tmps]
            for f, fh in enumerate(files):
                fh.truncate(int(layout.file_tokens[f]) * item)
            fds = [fh.fileno() for fh in files]
            for i, (_, tokens) in enumerate(_iter_tokens(train, tok)):  # the same file as pass 1, in the same order
                if i >= n:
                    raise ShardError(f"{train} changed while sharding (more than {n} documents)")
                assert isinstance(tokens, np.ndarray)
                data = tokens.tobytes()
                if len(data) != item * sizes[i]:
                    raise ShardError(f"{train} changed while sharding (document {i})")
                os.pwrite(fds[layout.file[i]], data, int(layout.offset[i]) * item)
                if layout.second_file is not None and layout.second_file[i] >= 0:
                    assert layout.second_offset is not None
                    os.pwrite(fds[layout.second_file[i]], data, int(layout.second_offset[i]) * item)
                seen = i + 1
            if seen != n:
                raise ShardError(f"{train} changed while sharding ({seen} documents, {n} before)")
            for fh in files:
                fh.flush()
                os.fsync(fh.fileno())
        digests = [_sha256_file(t) for t in tmps]
        for tmp, target in zip(tmps, targets, strict=True):
            os.replace(tmp, target)
    finally:
        for tmp in tmps:
            tmp.unlink(missing_ok=True)
    return _Written(files=[t.name for t in targets], sha256=digests)


def _manifest(
    options: ShardOptions,
    *,
    corpus_manifest: Path,
    eos: int,
    tokenizer_entry: dict[str, Any] | None,
    fitted: _Fitted,
    scan: _Scan,
    assignment: _Assignment,
    split: _Split,
    written: _Written,
) -> dict[str, Any]:
    """The shard manifest: the options that matter, one entry per shard, purity and balance."""
    num_paths, labels, sizes = options.num_paths, assignment.labels, scan.sizes
    levels = fitted.levels
    return {
        "format": SHARDS_FORMAT,
        "num_paths": num_paths,
        "prefix_tokens": options.prefix_tokens,
        "seed": options.seed,
        "token_dtype": TOKEN_DTYPE.str,
        "eos": eos,
        "corpus_manifest_sha256": _sha256_file(corpus_manifest),
        "router_dir": ROUTER_DIR,
        "shards": _shard_entries(options, scan=scan, assignment=assignment, split=split, written=written),
        "purity": purity(labels, scan.domains),
        "purity_random": random_purity(labels, scan.domains, seed=options.seed),
        "levels": list(levels) if levels and len(levels) >= 2 else [num_paths],
        "fit_documents": fitted.fit_documents,
        "order": (
            {"shuffled": True, "seed": options.seed, "key": ORDER_KEY} if options.shuffle else {"shuffled": False}
        ),
        **({"router_given": True, "router_head": fitted.router.head_weight is not None} if fitted.given else {}),
        **({"heldout_docs_per_shard": options.heldout_docs_per_shard} if options.heldout_docs_per_shard else {}),
        **({"overlap_top2": True} if assignment.second is not None else {}),
        **({"tokenizer": tokenizer_entry} if tokenizer_entry is not None else {}),
        "balance": {
            "enabled": options.balance,
            "min_share": options.min_share,
            "max_share": options.max_share,
            "satisfied": assignment.satisfied,
            "token_shares": [round(float(x), 6) for x in assignment.shares],
            "unbalanced_token_shares": [
                round(float(x), 6) for x in token_shares(assignment.unbalanced, sizes, num_paths)
            ],
            "moved_documents": int((labels != assignment.unbalanced).sum()),
        },
    }


def _shard_entries(
    options: ShardOptions, *, scan: _Scan, assignment: _Assignment, split: _Split, written: _Written
) -> list[dict[str, Any]]:
    """Per path: its training shard's file, sha256, tokens, documents and domains, and its held-out slice's."""
    num_paths, labels, second, heldout = options.num_paths, assignment.labels, assignment.second, split.heldout
    trained = ~heldout
    domain_array = np.asarray(scan.domains, dtype=object)
    shards: list[dict[str, Any]] = []
    for path_index in range(num_paths):
        members = (labels == path_index) & trained
        shard_domains = Counter(domain_array[members].tolist())
        entry: dict[str, Any] = {
            "path_index": path_index,
            "file": written.files[path_index],
            "sha256": written.sha256[path_index],
            "num_tokens": int(split.num_tokens[path_index]),
            "num_documents": int(split.num_documents[path_index]),
        }
        if second is not None:
            extra = (second == path_index) & trained
            shard_domains.update(domain_array[extra].tolist())
            entry["num_secondary_documents"] = int(extra.sum())
        entry["domains"] = dict(sorted(shard_domains.items()))
        if options.heldout_docs_per_shard:
            held = (labels == path_index) & heldout
            entry["heldout"] = {
                "file": written.files[num_paths + path_index],
                "sha256": written.sha256[num_paths + path_index],
                "num_tokens": int(scan.sizes[held].sum()),
                "num_documents": int(held.sum()),
                "domains": dict(sorted(Counter(domain_array[held].tolist()).items())),
            }
        shards.append(entry)
    return shards


def _write_manifest(out_dir: Path, manifest: dict[str, Any]) -> None:
    """Write then rename: the manifest appears only once every file it lists is in place."""
    tmp = out_dir / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST_FILE)


# ------------------------------------------------------------------------------------------------ helpers


def _iter_tokens(
    train: Path, tok: ByteTokenizer | BPETokenizer, *, sizes_only: bool = False
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


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ------------------------------------------------------------------------------------------------ reading back


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
