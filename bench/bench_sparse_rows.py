"""Sparse embedding rows: embedding bytes per contribution and held-out perplexity, dense rows vs
`sparse_rows`, on the multilingual man-page corpus with a BPE vocabulary.

In process (`modules.simulate`, the reference the service equals): a DiPaCo 2x2 (debug flavour, vocabulary set to
the BPE tokenizer's) trains `--rounds` rounds of H=`--inner-steps` on the flat k-means shards of
`dipaco.quality` (`prepare_corpus(builtin="manpages")`, `tokenizer="bpe"`), once with dense rows and once with
`sparse_rows`, same seeds, for each codec of `--codecs`. Reported per codec: the embed level's upload bytes per
contribution (header included, `grad_payload_nbytes`; sparse: the rows of the lease's input tokens), and the final
held-out perplexity of each run and their ratio. Held out: the tail of each path's shard past every token the run
trains on, scored with that path's final model (mean over the paths, token-weighted).

    OMP_NUM_THREADS=1 python bench/bench_sparse_rows.py --workdir /tmp/sparse-bench
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Annotated

import torch
import typer

from dipaco.quality import QualitySettings, corpus_tokenizer, prepare_corpus, shard_tokens, shards_for
from modules import (
    InnerConfig,
    ModelConfig,
    OuterConfig,
    PathModel,
    batches_from_tokens,
    compose_state,
    flavour,
    grad_payload_nbytes,
    parse_layout,
    simulate,
    touched_rows,
)
from modules.simulate import next_range

LAYOUT = "embed:shared, b0-0:routed2, b1-1:routed2, head:shared"


def embed_bytes(cfg: ModelConfig, rows: int | None, codec: str) -> int:
    """Bytes of the embed level's part of one upload: dense (`rows` None) or `rows` sparse rows."""
    shapes: dict[str, list[int]] = {"embed/tok_emb.weight": [rows if rows is not None else cfg.vocab_size, cfg.d_model]}
    if rows is not None:
        shapes["embed/tok_emb.weight::rows"] = [rows]
    return grad_payload_nbytes(shapes, codec)  # type: ignore[arg-type]


def rows_per_lease(
    tokens: list[torch.Tensor], cfg: ModelConfig, inner: InnerConfig, *, h: int, rounds: int
) -> list[int]:
    """k of every contribution: the distinct input tokens of each path's lease, with the simulator's cursor."""
    out: list[int] = []
    for shard in tokens:
        offset = 0
        for _ in range(rounds):
            start, offset = next_range(
                offset, length=shard.numel(), steps=h, batch_size=inner.batch_size, seq_len=cfg.seq_len
            )
            span = shard[start : start + h * inner.batch_size * cfg.seq_len + 1]
            batches = batches_from_tokens(span, batch_size=inner.batch_size, seq_len=cfg.seq_len, steps=h)
            out.append(int(touched_rows(batches, cfg.vocab_size).numel()))
    return out


@torch.no_grad()
def heldout_ppl(cfg: ModelConfig, modules: list[list[dict[str, torch.Tensor]]], heldout: list[torch.Tensor]) -> float:
    """exp of the token-weighted mean loss of each path's final model on its own held-out tail."""
    layout = parse_layout(LAYOUT, n_layers=cfg.n_layers)
    total, count = 0.0, 0
    for p, tail in enumerate(heldout):
        model = PathModel(cfg)
        choice = layout.path_modules(p)
        model.load_state_dict(compose_state([modules[lv][m] for lv, m in enumerate(choice)]), strict=True)
        model.eval()
        n = (tail.numel() - 1) // cfg.seq_len
        x = tail[: n * cfg.seq_len].view(n, cfg.seq_len)
        y = tail[1 : n * cfg.seq_len + 1].view(n, cfg.seq_len)
        for i in range(0, n, 16):
            total += float(model.loss(x[i : i + 16], y[i : i + 16])) * x[i : i + 16].numel()
            count += x[i : i + 16].numel()
    return math.exp(total / count)


