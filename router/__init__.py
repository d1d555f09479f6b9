"""Corpora in, shards out: corpora and sources, the byte tokenizer, prefix (product) k-means routing with
balancing, shard files, and routed evaluation."""

from router.balance import fit_bias
from router.corpus import build_local_corpus, iter_jsonl
from router.evaluate import EvalResult, PathEval, SinglePathRouter, evaluate_dense, evaluate_routed
from router.refit import refit_router, score_all_paths
from router.router import Router, fit_router
from router.shards import load_manifest, shard_corpus
from router.sources import build_corpus_from, iter_documents
from router.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Router", "build_local_corpus", "fit_router", "iter_jsonl", "load_manifest",
           "shard_corpus",
           # added for issue 6
           "EvalResult", "PathEval", "SinglePathRouter", "build_corpus_from", "evaluate_dense", "evaluate_routed",
           "fit_bias", "iter_documents",
           # discriminative re-routing
           "refit_router", "score_all_paths"]
