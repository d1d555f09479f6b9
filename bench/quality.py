"""Quality benchmark: does DiPaCo beat a dense model of its path size, and approach a ~4x larger one?

All models are trained through the real service (coordinator subprocess on SQLite + blobs, one island
subprocess per path) on one corpus, at the same steps (= tokens) per path, and scored on held-out routed
perplexity (first 32 tokens route and are never scored). Prints the per-round and final tables, the report's
self-checks, the targets, the service-vs-simulator cross-check, and exits 1 when a target is missed or cannot be
believed (2 when the cross-check fails). See docs/QUALITY.md.

    python bench/quality.py                                  # dense-S, 2x2, flat 4, dense-2w on the built-in corpus
    python bench/quality.py --with-4x4 --reroute-every 32    # + DiPaCo 4x4, re-routing every 32 tokens
    python bench/quality.py --routing product                # product k-means shards for the 2x2 / 4x4
    python bench/quality.py --block gpt2                     # every model with the GPT-2 block (bench/blocks.py
                                                             # compares the two blocks)
    python bench/quality.py --builtin-corpus manpages --flavour small --tokenizer bpe --vocab-size 8192 \
        --with-4x4 --with-token-reference --only "dense-S,DiPaCo 2x2,DiPaCo 4x4,dense-2w 4x tokens"
                                                             # the multilingual corpus (docs/QUALITY.md)
    python bench/quality.py --corpus DIR                     # your corpus (from `dipaco router corpus --from`)
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console

from dipaco import quality_report as qr
from dipaco.quality import (
    BUILTIN_CORPORA,
    QualitySettings,
    corpus_tokenizer,
    cross_check,
    prepare_corpus,
    run_comparison,
    standard_contenders,
)
from dipaco.service import LocalService
from router.corpus import load_corpus_manifest

console = Console(width=140)


def main(
    workdir: Annotated[Path, typer.Option(help="Corpus, shards, coordinator data, logs, results.")] = Path(
        "/tmp/dipaco-bench-quality"
    ),
    corpus_dir: Annotated[
        Path | None,
        typer.Option("--corpus", help="Your corpus directory (from `dipaco router corpus`); default: a built-in one"),
    ] = None,
    builtin_corpus: Annotated[
        str, typer.Option(help="Without --corpus: local (5 domains) or manpages (multilingual, in source order)")
    ] = "local",
    tokenizer: Annotated[str, typer.Option(help="Shard tokens: byte, or bpe (one tokenizer for every model)")] = "byte",
    vocab_size: Annotated[int, typer.Option(min=257, max=65535, help="BPE vocabulary (with --tokenizer bpe)")] = 8192,
    shuffle: Annotated[
        bool, typer.Option(help="Shards in a seeded random document order; --no-shuffle: corpus order (to compare)")
    ] = True,
    flavour: Annotated[str, typer.Option(help="Path size S: model flavour (debug, small).")] = "debug",
    block: Annotated[
        str | None, typer.Option(help="Transformer block of every model: gpt2 or llama (default: the flavour's)")
    ] = None,
    rounds: Annotated[int, typer.Option(min=1)] = 8,
    inner_steps: Annotated[int, typer.Option(min=1, help="H")] = 50,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    lr: Annotated[float, typer.Option(help="Inner AdamW peak lr (1e-3 beat 3e-3 for every model)")] = 1e-3,
    outer_lr: Annotated[float, typer.Option()] = 0.7,
    outer_momentum: Annotated[float, typer.Option()] = 0.9,
    docs_per_domain: Annotated[int, typer.Option(min=10)] = 400,
    eval_docs: Annotated[int | None, typer.Option(help="Held-out documents scored (default: all)")] = None,
    eval_every: Annotated[int, typer.Option(min=1, help="Score every N rounds (+ round 0 and the last)")] = 2,
    routing: Annotated[str, typer.Option(help="flat or product (k-means per routed level)")] = "flat",
    width_factor: Annotated[int, typer.Option(min=2, help="Wide dense: d_model x this")] = 2,
    with_4x4: Annotated[bool, typer.Option(help="Also DiPaCo 4x4 (16 paths, 16 islands)")] = False,
    with_token_reference: Annotated[
        bool, typer.Option(help="Also the wide dense model trained on 4x the tokens (the 2x2's total), for reference")
    ] = False,
    reroute_every: Annotated[int | None, typer.Option(help="Also score the last round re-routing every W")] = None,
    only: Annotated[str | None, typer.Option(help="Comma-separated model names to run (default: all)")] = None,
    check: Annotated[str | None, typer.Option(help="Cross-check this model against modules.simulate")] = None,
    max_islands: Annotated[int, typer.Option(min=1)] = 16,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    started = time.monotonic()
    torch.manual_seed(seed)
    settings = QualitySettings(
        rounds=rounds,
        inner_steps=inner_steps,
        batch_size=batch_size,
        lr=lr,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        seed=seed,
        routing=routing,
        max_islands=max_islands,
        eval_every=eval_every,
        eval_docs=eval_docs,
        reroute_every=reroute_every,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        shuffle=shuffle,
    )
    if builtin_corpus not in BUILTIN_CORPORA:
        raise typer.BadParameter(f"--builtin-corpus must be one of {', '.join(BUILTIN_CORPORA)}")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if corpus_dir is not None:
        corpus = corpus_dir.resolve()
        manifest = dict(load_corpus_manifest(corpus))
        corpus_name = str(corpus)
    else:
        corpus = workdir / ("corpus" if builtin_corpus == "local" else f"corpus-{builtin_corpus}")
        manifest = prepare_corpus(corpus, docs_per_domain=docs_per_domain, builtin=builtin_corpus)
        corpus_name = f"built-in {builtin_corpus}"
    tok = corpus_tokenizer(corpus, workdir, settings)
    contenders = standard_contenders(
        flavour,
        block=block,
        width_factor=width_factor,
        with_4x4=with_4x4,
        with_token_reference=with_token_reference,
        vocab_size=tok.vocab_size if tok is not None else None,
    )
    if only:
        wanted = {n.strip() for n in only.split(",")}
        unknown = wanted - {c.name for c in contenders}
        if unknown:
            raise typer.BadParameter(
                f"--only names no contender {sorted(unknown)}; known: {[c.name for c in contenders]}"
            )
        contenders = [c for c in contenders if c.name in wanted]
    block_name = contenders[0].config().block if contenders else block
    console.print(
        f"corpus ({corpus_name}): {manifest['splits']['train']['documents']} train documents "
        f"({manifest['splits']['train']['bytes'] / 1e6:.1f} MB) in {len(manifest['domains'])} domains, "
        f"{manifest['splits']['heldout']['documents']} held-out"
        + (f"; BPE tokenizer of {tok.vocab_size} tokens" if tok is not None else "")
        + f"; {settings}"
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    service = LocalService(data_dir=workdir / f"coordinator-{stamp}", logs=workdir / f"logs-{stamp}")
    checks = []
    with service:
        results = run_comparison(service, contenders, settings, corpus_dir=corpus, workdir=workdir, log=console.print)
        if check:
            contender = next(c for c in contenders if c.name == check)
            result = qr.find(results, check)
            assert result is not None
            checks.append(cross_check(result, contender, settings, corpus_dir=corpus, workdir=workdir))
    console.print(qr.rounds_table(results))
    console.print(
        qr.comparison_table(
            results,
            title=f"held-out routed perplexity, {corpus_name} corpus, {flavour} ({block_name} blocks"
            + (f", BPE {tok.vocab_size}" if tok is not None else "")
            + f"), {rounds} rounds x "
            f"H={inner_steps} x batch {batch_size} = {results[0].tokens_per_path:,} "
            "tokens per path",
        )
    )
    flags = qr.sanity_flags(results)
    if flags:
        console.print(qr.flags_table(flags))
    goals = qr.targets(results)
    console.print(qr.targets_table(goals))
    if checks:
        console.print(qr.cross_check_table(checks))
    png = qr.plot(results, workdir / f"quality-{stamp}.png", title=f"{flavour}, {rounds} x H={inner_steps}")
    out = workdir / f"quality-{stamp}.json"
    out.write_text(
        json.dumps(
            {
                "settings": {k: getattr(settings, k) for k in settings.__slots__},
                "flavour": flavour,
                "block": block_name,
                "corpus": corpus_name,
                "vocab_size": tok.vocab_size if tok is not None else None,
                "results": [r.to_dict() for r in results],
                "flags": [{"model": f.model, "check": f.check, "detail": f.detail} for f in flags],
                "targets": [
                    {
                        "name": t.name,
                        "value": t.value,
                        "goal": t.goal,
                        "met": t.met,
                        "judged": t.judged,
                        "flagged": list(t.flagged),
                    }
                    for t in goals
                ],
                "cross_check": [
                    {"name": c.name, "service": c.service_ppl, "simulator": c.simulator_ppl, "rel_diff": c.rel_diff}
                    for c in checks
                ],
            },
            indent=2,
        )
    )
    console.print(f"plot {png}\nnumbers {out}\nwall time {time.monotonic() - started:.0f} s")
    if checks and not all(c.ok for c in checks):
        sys.exit(2)
    if not qr.all_met(goals):
        sys.exit(1)


if __name__ == "__main__":
    typer.run(main)
