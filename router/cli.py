"""`dipaco router corpus|shard`: build a corpus, fit the router, write shards. Data only, no HTTP: the router
commands that talk to the coordinator (`register`, `refit`) live in `dipaco.router_commands` and join this group
in `dipaco.cli`."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, cast

import typer
from rich.console import Console
from rich.table import Table

from router.corpus import CorpusError, build_local_corpus
from router.manpages import build_manpages_corpus
from router.model_features import FeaturizerError, load_exported
from router.router import RouterError
from router.shards import ShardError, ShardOptions, shard_corpus
from router.sources import FORMATS, Format, build_corpus_from
from router.user_errors import user_errors

app = typer.Typer(
    help="Corpus and routing: build the local corpus, fit the router, write shards.", no_args_is_help=True
)


WIDE_COLUMNS = 200
"""Width when stdout is not a terminal and $COLUMNS does not say (the rule of `coordinator.cli_options.console`;
`router/` imports nothing from the coordinator): Rich's default of 80 would cut table cells."""


def _console() -> Console:
    out = Console()
    if out.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return out
    return Console(width=WIDE_COLUMNS)


ROUTER_ERRORS = (CorpusError, RouterError, ShardError, FeaturizerError)


def _user_errors() -> contextlib.AbstractContextManager[None]:
    return user_errors(_console(), *ROUTER_ERRORS)


@app.command()
def corpus(
    out: Annotated[Path, typer.Option(help="Output directory for train/heldout jsonl + manifest.")],
    max_docs_per_domain: Annotated[int, typer.Option(min=1, help="Documents read per domain.")] = 400,
    source: Annotated[
        Path | None,
        typer.Option(
            "--from",
            help="Your corpus: a directory of .txt/.md, a .jsonl file/dir or a parquet file/dir. "
            "Default: the built-in local corpus.",
        ),
    ] = None,
    fmt: Annotated[
        str | None, typer.Option("--format", help="txt, jsonl or parquet (default: from the file names).")
    ] = None,
    text_field: Annotated[str, typer.Option(help="JSON field / parquet column holding the text.")] = "text",
    domain_field: Annotated[
        str | None,
        typer.Option(
            help="JSON field / parquet column holding each document's domain (e.g. lang): the per-domain counts "
            "and the shards' purity. Default: a 'domain' field where present, else the file name."
        ),
    ] = None,
    heldout_fraction: Annotated[float, typer.Option(min=0.0, max=0.99, help="Share of held-out documents.")] = 0.1,
    builtin: Annotated[
        str,
        typer.Option(
            help="Without --from: 'local' (Python, C headers, man pages, licences, changelogs) or 'manpages' (the "
            "translated manual pages installed here, one language after the other: a multilingual corpus in "
            "source order; apt-get install manpages-de manpages-fr ... adds languages)."
        ),
    ] = "local",
    languages: Annotated[
        str | None,
        typer.Option(help="With --builtin manpages: comma-separated languages, e.g. de,fr,ru (default: all found)."),
    ] = None,
) -> None:
    """Build a corpus: a built-in one from text found on this machine, or yours with --from."""
    with _user_errors():
        if source is not None and (builtin != "local" or languages):
            raise CorpusError("--from builds your corpus; --builtin and --languages choose a built-in one: not both")
        if source is None and domain_field is not None:
            raise CorpusError("--domain-field names a field of your documents: use it with --from")
        if source is None and builtin == "manpages":
            manifest = build_manpages_corpus(
                out,
                languages=[x.strip() for x in languages.split(",") if x.strip()] if languages else None,
                heldout_fraction=heldout_fraction,
            )
        elif source is None:
            if builtin != "local":
                raise CorpusError(f"unknown built-in corpus {builtin!r}; use local or manpages")
            if languages:
                raise CorpusError("--languages is for --builtin manpages")
            manifest = build_local_corpus(
                out, max_docs_per_domain=max_docs_per_domain, heldout_fraction=heldout_fraction
            )
        else:
            if fmt is not None and fmt not in FORMATS:
                raise CorpusError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
            manifest = build_corpus_from(
                source,
                out,
                fmt=cast(Format | None, fmt),  # checked against FORMATS just above
                text_field=text_field,
                domain_field=domain_field,
                heldout_fraction=heldout_fraction,
            )
    table = Table(title=f"corpus in {out}")
    for column in ("domain", "train docs", "train bytes", "held-out docs", "held-out bytes", "skipped"):
        table.add_column(column, justify="left" if column in ("domain", "skipped") else "right")
    for name, entry in manifest["domains"].items():
        skipped = ", ".join(f"{k}={v}" for k, v in entry.get("skipped", {}).items()) or "-"
        table.add_row(
            name,
            str(entry["train"]["documents"]),
            f"{entry['train']['bytes']:,}",
            str(entry["heldout"]["documents"]),
            f"{entry['heldout']['bytes']:,}",
            skipped,
        )
    splits = manifest["splits"]
    total_skipped = ", ".join(f"{k}={v}" for k, v in manifest.get("skipped", {}).items())
    table.add_row(
        "total",
        str(splits["train"]["documents"]),
        f"{splits['train']['bytes']:,}",
        str(splits["heldout"]["documents"]),
        f"{splits['heldout']['bytes']:,}",
        total_skipped,
        style="bold",
    )
    console = _console()
    console.print(table)
    if manifest.get("without_domain_field"):
        console.print(
            f"[yellow]{manifest['without_domain_field']} document(s) have no {domain_field!r} field:[/yellow] "
            "their domain is their file's name"
        )
    if manifest["missing_domains"]:
        missing = ", ".join(manifest["missing_domains"])
        console.print(f"[yellow]domains with no files here:[/yellow] {missing}")


