"""Corpora in, shards out: corpora and sources, the byte tokenizer, prefix (product) k-means routing with
balancing, shard files, routed evaluation and discriminative re-routing."""

from router.balance import fit_bias
from router.corpus import build_local_corpus, iter_jsonl
from router.evaluate import EvalResult, PathEval, SinglePathRouter, evaluate_dense, evaluate_routed
from router.refit import refit_router, score_all_paths
from router.router import Router, fit_router
from router.shards import ShardOptions, load_manifest, shard_corpus
from router.sources import build_corpus_from, iter_documents
from router.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "EvalResult",
    "PathEval",
    "Router",
    "ShardOptions",
    "SinglePathRouter",
    "build_corpus_from",
    "build_local_corpus",
    "evaluate_dense",
    "evaluate_routed",
    "fit_bias",
    "fit_router",
    "iter_documents",
    "iter_jsonl",
    "load_manifest",
    "refit_router",
    "score_all_paths",
    "shard_corpus",
]
