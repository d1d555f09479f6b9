"""Shuffled shards make the input order not matter: a corpus given in blocks of domains and the same
corpus shuffled are written into the same shard (the order is keyed by each document's text), so they train a
dense model to the same held-out perplexity, and their first rounds read every domain, where corpus-order shards
of the block corpus read one or two. In-process (`modules.simulate`, the service's round arithmetic) on a tiny
model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.quality import dense_layout, evaluate_modules, shard_tokens
from modules import InnerConfig, ModelConfig, OuterConfig, simulate
from modules.layout import parse_layout
from router.corpus import iter_jsonl
from router.evaluate import SinglePathRouter
from router.shards import ShardOptions, shard_corpus
from router.sources import build_corpus_from
from router.tokenizer import ByteTokenizer

CFG = ModelConfig(d_model=32, n_heads=2, seq_len=64, n_layers=2)
ROUNDS, H, BATCH = 6, 10, 8
DOC_CHARS = 200


def held_out_ppl(corpus: Path, out: Path, *, shuffle: bool, documents: list[str]) -> float:
    shard_corpus(corpus, out, ShardOptions(num_paths=1, shuffle=shuffle, seed=0))
    layout = parse_layout(dense_layout(CFG.n_layers), n_layers=CFG.n_layers)
    torch.manual_seed(0)
    result = simulate(
        CFG,
        layout,
        InnerConfig(lr=3e-3, batch_size=BATCH, warmup_steps=5, total_steps=ROUNDS * H),
        OuterConfig(),
        steps_per_round=H,
        rounds=ROUNDS,
        seed=0,
        tokens=shard_tokens(out),
    )
    return evaluate_modules(CFG, layout, result.modules, router=SinglePathRouter(), documents=documents).perplexity


@pytest.mark.timeout(600)
def test_block_order_and_shuffled_corpora_train_alike(corpus_dir: Path, tmp_path: Path) -> None:
    # Short documents, so that the tokens a round trains on span many of them (a fair sample, not a handful).
    train = [d | {"text": d["text"][:DOC_CHARS]} for d in iter_jsonl(corpus_dir / "train.jsonl")]
    blocks = sorted(train, key=lambda d: d["domain"])  # every document of one domain, then the next
    shuffled = list(blocks)
    random.Random(1).shuffle(shuffled)
    heldout = [d["text"][:DOC_CHARS] for d in iter_jsonl(corpus_dir / "heldout.jsonl")]
    corpora = {}
    for name, docs in (("blocks", blocks), ("shuffled", shuffled)):
        src = tmp_path / f"{name}.jsonl"
        src.write_text("".join(json.dumps(d) + "\n" for d in docs))
        corpora[name] = tmp_path / f"corpus-{name}"
        build_corpus_from(src, corpora[name], domain_field="domain", heldout_fraction=0.0)
    ppl_blocks = held_out_ppl(corpora["blocks"], tmp_path / "s-blocks", shuffle=True, documents=heldout)
    ppl_shuffled = held_out_ppl(corpora["shuffled"], tmp_path / "s-shuffled", shuffle=True, documents=heldout)
    # The same documents in two input orders: one shard order, byte for byte, so the same training.
    assert (tmp_path / "s-blocks" / "path-0000.tokens").read_bytes() == (
        tmp_path / "s-shuffled" / "path-0000.tokens"
    ).read_bytes()
    assert abs(ppl_blocks / ppl_shuffled - 1) <= 0.03, (ppl_blocks, ppl_shuffled)
    # What the first rounds read: from corpus-order shards of the block corpus, a few domains only; from
    # shuffled shards of either corpus, every domain. (Perplexity alone does not show the order bug at this
    # size: six short rounds of corpus-order shards read two domains and score as well on the held-out set.)
    domain_of = {d["text"]: d["domain"] for d in train}
    read = ROUNDS * H * BATCH * CFG.seq_len
    shard_corpus(corpora["blocks"], tmp_path / "s-order", ShardOptions(num_paths=1, shuffle=False))
    seen = {name: first_domains(tmp_path / name, read, domain_of) for name in ("s-order", "s-blocks", "s-shuffled")}
    assert len(seen["s-order"]) <= 2 and len(seen["s-blocks"]) == len(seen["s-shuffled"]) == 5, seen


def first_domains(shards: Path, num_tokens: int, domain_of: dict[str, str]) -> set[str]:
    """The domains of the documents in the first `num_tokens` tokens of a one-path shard directory."""
    tokens = shard_tokens(shards)[0][:num_tokens].numpy()
    ends = np.flatnonzero(tokens == ByteTokenizer.EOS)
    return {domain_of[ByteTokenizer().decode(d)] for d in np.split(tokens, ends + 1)[:-1]}
