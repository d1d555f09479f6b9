"""Block benchmark: gpt2 vs llama paths at equal parameters per path, trained through the real service.

Both block styles (`modules.ModelConfig.block`; the llama SwiGLU width matches the gpt2 path's parameter count) run
dense-S and DiPaCo 2x2 (or any contenders of `bench/quality.py`, `--models`) on a built-in corpus exactly like
`bench/quality.py` (coordinator subprocess, one island subprocess per path). The inner lr is chosen by the same
search for both blocks: every lr of `--lrs` with the first seed, keeping the one with the lowest geometric mean
over the models of the *validation-half* perplexity; the other seeds then run at that lr. Seeds change the
initial weights and the shards (k-means and the shuffled document order are seeded); at one seed every block
trains on the same shards. Reported: held-out perplexity (both halves, and the test half) mean and standard
deviation over the seeds, the llama / gpt2 ratio, 2x2 / dense-S, and CPU training tokens/s (the inner AdamW loop
on one thread, as in an island, both blocks interleaved; and end to end per run, islands included). Results go to
`blocks-<time>.json` in `--workdir`, rewritten after every run. See docs/QUALITY.md, docs/LOG.md.

    python bench/blocks.py --eval-docs 100                      # debug, 8 x H=50 x batch 16, 4 lrs, 3 seeds
    python bench/blocks.py --lrs 1e-3 --seeds 0 --rounds 2      # a quick look
    python bench/blocks.py --models "DiPaCo 4x4" --lrs 1e-3     # the 4x4 row (16 island processes)
    python bench/blocks.py --speed-only --speed-reps 15 [--flavour small]   # CPU tokens/s only
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer
from rich.console import Console
from rich.table import Table

from dipaco.quality import ModelResult, QualitySettings, prepare_corpus, run_comparison, standard_contenders
from dipaco.service import LocalService
from modules import InnerConfig, ModelConfig, PathModel, batches_from_tokens, flavour, make_optimizer, train_steps

console = Console(width=150)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def val_ppl(r: ModelResult) -> float:
    return r.ppl(len(r.rounds) - 1, ("val",))


def inner_speed(cfgs: dict[str, ModelConfig], *, batch_size: int, steps: int, reps: int) -> dict[str, float]:
    """Median training tokens/s of each config: AdamW steps on random tokens, one torch thread, interleaved reps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    inner = InnerConfig(batch_size=batch_size, warmup_steps=0, total_steps=10 * steps)
    runs: dict[str, list[float]] = {name: [] for name in cfgs}
    try:
        setups = {}
        for name, cfg in cfgs.items():
            torch.manual_seed(0)
            model = PathModel(cfg)
            tokens = torch.randint(0, cfg.vocab_size, (steps * batch_size * cfg.seq_len + 1,))
            batches = batches_from_tokens(tokens, batch_size=batch_size, seq_len=cfg.seq_len, steps=steps)
            opt = make_optimizer(model, inner)
            train_steps(model, opt, batches[:3], inner, first_step=0)  # warm up
            setups[name] = (model, opt, batches, steps * batch_size * cfg.seq_len)
        for _ in range(reps):
            for name, (model, opt, batches, ntok) in setups.items():
                t0 = time.perf_counter()
                train_steps(model, opt, batches, inner, first_step=0)
                runs[name].append(ntok / (time.perf_counter() - t0))
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(v) for name, v in runs.items()}