def main(
    workdir: Annotated[Path, typer.Option(help="Corpus, tokenizer and shards (reused between runs)")] = Path(
        "/tmp/dipaco-sparse-rows"
    ),
    rounds: Annotated[int, typer.Option(help="Outer rounds")] = 6,
    inner_steps: Annotated[int, typer.Option(help="H")] = 30,
    batch_size: Annotated[int, typer.Option()] = 8,
    vocab_size: Annotated[int, typer.Option(help="BPE vocabulary")] = 8192,
    heldout_tokens: Annotated[int, typer.Option(help="Held-out tokens per path (the tail of its shard)")] = 16384,
    codecs: Annotated[str, typer.Option(help="Comma-separated codecs to train with")] = "fp32,int8",
    lr: Annotated[float, typer.Option(help="Inner AdamW lr")] = 1e-3,
) -> None:
    torch.set_num_threads(1)
    settings = QualitySettings(tokenizer="bpe", vocab_size=vocab_size, batch_size=batch_size, seed=0)
    t0 = time.perf_counter()
    corpus = workdir / "corpus"
    prepare_corpus(corpus, builtin="manpages")
    tok = corpus_tokenizer(corpus, workdir, settings)
    assert tok is not None
    shards = shard_tokens(shards_for(corpus, workdir, (2, 2), settings))
    prep_s = time.perf_counter() - t0
    base = flavour("debug")
    cfg = ModelConfig.from_dict({**base.to_dict(), "vocab_size": tok.vocab_size})
    inner = InnerConfig(lr=lr, warmup_steps=10, total_steps=rounds * inner_steps, batch_size=batch_size)
    train_span = rounds * inner_steps * batch_size * cfg.seq_len + 1
    for p, s in enumerate(shards):
        if s.numel() < train_span + heldout_tokens:
            raise typer.BadParameter(f"shard {p} has {s.numel()} tokens, need {train_span + heldout_tokens}")
    train = [s[:train_span] for s in shards]
    heldout = [s[-heldout_tokens:] for s in shards]
    layout = parse_layout(LAYOUT, n_layers=cfg.n_layers)
    ks = rows_per_lease(train, cfg, inner, h=inner_steps, rounds=rounds)
    result: dict[str, object] = {
        "vocab_size": cfg.vocab_size,
        "model": cfg.to_dict(),
        "rounds": rounds,
        "inner_steps": inner_steps,
        "batch_size": batch_size,
        "tokens_per_lease": inner_steps * batch_size * cfg.seq_len,
        "rows_per_contribution": {"mean": sum(ks) / len(ks), "min": min(ks), "max": max(ks)},
        "shard_tokens": [int(s.numel()) for s in shards],
        "prep_s": round(prep_s, 1),
        "codecs": {},
    }
    for codec in [c.strip() for c in codecs.split(",") if c.strip()]:
        row: dict[str, object] = {
            "embed_bytes_dense": embed_bytes(cfg, None, codec),
            "embed_bytes_sparse_mean": sum(embed_bytes(cfg, k, codec) for k in ks) / len(ks),
        }
        for sparse in (False, True):
            t = time.perf_counter()
            sim = simulate(
                cfg, layout, inner, OuterConfig(), steps_per_round=inner_steps, rounds=rounds, seed=0, tokens=train,
                codec=codec, sparse_rows=sparse,  # type: ignore[arg-type]
            )  # fmt: skip
            key = "sparse" if sparse else "dense"
            row[f"ppl_{key}"] = heldout_ppl(cfg, sim.modules, heldout)
            row[f"train_loss_last_{key}"] = sum(sim.losses[-1]) / len(sim.losses[-1])
            row[f"train_s_{key}"] = round(time.perf_counter() - t, 1)
        row["ppl_ratio"] = float(row["ppl_sparse"]) / float(row["ppl_dense"])  # type: ignore[arg-type]
        row["bytes_ratio"] = float(row["embed_bytes_sparse_mean"]) / float(row["embed_bytes_dense"])  # type: ignore[arg-type]
        result["codecs"][codec] = row  # type: ignore[index]
        typer.echo(json.dumps({codec: row}))
    out = workdir / f"sparse-rows-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2))
    typer.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    typer.run(main)
