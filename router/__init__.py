"""Corpora in, shards out: the local corpus, the byte tokenizer, prefix k-means routing, shard files."""

from router.corpus import build_local_corpus, iter_jsonl
from router.router import Router, fit_router
from router.shards import load_manifest, shard_corpus
from router.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Router", "build_local_corpus", "fit_router", "iter_jsonl", "load_manifest",
           "shard_corpus"]
