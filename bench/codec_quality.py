"""Does int8 (or bf16) with error feedback change what a run learns? The same runs through the real service with
each codec: dense-S and DiPaCo 2x2 on the built-in corpus, same seeds, same shards; held-out perplexity per codec
and the ratio to fp32 (the default codec is int8 only if it stays within 1 % of fp32 for both models).

    python bench/codec_quality.py                        # debug, 8 x H=50 x batch 16, lr 1e-3, seeds 0,1
    python bench/codec_quality.py --codecs fp32,bf16,int8 --seeds 0
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dipaco.quality import QualitySettings, prepare_corpus, run_comparison, standard_contenders
from dipaco.service import LocalService

console = Console(width=150)
TOLERANCE = 0.01


def main(
    workdir: Annotated[Path, typer.Option(help="Corpus, coordinator data, logs, results.")] = Path(
        "/tmp/dipaco-bench-codecs"
    ),
    codecs: Annotated[str, typer.Option(help="Comma-separated codecs; the first is the reference")] = "fp32,int8",
    seeds: Annotated[str, typer.Option(help="Seeds (initial weights)")] = "0,1",
    rounds: Annotated[int, typer.Option(min=1)] = 8,
    inner_steps: Annotated[int, typer.Option(min=1, help="H")] = 50,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    lr: Annotated[float, typer.Option(help="Inner lr")] = 1e-3,
    eval_docs: Annotated[int | None, typer.Option(help="Held-out documents scored (default: all)")] = 100,
) -> None:
    started = time.monotonic()
    names = [c.strip() for c in codecs.split(",")]
    seed_list = [int(s) for s in seeds.split(",")]
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    corpus = workdir / "corpus"
    prepare_corpus(corpus, docs_per_domain=400)
    contenders = [c for c in standard_contenders("debug") if c.name in ("dense-S", "DiPaCo 2x2")]
    rows: list[dict[str, Any]] = []
    service = LocalService(data_dir=workdir / f"coordinator-{stamp}", logs=workdir / f"logs-{stamp}")
    with service:
        for seed in seed_list:
            for codec in names:  # codecs interleaved: a change of the machine's load hits all alike
                settings = QualitySettings(
                    rounds=rounds,
                    inner_steps=inner_steps,
                    batch_size=batch_size,
                    lr=lr,
                    seed=seed,
                    max_islands=16,
                    eval_every=rounds,
                    eval_docs=eval_docs,
                    codec=codec,
                )
                console.print(f"[bold]{codec}[/] seed {seed} ({time.monotonic() - started:.0f} s)")
                for r in run_comparison(service, contenders, settings, corpus_dir=corpus, workdir=workdir):
                    rows.append({"codec": codec, "seed": seed, "model": r.name, "ppl": r.final_ppl})
                (workdir / f"codecs-{stamp}.json").write_text(json.dumps(rows, indent=2))
    table = Table(title=f"held-out perplexity after {rounds} x H={inner_steps} (seeds {seed_list})")
    table.add_column("model")
    for codec in names:
        table.add_column(codec, justify="right")
        if codec != names[0]:
            table.add_column(f"{codec} / {names[0]}", justify="right")
    verdict: dict[str, bool] = {}
    for model in ("dense-S", "DiPaCo 2x2"):
        means = {c: statistics.mean(r["ppl"] for r in rows if (r["codec"], r["model"]) == (c, model)) for c in names}
        cells = []
        for codec in names:
            cells.append(f"{means[codec]:.3f}")
            if codec != names[0]:
                ratio = means[codec] / means[names[0]]
                cells.append(f"{ratio:.4f}")
                verdict[f"{model} {codec}"] = abs(ratio - 1) <= TOLERANCE
        table.add_row(model, *cells)
    console.print(table)
    console.print(json.dumps({"within_1_percent": verdict, "wall_s": round(time.monotonic() - started)}))


if __name__ == "__main__":
    typer.run(main)
