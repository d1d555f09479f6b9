"""Routing quality by domain: how pure the shards are, and what a random assignment of the same sizes gets.

A shard's documents are counted by domain (the corpus's `domain` field); purity is the fraction of documents
whose domain is the majority domain of their shard. The random baseline shuffles the labels, so it keeps every
shard's size and measures only what the sizes alone give. Both are recorded in the shard manifest.
"""

from __future__ import annotations

import numpy as np

RANDOM_PURITY_TRIALS = 20
"""Random assignments averaged for the purity baseline."""


def purity(labels: np.ndarray, domains: list[str]) -> float:
    """Fraction of documents whose domain is the majority domain of their shard."""
    codes, num_domains = _domain_codes(domains)
    return _purity_codes(np.asarray(labels, dtype=np.int64), codes, num_domains)


def random_purity(labels: np.ndarray, domains: list[str], *, seed: int, trials: int = RANDOM_PURITY_TRIALS) -> float:
    """Mean purity of random assignments with the same shard sizes (the labels, shuffled)."""
    rng = np.random.default_rng(seed)
    codes, num_domains = _domain_codes(domains)
    labels = np.asarray(labels, dtype=np.int64)
    return float(np.mean([_purity_codes(rng.permutation(labels), codes, num_domains) for _ in range(trials)]))


def _domain_codes(domains: list[str]) -> tuple[np.ndarray, int]:
    """Each domain as an integer code (sorted order) and the number of distinct domains."""
    _, codes = np.unique(np.asarray(domains, dtype=object).astype(str), return_inverse=True)
    return codes.astype(np.int64), int(codes.max()) + 1 if len(codes) else 0


def _purity_codes(labels: np.ndarray, codes: np.ndarray, num_domains: int) -> float:
    if len(codes) == 0:
        return 0.0
    table = np.zeros((int(labels.max()) + 1, num_domains), dtype=np.int64)  # (shards, domains) document counts
    np.add.at(table, (labels, codes), 1)
    return float(table.max(axis=1).sum() / len(codes))
