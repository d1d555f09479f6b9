from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from modules import ModelConfig, PathModel
from router.corpus import iter_jsonl
from router.evaluate import SinglePathRouter, evaluate_dense, evaluate_routed
from router.router import Router

V = 257  # byte vocabulary + EOS


class Uniform(nn.Module):
    """Equal logits for every token: perplexity is exactly the vocabulary size."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*idx.shape, V)


class NextByte(nn.Module):
    """Puts logit `big` on (current token + 1): only the current token matters, never the context."""

    def __init__(self, big: float = 5.0, max_len: int | None = None) -> None:
        super().__init__()
        self.big, self.max_len = big, max_len

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.max_len is not None:
            assert idx.shape[1] <= self.max_len
        logits = torch.zeros(*idx.shape, V)
        logits.scatter_(2, ((idx + 1) % V).unsqueeze(-1), self.big)
        return logits


def _nll_next_byte(correct: int, wrong: int, big: float = 5.0) -> float:
    denom = math.exp(big) + V - 1
    return correct * (math.log(denom) - big) + wrong * math.log(denom)


class FirstCharRouter:
    """Path 1 for texts containing `marker` within the prefix, else path 0."""

    def __init__(self, prefix_tokens: int, marker: str = "X") -> None:
        self.prefix_tokens, self.marker = prefix_tokens, marker

    @property
    def num_paths(self) -> int:
        return 2

    def route(self, texts: list[str]) -> np.ndarray:
        return np.array([int(self.marker in t[: self.prefix_tokens]) for t in texts], dtype=np.int64)


def test_uniform_model_has_perplexity_vocab_size_and_exact_counts() -> None:
    docs = ["abcdefghij", "xy", "", "z" * 100]  # 10 + EOS = 11 -> 7 scored; 2 skipped; 101 -> 97 scored
    result = evaluate_dense(Uniform(), docs, prefix_tokens=4, context=16)
    assert result.num_tokens == 7 + 97
    assert (result.num_documents, result.skipped_documents) == (2, 2)
    assert result.perplexity == pytest.approx(V, rel=1e-6)
    assert result.loss == pytest.approx(math.log(V), rel=1e-6)
    assert result.routing_histogram == [2]


def test_prefix_is_excluded_exactly() -> None:
    # Targets x[4:] = e f g h EOS: four follow their predecessor by one byte, EOS does not. The broken pattern
    # inside the prefix ('#' at 2, then 'd' after it) is never scored.
    result = evaluate_dense(NextByte(), ["ab#defgh"], prefix_tokens=4, context=8)
    assert result.num_tokens == 5
    assert result.loss * 5 == pytest.approx(_nll_next_byte(correct=4, wrong=1), rel=1e-6)
    # One token more of prefix: one correct target fewer.
    result = evaluate_dense(NextByte(), ["ab#defgh"], prefix_tokens=5, context=8)
    assert result.loss * 4 == pytest.approx(_nll_next_byte(correct=3, wrong=1), rel=1e-6)


@pytest.mark.parametrize(("context", "stride"), [(2, None), (3, 1), (5, 2), (64, None), (7, 7)])
def test_sliding_windows_score_every_target_once(context: int, stride: int | None) -> None:
    text = "abcdefghijklmnopqrstuvwxyz" * 3 + "!"  # 79 bytes + EOS
    result = evaluate_dense(NextByte(max_len=context), [text], prefix_tokens=6, context=context, stride=stride)
    assert result.num_tokens == 80 - 6
    # 'z'->'a' twice, 'z'->'!' once and '!'->EOS are the wrong predictions; the rest are right.
    assert result.loss * 74 == pytest.approx(_nll_next_byte(correct=70, wrong=4), rel=1e-6)


def test_prefix_longer_than_context() -> None:
    result = evaluate_dense(Uniform(), ["q" * 50], prefix_tokens=32, context=8)
    assert result.num_tokens == 51 - 32 and result.perplexity == pytest.approx(V)


def test_routing_sends_documents_to_their_path() -> None:
    docs = ["Xbcdefghij", "abcdefghij", "abcdefghijk"]
    result = evaluate_routed([NextByte(), Uniform()], FirstCharRouter(4), docs, prefix_tokens=4, context=16)
    assert result.routing_histogram == [2, 1]
    p0, p1 = result.per_path
    assert (p0.num_documents, p0.num_tokens, p1.num_documents, p1.num_tokens) == (2, 7 + 8, 1, 7)
    assert p1.perplexity == pytest.approx(V)
    assert p0.loss is not None and p0.loss * 15 == pytest.approx(_nll_next_byte(correct=13, wrong=2))
    total = (p0.loss * 15 + math.log(V) * 7) / 22
    assert result.loss == pytest.approx(total) and result.num_tokens == 22


def test_every_reroutes_on_the_previous_window() -> None:
    doc = "a" * 8 + "X" * 8 + "b" * 16  # 32 bytes + EOS; prefix 8, W = 8
    built: list[int] = []

    def model_for(p: int) -> nn.Module:
        built.append(p)
        return [Uniform(), Uniform()][p]

    once = evaluate_routed(model_for, FirstCharRouter(8), [doc], prefix_tokens=8, context=64)
    assert [p.num_tokens for p in once.per_path] == [25, 0] and built == [0]
    assert once.per_path[1].perplexity is None
    # Segment [16, 24) is routed on x[8:16] = 'XXXXXXXX' -> path 1; [8, 16) and [24, 33) on 'a'/'b' windows -> 0.
    every = evaluate_routed(model_for, FirstCharRouter(8), [doc], prefix_tokens=8, context=64, every=8)
    assert [p.num_tokens for p in every.per_path] == [17, 8]
    assert every.routing_histogram == [1, 0]  # the histogram counts documents by their prefix route
    assert every.every == 8 and every.num_tokens == once.num_tokens == 25


def test_router_reading_scored_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="the route would see scored tokens"):
        evaluate_routed([Uniform()], SinglePathRouter(prefix_tokens=32), ["x" * 50], prefix_tokens=16, context=8)
    with pytest.raises(ValueError, match="got 1 path models for a router with 2 paths"):
        evaluate_routed([Uniform()], FirstCharRouter(4), ["x" * 50], prefix_tokens=4, context=8)


def test_identical_paths_match_the_dense_baseline(corpus_dir: Path, shards4: tuple[Path, dict[str, Any]]) -> None:
    out, _ = shards4
    router = Router.load(out / "router")
    docs = [d["text"] for d in iter_jsonl(corpus_dir / "heldout.jsonl")][:16]
    torch.manual_seed(0)
    model = PathModel(ModelConfig(seq_len=32, d_model=32, n_layers=1, n_heads=2))
    routed = evaluate_routed([model] * 4, router, docs, context=32)
    dense = evaluate_dense(model, docs, context=32)
    assert routed.num_tokens == dense.num_tokens == sum(len(d.encode()) + 1 - 32 for d in docs)
    assert routed.loss == pytest.approx(dense.loss, rel=1e-6)
    assert sum(routed.routing_histogram) == 16 and len(routed.per_path) == 4
    again = evaluate_routed([model] * 4, router, docs, context=32)
    assert again.to_dict() == routed.to_dict()


def test_public_surface() -> None:
    import router

    assert router.__all__ == [
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
    ]  # sorted: a name added or dropped is a decision, not an accident
    assert all(hasattr(router, name) for name in router.__all__)
