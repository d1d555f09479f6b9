"""Routed held-out evaluation (DiPaCo §2.5 and §10 of the architecture): perplexity of a set of paths.

Each document is routed by its first `prefix_tokens` tokens to one path and scored on the remaining tokens only;
the prefix is never scored, for any model, so a dense baseline (`evaluate_dense`: every document to path 0) is
measured on exactly the same tokens.

What is scored, exactly. A document of n tokens becomes the sequence `x = tokens + [EOS]` (length L = n + 1, the
same framing as the training shards, where every document ends with EOS). The targets are `x[t]` for
`prefix_tokens <= t < L`, each predicted from the tokens before it: L - prefix_tokens tokens per document.
Documents with no target (L <= prefix_tokens) are skipped and counted in `EvalResult.skipped_documents`.

Long documents (L > context + 1). The first window is `x[0 : context]` and scores the targets
`x[prefix_tokens : context + 1]` (the prefix is their context). The remaining targets are cut into consecutive,
non-overlapping spans of `stride` tokens (default: `context`); the span `[s, e)` is predicted from the input
window `x[max(0, e - 1 - context) : e - 1]`, i.e. the `context` tokens before its last target. Every target is
scored exactly once. With the default `stride == context` the input windows do not overlap either (cheapest:
one forward per `context` tokens; the first target of a window sees one token of context). A smaller stride
costs `context / stride` times more and gives every target at least `context - stride` previous tokens.
(When prefix_tokens > context, the first span is `[prefix_tokens, prefix_tokens + stride)` with the `context`
tokens before it.) The model always sees positions 0..len(window)-1; short windows are
right-padded (causal attention: padding never affects the positions that are scored).

Re-routing every W tokens (`every=W`, paper §2.5). Target position t belongs to segment k = t // W. Segment 0
uses the document's route (its first `prefix_tokens` tokens); segment k >= 1 uses the route of the W tokens
`x[(k-1)W : kW]`, decoded to text and given to the router like any prefix (the router featurizes at most its own
`prefix_tokens` of them, so W == prefix_tokens routes on exactly the W previous tokens). A window that spans
several segments is run once per path it needs, and each target is taken from its own segment's path; the
context fed to that path is the same previous tokens, whichever path produced them.

Loss is the mean negative log-likelihood in nats per scored token, accumulated in float64; perplexity is
exp(loss). Deterministic for a given model and thread count (`torch.no_grad`, eval mode, fixed batching).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from router.tokenizer import ByteTokenizer


class RouterLike(Protocol):
    """What evaluation needs from a router: `router.Router` and `SinglePathRouter` both fit."""

    @property
    def num_paths(self) -> int: ...

    @property
    def prefix_tokens(self) -> int: ...

    def route(self, texts: list[str]) -> np.ndarray: ...


class TokenizerLike(Protocol):
    EOS: int

    def encode_array(self, text: str, *, eos: bool = False) -> np.ndarray: ...

    def decode(self, ids: Any) -> str: ...


PathSource = Sequence[nn.Module] | Callable[[int], nn.Module]
"""The models of the paths: a sequence indexed by path, or a function path index -> model (called once per path
that at least one target is routed to, so unused paths are never built)."""


@dataclass(frozen=True, slots=True)
class SinglePathRouter:
    """Sends every document to path 0: turns `evaluate_routed` into a dense-baseline evaluation."""

    prefix_tokens: int = 32

    @property
    def num_paths(self) -> int:
        return 1

    def route(self, texts: list[str]) -> np.ndarray:
        return np.zeros(len(texts), dtype=np.int64)


@dataclass(frozen=True, slots=True)
class PathEval:
    path_index: int
    num_documents: int
    """Documents whose prefix was routed here (the routing histogram)."""
    num_tokens: int
    """Scored tokens this path predicted (with `every`, segments of other documents count too)."""
    loss: float | None
    """Mean NLL (nats/token) over those tokens; None when the path scored nothing."""
    perplexity: float | None


@dataclass(frozen=True, slots=True)
class EvalResult:
    loss: float
    """Mean NLL in nats per scored token, over all documents."""
    perplexity: float
    num_tokens: int
    num_documents: int
    """Documents scored (at least one token after the prefix)."""
    skipped_documents: int
    """Documents with no token after the prefix (counted, not scored)."""
    per_path: list[PathEval]
    routing_histogram: list[int]
    """Documents per path by their prefix route."""
    prefix_tokens: int
    context: int
    stride: int
    every: int | None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "perplexity": self.perplexity,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "skipped_documents": self.skipped_documents,
            "routing_histogram": list(self.routing_histogram),
            "prefix_tokens": self.prefix_tokens,
            "context": self.context,
            "stride": self.stride,
            "every": self.every,
            "per_path": [
                {
                    "path_index": p.path_index,
                    "num_documents": p.num_documents,
                    "num_tokens": p.num_tokens,
                    "loss": p.loss,
                    "perplexity": p.perplexity,
                }
                for p in self.per_path
            ],
            **self.extra,
        }


@dataclass(slots=True)
class _Window:
    doc: int
    start: int
    """First input position in the document sequence."""
    end: int
    """One past the last input position; targets are x[start + 1 : end + 1]."""
    score_from: int
    """First target position (in document coordinates) that this window scores."""


def _windows(length: int, *, prefix: int, context: int, stride: int, doc: int) -> list[_Window]:
    """Windows scoring targets [prefix, length) of one sequence, each target once (see module doc)."""
    out: list[_Window] = []
    # The first window starts at the document's first token, so the prefix is the context of the first targets.
    e = min(length, context + 1 if prefix <= context else prefix + stride)
    out.append(_Window(doc=doc, start=max(0, e - 1 - context), end=e - 1, score_from=prefix))
    while e < length:
        s, e = e, min(e + stride, length)  # targets [s, e), predicted from the `context` tokens before e - 1
        end = e - 1
        out.append(_Window(doc=doc, start=max(0, end - context), end=end, score_from=s))
    return out


def _segment_paths(
    seqs: list[np.ndarray],
    doc_route: np.ndarray,
    *,
    router: RouterLike,
    tokenizer: TokenizerLike,
    prefix: int,
    every: int | None,
) -> list[np.ndarray]:
    """Path of every target position of every document (entries before `prefix` are unused, set to -1)."""
    out: list[np.ndarray] = []
    if every is None:
        for seq, route in zip(seqs, doc_route, strict=True):
            paths = np.full(len(seq), int(route), dtype=np.int64)
            paths[:prefix] = -1
            out.append(paths)
        return out
    # Route every needed window of every document in one call: segment k >= 1 by the W tokens before it.
    texts: list[str] = []
    owners: list[tuple[int, int]] = []
    for d, seq in enumerate(seqs):
        first = max(1, prefix // every)
        for k in range(first, (len(seq) - 1) // every + 1):
            texts.append(tokenizer.decode(seq[(k - 1) * every : k * every].tolist()))
            owners.append((d, k))
    routes = router.route(texts) if texts else np.zeros(0, dtype=np.int64)
    seg_route: dict[tuple[int, int], int] = {o: int(r) for o, r in zip(owners, routes, strict=True)}
    for d, seq in enumerate(seqs):
        seg = np.arange(len(seq)) // every
        paths = np.array([int(doc_route[d]) if k == 0 else seg_route.get((d, int(k)), -1) for k in seg], dtype=np.int64)
        paths[:prefix] = -1
        out.append(paths)
    return out


def evaluate_routed(
    paths: PathSource,
    router: RouterLike,
    documents: list[str],
    *,
    prefix_tokens: int = 32,
    context: int,
    every: int | None = None,
    stride: int | None = None,
    batch_size: int = 256,
    tokenizer: TokenizerLike | None = None,
    device: str | torch.device = "cpu",
) -> EvalResult:
    """Route each document by its prefix, score the tokens after it with its path; see the module doc."""
    stride = _check_routed_args(
        router, prefix_tokens=prefix_tokens, context=context, stride=stride, every=every, batch_size=batch_size
    )
    num_paths = router.num_paths
    if isinstance(paths, Sequence) and len(paths) != num_paths:
        raise ValueError(f"got {len(paths)} path models for a router with {num_paths} paths")
    tok: TokenizerLike = tokenizer if tokenizer is not None else ByteTokenizer()

    seqs, doc_route = _route_documents(documents, router, tok, prefix_tokens=prefix_tokens)
    target_paths = _segment_paths(seqs, doc_route, router=router, tokenizer=tok, prefix=prefix_tokens, every=every)
    windows = [
        w
        for d, s in enumerate(seqs)
        for w in _windows(len(s), prefix=prefix_tokens, context=context, stride=stride, doc=d)
    ]
    inputs, targets = _window_tokens(seqs, windows, context=context)
    owner = _window_owners(windows, target_paths, context=context)
    nll, count = _score_owned(paths, inputs, targets, owner, num_paths=num_paths, batch_size=batch_size, device=device)

    histogram = np.bincount(doc_route, minlength=num_paths).astype(int).tolist() if seqs else [0] * num_paths
    total_tokens = int(count.sum())
    loss = float(nll.sum() / total_tokens) if total_tokens else math.nan
    per_path = [
        PathEval(
            path_index=p,
            num_documents=histogram[p],
            num_tokens=int(count[p]),
            loss=float(nll[p] / count[p]) if count[p] else None,
            perplexity=math.exp(nll[p] / count[p]) if count[p] else None,
        )
        for p in range(num_paths)
    ]
    return EvalResult(
        loss=loss,
        perplexity=math.exp(loss) if total_tokens else math.nan,
        num_tokens=total_tokens,
        num_documents=len(seqs),
        skipped_documents=len(documents) - len(seqs),
        per_path=per_path,
        routing_histogram=histogram,
        prefix_tokens=prefix_tokens,
        context=context,
        stride=stride,
        every=every,
    )


def _check_routed_args(
    router: RouterLike, *, prefix_tokens: int, context: int, stride: int | None, every: int | None, batch_size: int
) -> int:
    """Refuse arguments that would score the wrong tokens; returns the stride (default: `context`)."""
    if prefix_tokens < 1:
        raise ValueError(f"prefix_tokens must be >= 1, got {prefix_tokens}")
    if router.prefix_tokens > prefix_tokens:
        raise ValueError(
            f"the router reads {router.prefix_tokens} tokens but only the first {prefix_tokens} are excluded "
            "from scoring: the route would see scored tokens"
        )
    if context < 1:
        raise ValueError(f"context must be >= 1, got {context}")
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    if every is not None and every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return stride


def _route_documents(
    documents: list[str], router: RouterLike, tok: TokenizerLike, *, prefix_tokens: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """The int64 sequences `tokens + [EOS]` of the documents with at least one target (longer than the prefix),
    in order, and the path each is routed to by its prefix."""
    all_seqs = [tok.encode_array(text, eos=True).astype(np.int64) for text in documents]
    keep = [i for i, s in enumerate(all_seqs) if len(s) > prefix_tokens]
    seqs = [all_seqs[i] for i in keep]
    doc_route = router.route([documents[i] for i in keep]) if keep else np.zeros(0, dtype=np.int64)
    if doc_route.size and not (0 <= doc_route.min() and doc_route.max() < router.num_paths):
        raise ValueError(f"router returned paths outside [0, {router.num_paths})")
    return seqs, doc_route


def _window_tokens(seqs: list[np.ndarray], windows: list[_Window], *, context: int) -> tuple[np.ndarray, np.ndarray]:
    """(num_windows, context) int64 inputs and targets (the next token of each input), right-padded with 0."""
    inputs = np.zeros((len(windows), context), dtype=np.int64)
    targets = np.zeros((len(windows), context), dtype=np.int64)
    for i, w in enumerate(windows):
        seq, width = seqs[w.doc], w.end - w.start
        inputs[i, :width] = seq[w.start : w.end]
        targets[i, :width] = seq[w.start + 1 : w.end + 1]
    return inputs, targets


def _window_owners(windows: list[_Window], target_paths: list[np.ndarray], *, context: int) -> np.ndarray:
    """(num_windows, context) path that scores each target of each window; -1 where nothing is scored."""
    owner = np.full((len(windows), context), -1, dtype=np.int64)
    for i, w in enumerate(windows):
        first = w.score_from - (w.start + 1)  # column of the first scored target
        owner[i, first : w.end - w.start] = target_paths[w.doc][w.score_from : w.end + 1]
    return owner


def _score_owned(
    paths: PathSource,
    inputs: np.ndarray,
    targets: np.ndarray,
    owner: np.ndarray,
    *,
    num_paths: int,
    batch_size: int,
    device: str | torch.device,
) -> tuple[np.ndarray, np.ndarray]:
    """Summed NLL (float64) and number of scored targets per path: each path runs over the windows holding at
    least one of its targets and scores those targets only. Paths are built (when `paths` is a function) and
    run one at a time, and a path that owns no target is never built."""
    nll = np.zeros(num_paths, dtype=np.float64)
    count = np.zeros(num_paths, dtype=np.int64)
    with torch.no_grad():
        for p in range(num_paths):
            rows = np.flatnonzero((owner == p).any(axis=1))
            if rows.size == 0:
                continue
            model = (paths[p] if isinstance(paths, Sequence) else paths(p)).to(device).eval()
            for b in range(0, rows.size, batch_size):
                idx = rows[b : b + batch_size]
                mask = torch.from_numpy(owner[idx] == p).to(device)
                x = torch.from_numpy(inputs[idx]).to(device)
                y = torch.from_numpy(targets[idx]).to(device)
                logits = model(x).float()  # (B, context, vocab)
                losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
                nll[p] += float(losses.view_as(y)[mask].double().sum())
                count[p] += int(mask.sum())
            del model  # one path in memory at a time
    return nll, count


def evaluate_dense(
    model: nn.Module,
    documents: list[str],
    *,
    prefix_tokens: int = 32,
    context: int,
    stride: int | None = None,
    batch_size: int = 256,
    tokenizer: TokenizerLike | None = None,
    device: str | torch.device = "cpu",
) -> EvalResult:
    """A dense baseline on exactly the tokens `evaluate_routed` scores: every document to the one model."""
    return evaluate_routed(
        [model],
        SinglePathRouter(prefix_tokens=prefix_tokens),
        documents,
        prefix_tokens=prefix_tokens,
        context=context,
        stride=stride,
        batch_size=batch_size,
        tokenizer=tokenizer,
        device=device,
    )


def score_all_paths(
    paths: PathSource,
    documents: list[str],
    *,
    num_paths: int | None = None,
    prefix_tokens: int = 32,
    context: int,
    stride: int | None = None,
    batch_size: int = 256,
    tokenizer: TokenizerLike | None = None,
    device: str | torch.device = "cpu",
) -> np.ndarray:
    """(len(documents), num_paths) mean NLL (nats/token) of every document under every path, on exactly the
    tokens `evaluate_routed` scores (prefix excluded, same windows); a document with no token after the prefix
    gets NaN. `num_paths` is needed when `paths` is a function. Used for discriminative re-routing
    (`router.refit`): every path is built once and runs over every document."""
    if isinstance(paths, Sequence):
        num_paths = len(paths) if num_paths is None else num_paths
        if num_paths != len(paths):
            raise ValueError(f"num_paths={num_paths} but {len(paths)} path models")
    elif num_paths is None:
        raise ValueError("num_paths is required when paths is a function")
    if prefix_tokens < 1 or context < 1 or batch_size < 1:
        raise ValueError(
            f"prefix_tokens, context and batch_size must be >= 1, got {prefix_tokens}, {context}, {batch_size}"
        )
    stride = context if stride is None else stride
    if not 1 <= stride <= context:
        raise ValueError(f"stride must be in [1, context={context}], got {stride}")
    tok: TokenizerLike = tokenizer if tokenizer is not None else ByteTokenizer()
    seqs = [tok.encode_array(text, eos=True).astype(np.int64) for text in documents]
    windows = [
        w
        for d, s in enumerate(seqs)
        if len(s) > prefix_tokens
        for w in _windows(len(s), prefix=prefix_tokens, context=context, stride=stride, doc=d)
    ]
    n = len(windows)
    inputs, targets = _window_tokens(seqs, windows, context=context)
    scored = np.zeros((n, context), dtype=bool)
    doc_of = np.array([w.doc for w in windows], dtype=np.int64)
    for i, w in enumerate(windows):
        scored[i, w.score_from - (w.start + 1) : w.end - w.start] = True
    counts = np.bincount(doc_of, weights=scored.sum(axis=1), minlength=len(documents))
    out = np.full((len(documents), num_paths), np.nan, dtype=np.float64)
    with torch.no_grad():
        for p in range(num_paths):
            if n == 0:
                break
            model = (paths[p] if isinstance(paths, Sequence) else paths(p)).to(device).eval()
            nll = np.zeros(n, dtype=np.float64)
            for b in range(0, n, batch_size):
                x = torch.from_numpy(inputs[b : b + batch_size]).to(device)
                y = torch.from_numpy(targets[b : b + batch_size]).to(device)
                mask = torch.from_numpy(scored[b : b + batch_size]).to(device)
                logits = model(x).float()
                losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none")
                nll[b : b + batch_size] = (losses.view_as(y).double() * mask).sum(dim=1).cpu().numpy()
            per_doc = np.bincount(doc_of, weights=nll, minlength=len(documents))
            has = counts > 0
            out[has, p] = per_doc[has] / counts[has]
            del model
    return out
