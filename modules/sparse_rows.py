"""Sparse embedding rows: only the embedding rows a lease touched travel (Persia, arXiv 2111.05897 §4).

A sample touches only the embedding rows of its own tokens. With a large (BPE) vocabulary and routed,
language-specific paths, most rows of the token embedding get no gradient during a lease: their outer gradient
is only what AdamW did to them without data (weight decay, and the decay of momentum from earlier leases). With
the run field `sparse_rows` an island sends the embedding restricted to the rows that appeared in the inputs of
its batches, and the outer round averages each row over the contributions that touched it.

Wire format (`modules.codec.encode_grad(..., rows=...)`): the tensor `<name>` holds the k sent rows, shape
(k, d), in the run's codec like any tensor, and `<name>::rows` (I64, shape (k,)) their row ids, sorted, unique,
k >= 1. Only `tok_emb.weight` of the embed level is sent this way (`SPARSE_PARAM`); with tied embeddings the
same matrix is the LM head and every row gets gradient from the softmax, so such runs are refused.

In memory, a *sparse part* is a gradient dict whose `<name>` is full size (vocab, d), zeros on the unsent rows,
and whose `<name>::rows` names the sent rows (`expand_rows`); `modules.outer.RoundAccumulator` divides each row
by the total weight of the parts that sent it, and leaves the rows nobody sent as they were (weights and outer
momentum), the per-row form of its rule for a module nobody trained.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from modules.config import ModelConfig

Tensors = dict[str, torch.Tensor]

ROWS_SUFFIX = "::rows"
"""`<name>::rows`: the row ids of a sparse tensor (the `::` suffix is reserved for codec tensors)."""
SPARSE_PARAM = "tok_emb.weight"
"""The one parameter sent as rows: the token embedding of the embed level."""
SPARSE_LEVEL = "embed"
"""Name of the level that holds `SPARSE_PARAM` (`modules.layout`: the embed level is always called `embed`)."""


def is_rows(name: str) -> bool:
    """Whether a tensor name is the row ids of a sparse tensor."""
    return name.endswith(ROWS_SUFFIX)


def rows_name(name: str) -> str:
    return f"{name}{ROWS_SUFFIX}"


def touched_rows(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Sorted unique int64 ids of the tokens in the inputs of `batches` (a bool mask of the vocabulary, so the
    cost is one scatter per batch). The targets do not touch the input embedding: they are not counted."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    for x, _ in batches:
        mask[x.reshape(-1).cpu()] = True
    return mask.nonzero().reshape(-1)


def expand_rows(grad: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]) -> Tensors:
    """A decoded part with sparse tensors (`<name>` of shape (k, d) and `<name>::rows`) as a sparse part in
    memory: `<name>` scattered into zeros of `like[name]`'s shape, `<name>::rows` kept. Dense tensors pass."""
    out: Tensors = {}
    for name, t in grad.items():
        rows = grad.get(rows_name(name))
        if is_rows(name) or rows is None:
            out[name] = t
            continue
        full = torch.zeros(like[name].shape, dtype=torch.float32)
        full[rows] = t.float()
        out[name] = full
    return out


def split_rows(grad: Mapping[str, torch.Tensor]) -> tuple[Tensors, dict[str, torch.Tensor]]:
    """(the gradient tensors, {tensor name: its row ids}) of a part; the second is empty for a dense part."""
    tensors = {name: t for name, t in grad.items() if not is_rows(name)}
    rows = {name[: -len(ROWS_SUFFIX)]: t for name, t in grad.items() if is_rows(name)}
    missing = sorted(set(rows) - set(tensors))
    if missing:
        raise KeyError(f"row ids without their tensor: {missing}")
    return tensors, rows


def check_sparse_rows(cfg: ModelConfig, *, sparse_rows: bool) -> None:
    """Sparse rows need an untied embedding: tied, the matrix is the LM head and every row gets gradient
    (ValueError otherwise; the coordinator answers it with a 422)."""
    if sparse_rows and cfg.tie_embeddings:
        raise ValueError(
            "sparse_rows needs untied embeddings: with tie_embeddings the token embedding is also the LM head, "
            "whose every row gets gradient from the softmax (set model.tie_embeddings to false, or sparse_rows "
            "to false)"
        )
