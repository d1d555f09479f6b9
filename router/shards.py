"""Shards: the train split routed to one token file per path, plus the router and a manifest (written last).

Each shard `path-{i:04d}.tokens` holds the byte tokens of its documents, each followed by EOS, as
little-endian uint16. The output is byte-for-byte deterministic for the same corpus and parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from router.corpus import MANIFEST_FILE, TRAIN_FILE, CorpusError, iter_jsonl
from router.router import fit_router
from router.tokenizer import TOKEN_DTYPE, ByteTokenizer

log = logging.getLogger(__name__)

SHARDS_FORMAT = 1
ROUTER_DIR = "router"
RANDOM_PURITY_TRIALS = 20
"""Random assignments averaged for the purity baseline."""


class ShardError(ValueError):
    """Shards cannot be written, or the files on disk do not match their manifest."""


def shard_file_name(path_index: int) -> str:
    return f"path-{path_index:04d}.tokens"


def purity(labels: np.ndarray, domains: list[str]) -> float:
    """Fraction of documents whose domain is the majority domain of their shard."""
    if len(domains) == 0:
        return 0.0
    majority = 0
    for path in np.unique(labels):
        counts = Counter(d for d, lab in zip(domains, labels, strict=True) if lab == path)
        majority += max(counts.values())
    return majority / len(domains)


def random_purity(
    labels: np.ndarray, domains: list[str], *, seed: int, trials: int = RANDOM_PURITY_TRIALS
) -> float:
    """Mean purity of random assignments with the same shard sizes (the labels, shuffled)."""
    rng = np.random.default_rng(seed)
    return float(np.mean([purity(rng.permutation(labels), domains) for _ in range(trials)]))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def shard_corpus(
    corpus_dir: Path,
    out_dir: Path,
    *,
    num_paths: int,
    prefix_tokens: int = 32,
    seed: int = 0,
    min_tokens_per_shard: int = 0,
) -> dict[str, Any]:
    """Fit the router on the train split, write one token file per path, the router and the manifest."""
    corpus_manifest = corpus_dir / MANIFEST_FILE
    if not corpus_manifest.is_file():
        raise CorpusError(f"no corpus manifest at {corpus_manifest}; build the corpus first")
    docs = list(iter_jsonl(corpus_dir / TRAIN_FILE))
    texts = [d["text"] for d in docs]
    domains = [d["domain"] for d in docs]
    router = fit_router(texts, num_paths=num_paths, prefix_tokens=prefix_tokens, seed=seed)
    labels = router.route(texts)

    tok = ByteTokenizer()
    sizes = [len(t.encode("utf-8")) + 1 for t in texts]  # + EOS
    num_tokens = np.bincount(labels, weights=sizes, minlength=num_paths).astype(np.int64)
    too_small = [(i, int(n)) for i, n in enumerate(num_tokens) if n < min_tokens_per_shard]
    if too_small:
        listed = ", ".join(f"path {i}: {n} tokens" for i, n in too_small)
        raise ShardError(f"shards below min_tokens_per_shard={min_tokens_per_shard}: {listed}")

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST_FILE).unlink(missing_ok=True)  # complete-or-absent
    router.save(out_dir / ROUTER_DIR)
    shards: list[dict[str, Any]] = []
    for path_index in range(num_paths):
        members = np.flatnonzero(labels == path_index)
        target = out_dir / shard_file_name(path_index)
        tmp = out_dir / f".{target.name}.tmp-{os.getpid()}"
        digest = hashlib.sha256()
        with open(tmp, "wb") as fh:
            for i in members:
                data = tok.encode_array(texts[i], eos=True).tobytes()
                digest.update(data)
                fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
        shard_domains = Counter(domains[i] for i in members)
        shards.append({
            "path_index": path_index, "file": target.name, "sha256": digest.hexdigest(),
            "num_tokens": int(num_tokens[path_index]), "num_documents": int(members.size),
            "domains": dict(sorted(shard_domains.items())),
        })
    manifest: dict[str, Any] = {
        "format": SHARDS_FORMAT,
        "num_paths": num_paths,
        "prefix_tokens": prefix_tokens,
        "seed": seed,
        "token_dtype": TOKEN_DTYPE.str,
        "eos": tok.EOS,
        "corpus_manifest_sha256": _sha256_file(corpus_manifest),
        "router_dir": ROUTER_DIR,
        "shards": shards,
        "purity": purity(labels, domains),
        "purity_random": random_purity(labels, domains, seed=seed),
    }
    tmp = out_dir / f".{MANIFEST_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / MANIFEST_FILE)
    log.info("shards: %d paths, purity %.3f (random %.3f)", num_paths, manifest["purity"],
             manifest["purity_random"])
    return manifest


def load_manifest(out_dir: Path) -> dict[str, Any]:
    """Read a shard manifest and check every shard file's size and sha256 against it."""
    path = out_dir / MANIFEST_FILE
    if not path.is_file():
        raise ShardError(f"no shard manifest at {path}")
    manifest: dict[str, Any] = json.loads(path.read_text())
    for shard in manifest["shards"]:
        file = out_dir / shard["file"]
        if not file.is_file():
            raise ShardError(f"shard file {file} for path {shard['path_index']} is missing")
        expected_size = shard["num_tokens"] * TOKEN_DTYPE.itemsize
        if file.stat().st_size != expected_size:
            raise ShardError(
                f"shard file {file} has {file.stat().st_size} bytes, manifest says {expected_size} "
                f"({shard['num_tokens']} tokens)"
            )
        actual = _sha256_file(file)
        if actual != shard["sha256"]:
            raise ShardError(f"shard file {file} has sha256 {actual}, manifest says {shard['sha256']}")
    return manifest
