"""Prefix features for routing (DiPaCo §2.4): hashed character n-grams → TF-IDF → truncated SVD → L2 norm.

Only the hashing step uses scikit-learn at routing time (it is stateless, rebuilt from its parameters); the
learned parts (IDF vector, SVD components) are plain arrays applied by `transform`, so a router saved as
safetensors + JSON routes exactly like the one that was fitted, without pickling anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import scipy.sparse as sp
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import HashingVectorizer, TfidfTransformer

from router.tokenizer import ByteTokenizer


@dataclass(kw_only=True, frozen=True, slots=True)
class FeatureConfig:
    """Hyper-parameters of the prefix featurizer (everything needed to rebuild it, minus learned arrays)."""

    prefix_tokens: int = 32
    """Route by the first this-many byte tokens of a document, as in the paper."""
    n_features: int = 2**16
    """Hashing space; 64k buckets keep collisions rare for 1-3 character n-grams of 32-byte prefixes."""
    ngram_min: int = 1
    ngram_max: int = 3
    """Character n-grams inside word boundaries (`char_wb`): punctuation and short words carry the domain."""
    svd_dims: int = 32
    """Dense dimensions after truncated SVD (fewer if there are not enough documents)."""

    def __post_init__(self) -> None:
        if self.prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be >= 1, got {self.prefix_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.n_features < 2 or self.svd_dims < 1:
            raise ValueError(f"n_features={self.n_features} and svd_dims={self.svd_dims} must be positive")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prefixes(texts: list[str], prefix_tokens: int) -> list[str]:
    """The text of each document's first `prefix_tokens` byte tokens."""
    tok = ByteTokenizer()
    return [tok.prefix_text(t, prefix_tokens) for t in texts]


def _hasher(config: FeatureConfig) -> HashingVectorizer:
    return HashingVectorizer(
        analyzer="char_wb",
        ngram_range=(config.ngram_min, config.ngram_max),
        n_features=config.n_features,
        alternate_sign=False,
        norm=None,
        lowercase=False,
        dtype=np.float64,
    )


def _l2_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms > 0, norms, 1.0)


def hashed_tfidf(texts: list[str], config: FeatureConfig, idf: np.ndarray) -> sp.csr_matrix:
    """Hashed n-gram counts of each prefix, weighted by idf, rows L2-normalised (as `TfidfTransformer`)."""
    counts = sp.csr_matrix(_hasher(config).transform(prefixes(texts, config.prefix_tokens)))
    weighted = sp.csr_matrix(counts @ sp.diags(idf))
    norms = np.sqrt(np.asarray(weighted.multiply(weighted).sum(axis=1))).ravel()
    return sp.csr_matrix(sp.diags(1.0 / np.where(norms > 0, norms, 1.0)) @ weighted)


def transform(texts: list[str], config: FeatureConfig, idf: np.ndarray, components: np.ndarray) -> np.ndarray:
    """Dense, L2-normalised features, shape (len(texts), svd_dims)."""
    x = hashed_tfidf(texts, config, idf)
    return _l2_rows(np.asarray(x @ components.T, dtype=np.float64))


def fit_features(texts: list[str], config: FeatureConfig, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learn the IDF vector (n_features,) and SVD components (dims, n_features) on the training prefixes."""
    counts = _hasher(config).transform(prefixes(texts, config.prefix_tokens))
    idf = TfidfTransformer(smooth_idf=True).fit(counts).idf_.astype(np.float64)
    x = hashed_tfidf(texts, config, idf)
    # Randomized SVD needs fewer components than documents to be meaningful.
    dims = max(1, min(config.svd_dims, len(texts) - 1))
    svd = TruncatedSVD(n_components=dims, algorithm="randomized", random_state=seed).fit(x)
    return idf, np.ascontiguousarray(svd.components_, dtype=np.float64)
