"""`dipaco demo`: the whole system on one machine, for real.

A coordinator (SQLite + local blob directory) runs as a subprocess; the built-in corpus is assembled and
routed into one shard per path; a 2x2 run is created; islands join as subprocesses over HTTP and train until
the run finishes. The demo prints per-round train loss per path and the module versions. Unless `--no-compare`,
it then trains dense-S, a flat 4-expert layout and a 2x-wide dense model the same way (same steps per path) and
shows held-out routed perplexity per round for all four (table + PNG plot, `dipaco.quality`). It stops
everything and says where the database, blobs and plot were left.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from coordinator.cli_options import console as cli_console
from coordinator.client import CoordinatorClient
from coordinator.schemas import RunPublic
from coordinator.states import RunStatus
from dipaco.service import LocalService
from router.shards import load_manifest

if TYPE_CHECKING:
    from dipaco.quality import Contender, QualitySettings

console = cli_console()
MARKER = ".dipaco-demo"


def _prepare_workdir(workdir: Path) -> None:
    if workdir.exists():
        if not (workdir / MARKER).exists():
            raise typer.BadParameter(f"{workdir} exists and was not made by `dipaco demo`; pick another --workdir")
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    (workdir / MARKER).write_text("made by dipaco demo; removed and rebuilt by the next demo run\n")


def demo(
    workdir: Annotated[Path, typer.Option(help="Everything the demo writes goes here (rebuilt each run)")] = Path(
        "dipaco-demo"
    ),
    rounds: Annotated[int, typer.Option(min=1, help="Outer rounds")] = 5,
    inner_steps: Annotated[int, typer.Option(min=1, help="H: inner AdamW steps per round")] = 30,
    islands: Annotated[int, typer.Option(min=1, help="Island subprocesses (one per path keeps AdamW state)")] = 4,
    flavour: Annotated[str, typer.Option(help="Model flavour: debug, small")] = "debug",
    block: Annotated[str | None, typer.Option(help="Transformer block: gpt2 or llama (default: the flavour's)")] = None,
    batch_size: Annotated[int, typer.Option(min=1)] = 16,
    docs_per_domain: Annotated[int, typer.Option(min=10, help="Corpus size")] = 300,
    corpus_dir: Annotated[
        Path | None,
        typer.Option(
            "--corpus",
            help="Train and compare on your corpus: a directory from `dipaco router corpus` (default: the built-in "
            "local corpus, built in the work directory)",
        ),
    ] = None,
    tokenizer: Annotated[
        str, typer.Option(help="Shard tokens: byte, or bpe (trained on the corpus; every model uses it)")
    ] = "byte",
    vocab_size: Annotated[int, typer.Option(min=257, max=65535, help="BPE vocabulary (with --tokenizer bpe)")] = 8192,
    compare: Annotated[
        bool,
        typer.Option(
            help="End with the quality comparison: dense-S, flat 4 and a 2x-wide dense trained like the 2x2 run, "
            "held-out perplexity per round, table + PNG plot"
        ),
    ] = True,
    cross_check: Annotated[
        bool, typer.Option(help="With --compare: re-train dense-S in-process (modules.simulate) and compare")
    ] = True,
    eval_docs: Annotated[int, typer.Option(min=2, help="Held-out documents scored per round (stable subsample)")] = 48,
    keep_serving: Annotated[
        bool, typer.Option(help="At the end, leave the coordinator (and its dashboard) up until Ctrl-C")
    ] = False,
) -> None:
    """Run everything on this machine: coordinator, corpus, router, a 2x2 run and island subprocesses; then
    compare held-out perplexity against dense baselines and a flat 4-expert layout."""
    from dipaco.quality import (
        QualitySettings,
        corpus_tokenizer,
        prepare_corpus,
        run_spec,
        shards_for,
        standard_contenders,
    )
    from router.corpus import CorpusError, load_corpus_manifest

    started = time.monotonic()
    workdir = workdir.resolve()
    if corpus_dir is not None and corpus_dir.resolve().is_relative_to(workdir):
        raise typer.BadParameter(f"--corpus {corpus_dir} is inside --workdir {workdir}, which the demo rebuilds")
    try:
        settings = QualitySettings(
            rounds=rounds,
            inner_steps=inner_steps,
            batch_size=batch_size,
            max_islands=islands,
            eval_docs=eval_docs,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
        )
        user_manifest = dict(load_corpus_manifest(corpus_dir.resolve())) if corpus_dir is not None else None
    except (ValueError, CorpusError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    _prepare_workdir(workdir)
    logs = workdir / "logs"
    logs.mkdir()
    steps = 6 if compare else 5
    console.rule("[bold]dipaco demo")
    # SIGTERM ends the demo like Ctrl-C: the `finally` below stops the coordinator and the islands.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if corpus_dir is None:
        corpus = workdir / "corpus"
        console.print(
            f"[bold]1/{steps}[/] building the local corpus (Python, C headers, man pages, licences, changelogs)"
        )
        manifest = prepare_corpus(corpus, docs_per_domain=docs_per_domain)
    else:
        corpus = corpus_dir.resolve()
        console.print(f"[bold]1/{steps}[/] using your corpus in {corpus}")
        assert user_manifest is not None
        manifest = user_manifest
    console.print(
        f"    {manifest['splits']['train']['documents']} train documents in {len(manifest['domains'])} domains, "
        f"{manifest['splits']['heldout']['documents']} held-out"
    )
    tok = corpus_tokenizer(corpus, workdir, settings)
    if tok is not None:
        console.print(f"    BPE tokenizer of {tok.vocab_size} tokens trained on the train split")
    contenders = standard_contenders(flavour, block=block, vocab_size=tok.vocab_size if tok is not None else None)
    grid = next(c for c in contenders if c.name == "DiPaCo 2x2")

    console.print(
        f"[bold]2/{steps}[/] routing documents by their first 32 tokens into 4 shards (k-means), each written in "
        "a seeded random order"
    )
    shards_dir = shards_for(corpus, workdir, grid.levels, settings)
    shards = load_manifest(shards_dir)
    console.print(
        f"    shard purity by domain {shards['purity']:.2f} (random assignment {shards['purity_random']:.2f})"
    )

    service = LocalService(data_dir=workdir / "coordinator", logs=logs)
    coord_dir = service.data_dir
    console.print(f"[bold]3/{steps}[/] starting the coordinator on {service.url} (SQLite + blobs in {coord_dir})")
    ok = False
    try:
        service.start()
        console.print(
            f"    dashboard: {service.dashboard_url} (it asks for a token: the admin_token in {service.token_file})"
        )
        client = service.client
        run = service.create_run(run_spec(grid, settings, name="demo-2x2"))
        console.print(
            f"    run {run.id} '{run.name}': layout {run.layout}, {run.num_paths} paths, "
            f"{rounds} rounds x H={inner_steps}"
        )
        from dipaco.router_commands import register_shards

        console.print(
            f"[bold]4/{steps}[/] starting {islands} island(s) as subprocesses; the shards are registered "
            "once all have joined (each island then keeps one path)"
        )
        names = service.start_islands(islands, prefix="island", cache_root=workdir)
        service.wait_islands_joined(names)
        register_shards(shards_dir, client=client, run_id=run.id)
        losses = _watch(service, run.id)

        console.print(f"[bold]5/{steps}[/] done; stopping the islands")
        service.stop_islands()
        _report(client, run.id, losses)
        if compare:
            console.print(
                f"[bold]6/{steps}[/] quality: dense-S, flat 4 and a 2x-wide dense, same steps per path, "
                "held-out perplexity per round"
            )
            _compare(
                service,
                workdir,
                corpus,
                settings,
                contenders,
                demo_run=run.id,
                reuse=islands >= grid.num_paths,
                cross_check=cross_check,
            )
        ok = True
        if keep_serving:
            console.print(
                f"[bold]the coordinator stays up:[/] dashboard {service.dashboard_url} (admin_token in "
                f"{service.token_file}), registry {service.url}; Ctrl-C stops it"
            )
            service.serve_until_interrupted()
    finally:
        service.stop()
        if not ok:
            for name, text in service.log_tails().items():
                console.print(f"[red]--- last lines of {name}'s log ({logs / (name + '.log')}) ---[/]")
                console.print(text, markup=False)
    console.print(f"database: {coord_dir / 'dipaco.db'}")
    console.print(f"blobs:    {coord_dir / 'blobs'}")
    console.print(f"tokens:   {service.token_file}")
    console.print(f"logs:     {logs}")
    console.print(_again_hint(service), soft_wrap=True, highlight=False, markup=False)
    (workdir / "summary.json").write_text(json.dumps({"run_id": run.id, "losses": losses}, indent=2))
    console.print(f"finished in {time.monotonic() - started:.0f} s")


def _shown(path: Path) -> str:
    """`path` for a command line: relative to the current directory when inside it, shell-quoted."""
    try:
        shown = str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        shown = str(path)
    return shlex.quote(shown)


def dipaco_command() -> str:
    """How to run this `dipaco` again from the current directory: `dipaco` when the one on PATH is this one, else
    its path (e.g. `.venv/bin/dipaco` after `make demo`, which puts nothing on PATH)."""
    exe = Path(sys.prefix) / "bin" / "dipaco"
    if not exe.is_file():
        return f"{shlex.quote(sys.executable)} -m dipaco"
    on_path = shutil.which("dipaco")
    if on_path is not None and os.path.samefile(on_path, exe):
        return "dipaco"
    return _shown(exe)


def _again_hint(service: LocalService) -> str:
    """The closing lines: commands to copy that bring the registry and the dashboard back; no token in them."""
    dipaco, data, tokens = dipaco_command(), _shown(service.data_dir), _shown(service.token_file)
    return "\n".join(
        [
            f"To look at the registry again (the tokens are in {tokens}):",
            f'  eval "$({dipaco} coordinator tokens --data-dir {data} --export)"',
            f"  {dipaco} coordinator serve --data-dir {data} --port {service.port} &",
            f"  {dipaco} registry modules --coordinator {service.url}",
            f"  and the dashboard: {service.dashboard_url} (it asks for the admin_token in {tokens})",
        ]
    )


def _compare(
    service: LocalService,
    workdir: Path,
    corpus: Path,
    settings: QualitySettings,
    contenders: list[Contender],
    *,
    demo_run: int,
    reuse: bool,
    cross_check: bool,
) -> None:
    from dipaco import quality_report as qr
    from dipaco.quality import cross_check as run_cross_check
    from dipaco.quality import run_comparison

    existing = {"DiPaCo 2x2": demo_run} if reuse else {}
    results = run_comparison(
        service,
        contenders,
        settings,
        corpus_dir=corpus,
        workdir=workdir,
        existing=existing,
        log=console.print,
    )
    console.print(qr.rounds_table(results))
    console.print(
        qr.comparison_table(
            results,
            title=f"held-out routed perplexity after {settings.rounds} rounds "
            f"x H={settings.inner_steps} (quick setting)",
        )
    )
    flags = qr.sanity_flags(results)
    if flags:
        console.print(qr.flags_table(flags))
    console.print(qr.targets_table(qr.targets(results)))
    console.print("    (quick setting: the targets are judged by `python bench/quality.py`, see docs/QUALITY.md)")
    if cross_check:
        dense = next(c for c in contenders if c.name == qr.DENSE_S)
        check = run_cross_check(
            qr.find(results, qr.DENSE_S) or results[0], dense, settings, corpus_dir=corpus, workdir=workdir
        )
        console.print(qr.cross_check_table([check]))
    png = qr.plot(
        results,
        workdir / "quality.png",
        title=f"held-out perplexity, {settings.rounds} rounds x H={settings.inner_steps}",
    )
    (workdir / "quality.json").write_text(json.dumps([r.to_dict() for r in results], indent=2))
    console.print(f"plot:     {png}")
    console.print(f"numbers:  {workdir / 'quality.json'}")


def _watch(service: LocalService, run_id: int) -> dict[int, dict[int, float]]:
    """Print each round as it is applied; returns {round: {path: train loss}}."""
    from dipaco.quality import train_losses

    printed = 0
    losses: dict[int, dict[int, float]] = {}

    def on_poll(run: RunPublic) -> None:
        nonlocal printed, losses
        if printed >= run.current_round and run.status != RunStatus.FINISHED:
            return
        losses = train_losses(service.client, run_id)
        while printed < run.current_round:
            row = losses.get(printed, {})
            cells = "  ".join(f"path {p}: {row[p]:.3f}" for p in sorted(row))
            console.print(f"    round {printed}: {cells}")
            printed += 1

    service.wait_finished(run_id, on_poll=on_poll)
    return losses


def _report(client: CoordinatorClient, run_id: int, losses: dict[int, dict[int, float]]) -> None:
    table = Table(title="mean inner train loss per round (nats/token)")
    paths = sorted({p for row in losses.values() for p in row})
    table.add_column("round")
    for p in paths:
        table.add_column(f"path {p}")
    for rnd in sorted(losses):
        table.add_row(str(rnd), *(f"{losses[rnd].get(p, float('nan')):.3f}" for p in paths))
    console.print(table)
    mt = Table(title="modules")
    for col in ("id", "level", "level_name", "index", "sharing", "version", "params", "weights"):
        mt.add_column(col)
    for m in client.modules(run_id=run_id):
        mt.add_row(
            str(m.id),
            str(m.level),
            m.level_name,
            str(m.index),
            m.sharing,
            str(m.version),
            str(m.num_params),
            m.weights_hash[:12],
        )
    console.print(mt)
    first, last = min(losses), max(losses)
    mean = lambda row: sum(row.values()) / len(row)  # noqa: E731
    console.print(f"train loss: round {first} {mean(losses[first]):.3f} -> round {last} {mean(losses[last]):.3f}")
