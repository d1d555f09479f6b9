"""`dipaco router ...`: build the local corpus, fit the router, write shards, register them with a run."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Annotated, Any

import httpx
import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from router.corpus import CorpusError, build_local_corpus
from router.model_features import FeaturizerError, load_exported
from router.router import RouterError
from router.shards import ShardError, load_manifest, shard_corpus
from router.sources import FORMATS, build_corpus_from
from router.user_errors import user_errors

app = typer.Typer(help="Corpus and routing: build the local corpus, fit the router, write shards.",
                  no_args_is_help=True)

REQUEST_TIMEOUT_S = 60.0
"""One shard upload (tens of MB over a LAN at worst) must finish within this."""


class RegistrationError(RuntimeError):
    """The coordinator refused a shard, or answered with something that does not match the manifest."""


def _console() -> Console:
    return Console()


ROUTER_ERRORS = (CorpusError, RouterError, ShardError, RegistrationError, FeaturizerError)


def _user_errors() -> contextlib.AbstractContextManager[None]:
    return user_errors(_console(), *ROUTER_ERRORS)


@app.command()
def corpus(
    out: Annotated[Path, typer.Option(help="Output directory for train/heldout jsonl + manifest.")],
    max_docs_per_domain: Annotated[int, typer.Option(min=1, help="Documents read per domain.")] = 400,
    source: Annotated[Path | None, typer.Option(
        "--from", help="Your corpus: a directory of .txt/.md, a .jsonl file/dir or a parquet file/dir. "
        "Default: the built-in local corpus.")] = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", help="txt, jsonl or parquet (default: from the file names).")] = None,
    text_field: Annotated[str, typer.Option(help="JSON field / parquet column holding the text.")] = "text",
    heldout_fraction: Annotated[float, typer.Option(min=0.0, max=0.99, help="Share of held-out documents.")] = 0.1,
) -> None:
    """Build a corpus: the local multi-domain one from text found on this machine, or yours with --from."""
    with _user_errors():
        if source is None:
            manifest = build_local_corpus(out, max_docs_per_domain=max_docs_per_domain,
                                          heldout_fraction=heldout_fraction)
        else:
            if fmt is not None and fmt not in FORMATS:
                raise CorpusError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
            manifest = build_corpus_from(source, out, fmt=fmt, text_field=text_field,  # type: ignore[arg-type]
                                         heldout_fraction=heldout_fraction)
    table = Table(title=f"corpus in {out}")
    for column in ("domain", "train docs", "train bytes", "held-out docs", "held-out bytes", "skipped"):
        table.add_column(column, justify="left" if column in ("domain", "skipped") else "right")
    for name, entry in manifest["domains"].items():
        skipped = ", ".join(f"{k}={v}" for k, v in entry.get("skipped", {}).items()) or "-"
        table.add_row(name, str(entry["train"]["documents"]), f"{entry['train']['bytes']:,}",
                      str(entry["heldout"]["documents"]), f"{entry['heldout']['bytes']:,}", skipped)
    splits = manifest["splits"]
    total_skipped = ", ".join(f"{k}={v}" for k, v in manifest.get("skipped", {}).items())
    table.add_row("total", str(splits["train"]["documents"]), f"{splits['train']['bytes']:,}",
                  str(splits["heldout"]["documents"]), f"{splits['heldout']['bytes']:,}", total_skipped,
                  style="bold")
    console = _console()
    console.print(table)
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
    levels: Annotated[str | None, typer.Option(
        help="Product k-means: clusters per routed level, e.g. 2,2 (their product must equal --paths).")] = None,
    balance: Annotated[bool, typer.Option(help="Keep every shard within the token-share bounds.")] = True,
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Least tokens per shard / fair share.")] = 0.5,
    max_share: Annotated[float, typer.Option(min=1.0, help="Most tokens per shard / fair share.")] = 2.0,
    heldout_docs_per_shard: Annotated[int, typer.Option(
        min=0, help="Hold out the last N documents of each path in path-XXXX.heldout.tokens (early stopping).")]
    = 0,
    overlap_top2: Annotated[bool, typer.Option(
        "--overlap-top2", help="Training shards overlap: each document also goes to its second-best path.")]
    = False,
    tokenizer: Annotated[str, typer.Option(
        help="byte, or bpe (trained on the train split, saved as tokenizer.json).")] = "byte",
    vocab_size: Annotated[int, typer.Option(min=257, max=65535, help="BPE vocabulary size.")] = 8192,
    features_model: Annotated[Path | None, typer.Option(
        help="Route on a path model's hidden states instead of n-grams: a directory written by `dipaco export`."
    )] = None,
) -> None:
    """Fit the prefix router on the train split and write one token shard per path."""
    with _user_errors():
        featurizer = load_exported(features_model) if features_model is not None else None
        try:
            level_list = [int(x) for x in levels.split(",")] if levels else None
        except ValueError as exc:
            raise ShardError(f"--levels must be comma-separated integers, got {levels!r}") from exc
        manifest = shard_corpus(corpus, out, num_paths=paths, prefix_tokens=prefix_tokens, seed=seed,
                                levels=level_list, balance=balance, min_share=min_share, max_share=max_share,
                                heldout_docs_per_shard=heldout_docs_per_shard, overlap_top2=overlap_top2,
                                tokenizer=tokenizer, vocab_size=vocab_size, featurizer=featurizer)
    table = Table(title=f"{paths} shards in {out}")
    for column in ("path", "docs", "tokens", "top domain"):
        table.add_column(column, justify="left" if column == "top domain" else "right")
    for s in manifest["shards"]:
        top, count = max(s["domains"].items(), key=lambda kv: (kv[1], kv[0]))
        table.add_row(str(s["path_index"]), str(s["num_documents"]), f"{s['num_tokens']:,}",
                      f"{top} ({count / s['num_documents']:.0%})")
    console = _console()
    console.print(table)
    console.print(f"purity {manifest['purity']:.3f} (random assignment of the same sizes: "
                  f"{manifest['purity_random']:.3f})")
    shares = manifest["balance"]["token_shares"]
    note = "" if manifest["balance"]["satisfied"] or not balance else " [yellow](outside the bounds)[/yellow]"
    console.print(f"token share per shard / fair share: {min(shares):.2f} to {max(shares):.2f}{note}")
    if heldout_docs_per_shard:
        console.print(f"held out {heldout_docs_per_shard} documents per shard (path-XXXX.heldout.tokens)")
    if overlap_top2:
        console.print("training shards overlap: every document is also in its second-best path's shard")
    if "tokenizer" in manifest:
        console.print(f"BPE tokenizer: {manifest['tokenizer']['vocab_size']} tokens in "
                      f"{out / manifest['tokenizer']['file']} (EOS = {manifest['eos']})")


def register_shards(shards_dir: Path, *, client: httpx.Client, run_id: int) -> list[dict[str, Any]]:
    """Upload every shard of `shards_dir` to run `run_id`; returns the coordinator's shard records.

    The client carries the base URL and the admin `Authorization` header. Files are verified against the
    manifest first and streamed from disk.
    """
    manifest = load_manifest(shards_dir)
    registered: list[dict[str, Any]] = []
    for shard in manifest["shards"]:
        index = shard["path_index"]
        with open(shards_dir / shard["file"], "rb") as body:
            response = client.post(
                f"/v1/runs/{run_id}/shards/{index}",
                params={"num_documents": shard["num_documents"]},
                content=body,
                headers={"Content-Type": "application/octet-stream"},
            )
        if not response.is_success:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise RegistrationError(f"shard {index} of run {run_id}: HTTP {response.status_code}: {detail}")
        record: dict[str, Any] = response.json()
        if record.get("tokens_hash") != shard["sha256"]:
            raise RegistrationError(
                f"shard {index} of run {run_id}: coordinator stored tokens_hash {record.get('tokens_hash')}, "
                f"manifest says {shard['sha256']}"
            )
        registered.append(record)
    return registered


@app.command()
def register(
    shards: Annotated[Path, typer.Option(help="Shard directory (from `shard`).")],
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id to attach the shards to.")],
    token: Annotated[str, typer.Option(envvar="DIPACO_ADMIN_TOKEN", help="Admin bearer token.")] = "",
) -> None:
    """Upload the shards to a run on the coordinator (one POST per path)."""
    token = token or os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        _console().print("[red]error:[/red] no admin token: pass --token or set DIPACO_ADMIN_TOKEN")
        raise typer.Exit(code=1)
    headers = {"Authorization": f"Bearer {token}"}
    with _user_errors():
        try:
            with httpx.Client(base_url=coordinator, headers=headers,
                              timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
                records = register_shards(shards, client=client, run_id=run)
        except httpx.HTTPError as exc:
            raise RegistrationError(f"cannot reach coordinator at {coordinator}: {exc}") from exc
    table = Table(title=f"shards of run {run}")
    for column in ("path", "shard id", "tokens", "documents"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(str(r["path_index"]), str(r["id"]), f"{r['num_tokens']:,}", str(r["num_documents"]))
    _console().print(table)


@app.command()
def refit(
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id whose paths score the documents (current module versions).")],
    router: Annotated[Path, typer.Option(help="Base router directory, or the shard directory holding router/.")],
    corpus: Annotated[Path, typer.Option(help="Corpus directory (from `corpus`).")],
    out: Annotated[Path, typer.Option(help="Directory for the refit router (router.json + safetensors).")],
    split: Annotated[str, typer.Option(help="Router-held-out documents: reads SPLIT.jsonl in the corpus.")]
    = "heldout",
    token: Annotated[str, typer.Option(envvar="DIPACO_TOKEN", help="Any valid bearer token.")] = "",
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Least routed share / target share.")] = 0.5,
    max_share: Annotated[float, typer.Option(min=1.0, help="Most routed share / target share.")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of the logistic regression.")] = 0,
    shards_out: Annotated[Path | None, typer.Option(
        help="Also re-shard the train split with the refit router into this directory.")] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 256,
) -> None:
    """Discriminative re-routing (§2.4.2): score the held-out documents under every path of the run, label each
    with its best path, fit a linear router to the labels with balanced shares, save it."""
    from router import eval_cli
    from router.refit import refit_report, refit_router, score_all_paths

    console = _console()
    token = token or os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        console.print("[red]error:[/red] no token: pass --token or set DIPACO_TOKEN")
        raise typer.Exit(code=1)
    with user_errors(console, *ROUTER_ERRORS, *eval_cli.EVAL_ERRORS):
        base = eval_cli.load_router(router)
        documents = eval_cli.load_documents(corpus, split)
        with eval_cli._client(coordinator, token) as client:
            run_paths = eval_cli.fetch_run_paths(client, run)
            if run_paths.num_paths != base.num_paths:
                raise eval_cli.EvalError(f"the router has {base.num_paths} paths, run {run} has "
                                         f"{run_paths.num_paths}")
            losses = score_all_paths(run_paths.build, documents, num_paths=run_paths.num_paths,
                                     prefix_tokens=base.prefix_tokens, context=run_paths.config.seq_len,
                                     batch_size=batch_size)
        new = refit_router(losses, documents, base, min_share=min_share, max_share=max_share, seed=seed)
        new.save(out)
        scored = [max(0, len(d.encode("utf-8")) + 1 - base.prefix_tokens) for d in documents]
        report = refit_report(losses, documents, base, new, weights=np.asarray(scored, dtype=np.float64))
        manifest = None
        if shards_out is not None:
            manifest = shard_corpus(corpus, shards_out, num_paths=base.num_paths, prefix_tokens=base.prefix_tokens,
                                    router=new, seed=seed)
    table = Table(title=f"refit router of run {run} in {out}: {report.documents} {split} documents")
    for column in ("path", "best here", "base route", "refit route"):
        table.add_column(column, justify="right")
    for p in range(base.num_paths):
        table.add_row(str(p), str(report.label_histogram[p]), str(report.base_histogram[p]),
                      str(report.new_histogram[p]))
    console.print(table)
    console.print(f"{report.changed} of {report.documents} documents change path")
    console.print(f"routed {split} perplexity: base {report.base_perplexity:.3f} -> refit "
                  f"{report.new_perplexity:.3f} (every document on its best path: {report.oracle_perplexity:.3f}; "
                  "measured on the documents the refit was fitted on)")
    if manifest is not None:
        shares = manifest["balance"]["token_shares"]
        console.print(f"re-sharded the train split into {shards_out}: moved "
                      f"{manifest['balance']['moved_documents']} documents while balancing, token share per "
                      f"shard / fair share {min(shares):.2f} to {max(shares):.2f}, purity {manifest['purity']:.3f}")