def _mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def main(
    workdir: Annotated[Path, typer.Option(help="Corpus, shards, coordinator data, logs, results.")] = Path(
        "/tmp/dipaco-bench-blocks"
    ),
    flavour_name: Annotated[str, typer.Option("--flavour", help="Path size: model flavour.")] = "debug",
    blocks: Annotated[str, typer.Option(help="Comma-separated block styles")] = "gpt2,llama",
    models: Annotated[str, typer.Option(help="Comma-separated contenders of bench/quality.py")] = "dense-S,DiPaCo 2x2",
    lrs: Annotated[str, typer.Option(help="Inner lr search grid (same for every block)")] = "5e-4,1e-3,2e-3,4e-3",
    seeds: Annotated[str, typer.Option(help="Seeds; the first one also runs the lr search")] = "0,1,2",
    rounds: Annotated[int, typer.Option(min=1)] = 8,
    inner_steps: Annotated[int, typer.Option(min=1, help="H")] = 50,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    docs_per_domain: Annotated[int, typer.Option(min=10)] = 400,
    builtin_corpus: Annotated[
        str, typer.Option(help="local (5 domains) or manpages (multilingual, in source order; docs/QUALITY.md)")
    ] = "local",
    eval_docs: Annotated[int | None, typer.Option(help="Held-out documents scored (default: all)")] = None,
    speed_steps: Annotated[int, typer.Option(min=1, help="Inner-loop speed: steps per repeat")] = 20,
    speed_reps: Annotated[int, typer.Option(min=1)] = 5,
    speed_only: Annotated[bool, typer.Option(help="Only the inner-loop tokens/s, then exit")] = False,
) -> None:
    started = time.monotonic()
    block_names, wanted = [b.strip() for b in blocks.split(",")], [m.strip() for m in models.split(",")]
    lr_grid, seed_list = _floats(lrs), _ints(seeds)
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = workdir / f"blocks-{stamp}.json"
    cfgs = {b: ModelConfig.from_dict({**flavour(flavour_name).to_dict(), "block": b}) for b in block_names}
    every = {b: standard_contenders(flavour_name, block=b, with_4x4=True) for b in block_names}
    contenders = {b: [c for c in candidates if c.name in wanted] for b, candidates in every.items()}
    known = {c.name for c in every[block_names[0]]}
    if unknown := [m for m in wanted if m not in known]:
        raise typer.BadParameter(f"unknown model(s) {unknown}; known: {sorted(known)}", param_hint="--models")
    params = {b: contenders[b][0].path_params() for b in block_names}
    widths = {b: c.mlp_hidden for b, c in cfgs.items()}
    console.print(f"flavour {flavour_name}: parameters per path {params}; MLP width {widths}")

    speed = inner_speed(cfgs, batch_size=batch_size, steps=speed_steps, reps=speed_reps)
    rounded = {b: round(v) for b, v in speed.items()}
    console.print(f"inner-loop tokens/s (1 thread, batch {batch_size}, {speed_reps} repeats, median): {rounded}")
    if speed_only:
        return

    corpus = workdir / ("corpus" if builtin_corpus == "local" else f"corpus-{builtin_corpus}")
    manifest = prepare_corpus(corpus, docs_per_domain=docs_per_domain, builtin=builtin_corpus)
    console.print(
        f"corpus ({builtin_corpus}): {manifest['splits']['train']['documents']} train / "
        f"{manifest['splits']['heldout']['documents']} held-out documents"
    )
    runs: list[dict[str, Any]] = []  # one row per (block, lr, seed, model)
    record: dict[str, Any] = {
        "flavour": flavour_name,
        "path_params": params,
        "mlp_hidden": widths,
        "inner_tokens_per_s": speed,
        "settings": {"rounds": rounds, "inner_steps": inner_steps, "batch_size": batch_size, "lrs": lr_grid},
        "runs": runs,
    }

    def train(service: LocalService, block: str, lr: float, seed: int) -> list[ModelResult]:
        settings = QualitySettings(
            rounds=rounds,
            inner_steps=inner_steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            max_islands=16,
            eval_every=rounds,  # score the initialisation and the last round only
            eval_docs=eval_docs,
        )
        console.print(f"[bold]{block}[/] lr {lr:g} seed {seed} ({time.monotonic() - started:.0f} s)")
        results = run_comparison(
            service, contenders[block], settings, corpus_dir=corpus, workdir=workdir, log=console.print
        )
        for r in results:
            runs.append(
                {
                    "block": block,
                    "lr": lr,
                    "seed": seed,
                    "model": r.name,
                    "ppl": r.final_ppl,
                    "val_ppl": val_ppl(r),
                    "test_ppl": r.final_test_ppl,
                    "train_s": r.train_s,
                    "tokens_per_s": r.tokens_per_path * r.num_paths / r.train_s,
                    "island_switches": r.island_switches,
                    "result": r.to_dict(),
                }
            )
        out.write_text(json.dumps(record, indent=2))
        return results

    service = LocalService(data_dir=workdir / f"coordinator-{stamp}", logs=workdir / f"logs-{stamp}")
    best: dict[str, float] = {}
    with service:
        # the lr search, blocks interleaved so that a change in the machine's load hits both alike
        for lr in lr_grid:
            for block in block_names:
                train(service, block, lr, seed_list[0])
        for block in block_names:
            rows = [r for r in runs if r["block"] == block]
            score = {lr: math.prod(r["val_ppl"] for r in rows if r["lr"] == lr) for lr in lr_grid}
            best[block] = min(lr_grid, key=lambda lr: score[lr])
        record["best_lr"] = best
        console.print(f"inner lr picked on the validation half: {best}")
        for seed in seed_list[1:]:
            for block in block_names:
                train(service, block, best[block], seed)

    search = Table(title=f"lr search, seed {seed_list[0]}: validation-half perplexity (all held-out)")
    search.add_column("block")
    search.add_column("model")
    for lr in lr_grid:
        search.add_column(f"lr {lr:g}", justify="right")
    for block in block_names:
        for name in wanted:
            cells = []
            for lr in lr_grid:
                row = next(
                    r for r in runs if (r["block"], r["model"], r["lr"], r["seed"]) == (block, name, lr, seed_list[0])
                )
                cells.append(f"{row['val_ppl']:.2f} ({row['ppl']:.2f})")
            search.add_row(block, name, *cells)
    console.print(search)

    final = [r for r in runs if r["lr"] == best[r["block"]]]
    table = Table(title=f"held-out perplexity at the picked lr, {len(seed_list)} seed(s), mean ± sd")
    for col in ("model", *[f"{b} (lr {best[b]:g})" for b in block_names], "ratio", "test half", "tokens/s end to end"):
        table.add_column(col, justify="right")
    summary: dict[str, Any] = {}
    for name in wanted:
        per = {b: [r for r in final if r["block"] == b and r["model"] == name] for b in block_names}
        means = {b: statistics.mean(r["ppl"] for r in per[b]) for b in block_names}
        ratio = means[block_names[-1]] / means[block_names[0]] if len(block_names) > 1 else 1.0
        summary[name] = {
            b: {
                "ppl": [r["ppl"] for r in per[b]],
                "test_ppl": [r["test_ppl"] for r in per[b]],
                "tokens_per_s": [r["tokens_per_s"] for r in per[b]],
            }
            for b in block_names
        } | {"ratio": ratio}
        table.add_row(
            name,
            *[_mean_sd([r["ppl"] for r in per[b]]) for b in block_names],
            f"{ratio:.3f}",
            " / ".join(_mean_sd([r["test_ppl"] for r in per[b]]) for b in block_names),
            " / ".join(f"{statistics.mean(r['tokens_per_s'] for r in per[b]):,.0f}" for b in block_names),
        )
    console.print(table)
    for b in block_names:
        dense = [r["ppl"] for r in final if r["block"] == b and r["model"] == "dense-S"]
        grid = [r["ppl"] for r in final if r["block"] == b and r["model"] == "DiPaCo 2x2"]
        if dense and grid:
            console.print(f"{b}: DiPaCo 2x2 / dense-S = {statistics.mean(grid) / statistics.mean(dense):.3f}")
    console.print(
        "inner-loop tokens/s, 1 thread: "
        + ", ".join(f"{b} {speed[b]:,.0f}" for b in block_names)
        + (f" (llama / gpt2 {speed['llama'] / speed['gpt2']:.3f})" if {"gpt2", "llama"} <= set(speed) else "")
    )
    record["summary"] = summary
    out.write_text(json.dumps(record, indent=2))
    console.print(f"numbers {out}\nwall time {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    typer.run(main)