@app.command()
def shard(
    corpus: Annotated[Path, typer.Option(help="Corpus directory (from `corpus`).")],
    out: Annotated[Path, typer.Option(help="Output directory for shard files, router and manifest.")],
    paths: Annotated[int, typer.Option(min=1, help="Number of paths (k-means clusters).")],
    prefix_tokens: Annotated[int, typer.Option(min=1, help="Route by this many leading tokens.")] = 32,
    seed: Annotated[int, typer.Option(help="Seed for the SVD and k-means.")] = 0,
    levels: Annotated[
        str | None,
        typer.Option(help="Product k-means: clusters per routed level, e.g. 2,2 (their product must equal --paths)."),
    ] = None,
    balance: Annotated[bool, typer.Option(help="Keep every shard within the token-share bounds.")] = True,
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Least tokens per shard / fair share.")] = 0.5,
    max_share: Annotated[float, typer.Option(min=1.0, help="Most tokens per shard / fair share.")] = 2.0,
    heldout_docs_per_shard: Annotated[
        int,
        typer.Option(
            min=0, help="Hold out the last N documents of each path in path-XXXX.heldout.tokens (early stopping)."
        ),
    ] = 0,
    overlap_top2: Annotated[
        bool,
        typer.Option(
            "--overlap-top2", help="Training shards overlap: each document also goes to its second-best path."
        ),
    ] = False,
    tokenizer: Annotated[
        str, typer.Option(help="byte, or bpe (trained on the train split, saved as tokenizer.json).")
    ] = "byte",
    vocab_size: Annotated[int, typer.Option(min=257, max=65535, help="BPE vocabulary size.")] = 8192,
    shuffle: Annotated[
        bool,
        typer.Option(
            help="Write every shard in a seeded random order of its documents (--seed), so that any prefix of a "
            "shard is a fair sample of it whatever the corpus order; --no-shuffle keeps corpus order."
        ),
    ] = True,
    features_model: Annotated[
        Path | None,
        typer.Option(
            help="Route on a path model's hidden states instead of n-grams: a directory written by `dipaco export`."
        ),
    ] = None,
) -> None:
    """Fit the prefix router on the train split and write one token shard per path."""
    with _user_errors():
        featurizer = load_exported(features_model) if features_model is not None else None
        try:
            level_list = [int(x) for x in levels.split(",")] if levels else None
        except ValueError as exc:
            raise ShardError(f"--levels must be comma-separated integers, got {levels!r}") from exc
        options = ShardOptions(
            num_paths=paths,
            prefix_tokens=prefix_tokens,
            seed=seed,
            levels=level_list,
            balance=balance,
            min_share=min_share,
            max_share=max_share,
            heldout_docs_per_shard=heldout_docs_per_shard,
            overlap_top2=overlap_top2,
            tokenizer=tokenizer,
            vocab_size=vocab_size,
            shuffle=shuffle,
        )
        manifest = shard_corpus(corpus, out, options, featurizer=featurizer)
    table = Table(title=f"{paths} shards in {out}")
    for column in ("path", "docs", "tokens", "top domain"):
        table.add_column(column, justify="left" if column == "top domain" else "right")
    for s in manifest["shards"]:
        top, count = max(s["domains"].items(), key=lambda kv: (kv[1], kv[0]))
        table.add_row(
            str(s["path_index"]),
            str(s["num_documents"]),
            f"{s['num_tokens']:,}",
            f"{top} ({count / s['num_documents']:.0%})",
        )
    console = _console()
    console.print(table)
    console.print(
        f"purity {manifest['purity']:.3f} (random assignment of the same sizes: {manifest['purity_random']:.3f})"
    )
    shares = manifest["balance"]["token_shares"]
    note = "" if manifest["balance"]["satisfied"] or not balance else " [yellow](outside the bounds)[/yellow]"
    console.print(f"token share per shard / fair share: {min(shares):.2f} to {max(shares):.2f}{note}")
    order = manifest["order"]
    console.print(
        f"documents in a random order seeded by {order['seed']} in every shard"
        if order["shuffled"]
        else "documents in corpus order in every shard (--no-shuffle)"
    )
    if heldout_docs_per_shard:
        console.print(f"held out {heldout_docs_per_shard} documents per shard (path-XXXX.heldout.tokens)")
    if overlap_top2:
        console.print("training shards overlap: every document is also in its second-best path's shard")
    if "tokenizer" in manifest:
        console.print(
            f"BPE tokenizer: {manifest['tokenizer']['vocab_size']} tokens in "
            f"{out / manifest['tokenizer']['file']} (EOS = {manifest['eos']})"
        )
