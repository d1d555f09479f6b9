"""The `dipaco router` commands that talk to the coordinator, composed into the router group by `dipaco.cli`
(`router/` is data only: corpora in, shards out, no HTTP):

* `register`: upload the shards of a shard directory to a run (one `POST /v1/runs/{id}/shards/{path}` each,
  streamed from disk), checking that the coordinator stored what the manifest says;
* `refit`: discriminative re-routing (DiPaCo §2.4.2): score held-out documents under every path of a run, label
  each with its best path, fit a linear router to the labels with balanced shares, save it.

Both follow the tokenizer the shards were cut with: `refit` scores with the `tokenizer.json` found with the router
(as `dipaco eval`), copies it next to the refit router (so `dipaco eval --router OUT` finds it) and re-shards
with it. Held-out slices (`--heldout-docs-per-shard`) are uploaded after each path's shard when the run keeps
them (its `heldout_tokens` > 0): the islands then report each round's held-out loss per path. When it keeps none,
`register` says so instead of dropping them silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from coordinator.cli_options import AdminTokenOpt, CaFileOpt, ReadTokenOpt, console, resolve_token
from coordinator.client import ClientError, CoordinatorClient
from coordinator.schemas import RunPublic, ShardPublic
from coordinator.states import RunStatus
from dipaco.commands import connect
from dipaco.evaluation import (
    EVAL_ERRORS,
    EvalError,
    check_vocab,
    fetch_run_paths,
    find_tokenizer,
    load_documents,
    load_router,
)
from dipaco.progress import Progress
from router.bpe import TOKENIZER_FILE
from router.corpus import CorpusError
from router.refit import refit_report, refit_router, score_all_paths
from router.router import RouterError
from router.shards import ShardError, ShardOptions, load_manifest, shard_corpus
from router.user_errors import user_errors


class RegistrationError(RuntimeError):
    """The coordinator stored a shard that does not match the manifest."""


def register_shards(
    shards_dir: Path, *, client: CoordinatorClient, run_id: int, manifest: dict[str, Any] | None = None
) -> list[ShardPublic]:
    """Upload every shard of `shards_dir` to run `run_id` (admin client), each followed by its held-out slice when
    the manifest has one and the run keeps them (`heldout_tokens` > 0); returns the coordinator's records (the
    last one of each path).

    The files are verified against the manifest first (`load_manifest`, unless the caller passes the manifest it
    loaded) and streamed from disk; what the coordinator stored is checked against the manifest's sha256."""
    manifest = load_manifest(shards_dir) if manifest is None else manifest
    run = client.run(run_id)
    keeps = bool(run.config.get("heldout_tokens", 0))
    window = run.config["model"]["seq_len"] + 1  # a slice shorter than one scoring window is not sent
    registered: list[ShardPublic] = []
    for shard in manifest["shards"]:
        index = shard["path_index"]
        record = client.register_shard(run_id, index, shards_dir / shard["file"], num_documents=shard["num_documents"])
        if record.tokens_hash != shard["sha256"]:
            raise RegistrationError(
                f"shard {index} of run {run_id}: coordinator stored tokens_hash {record.tokens_hash}, "
                f"manifest says {shard['sha256']}"
            )
        held = shard.get("heldout")
        if keeps and held is not None and held["num_tokens"] >= window:
            record = client.register_heldout(
                run_id, index, shards_dir / held["file"], num_documents=max(1, held["num_documents"])
            )
            if record.heldout_hash != held["sha256"]:
                raise RegistrationError(
                    f"held-out slice {index} of run {run_id}: coordinator stored {record.heldout_hash}, "
                    f"manifest says {held['sha256']}"
                )
        registered.append(record)
    return registered


def register_command(
    ctx: typer.Context,
    shards: Annotated[Path, typer.Option(help="Shard directory (from `shard`).")],
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id to attach the shards to.")],
    token: AdminTokenOpt = "",
    ca_file: CaFileOpt = None,
) -> None:
    """Upload the shards to a run on the coordinator (one POST per path); the last one starts the run."""
    out = console()
    token = resolve_token(token, admin=True)
    with (
        user_errors(out, ShardError, RegistrationError, ClientError),
        connect(ctx, coordinator, token, ca_file) as client,
    ):
        manifest = load_manifest(shards)  # hashes every file: once
        records = register_shards(shards, client=client, run_id=run, manifest=manifest)
        state = client.run(run)
    table = Table(title=f"shards of run {run}")
    for column in ("path", "shard id", "tokens", "documents"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(str(r.path_index), str(r.id), f"{r.num_tokens:,}", str(r.num_documents))
    out.print(table)
    out.print(run_state(state), highlight=False)
    note = heldout_note(manifest, shards, records, state)
    if note:
        out.print(note, highlight=False)


def heldout_note(manifest: dict[str, object], shards_dir: Path, records: list[ShardPublic], run: RunPublic) -> str:
    """What `register` did with the per-shard held-out slices, in a sentence ("" when the shards have none)."""
    held = manifest.get("heldout_docs_per_shard")
    if not held:
        return ""
    uploaded = sum(r.heldout_hash is not None for r in records)
    if uploaded:
        return (
            f"held-out slices uploaded for {uploaded} of {len(records)} paths ({held} documents per shard): each "
            f"lease's island reports its start weights' loss on up to {run.config.get('heldout_tokens')} of their "
            f"tokens (`/v1/runs/{run.id}/history`, the dashboard)"
        )
    return (
        f"not uploaded: the held-out slices ({held} documents per shard, path-XXXX.heldout.tokens) stay in "
        f"{shards_dir}: run {run.id} keeps none (created with heldout_tokens 0); score them locally "
        "(`dipaco eval`, `bench/quality.py`)"
    )


def run_state(run: RunPublic) -> str:
    """What registering shards left the run doing, in a sentence."""
    if run.status == RunStatus.RUNNING:
        return (
            f"run {run.id} {run.name!r} is running: round {run.current_round} of {run.num_rounds} is open; "
            "islands that join get its paths"
        )
    if run.status == RunStatus.WAITING_FOR_SHARDS:
        return f"run {run.id} {run.name!r} still waits for shards: every one of its {run.num_paths} paths needs one"
    return f"run {run.id} {run.name!r} is {run.status}"


def refit_command(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id whose paths score the documents (current module versions).")],
    router: Annotated[Path, typer.Option(help="Base router directory, or the shard directory holding router/.")],
    corpus: Annotated[Path, typer.Option(help="Corpus directory (from `corpus`).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Directory for the refit router (router.json + safetensors).")],
    split: Annotated[str, typer.Option(help="Router-held-out documents: reads SPLIT.jsonl in the corpus.")] = "heldout",
    token: ReadTokenOpt = "",
    ca_file: CaFileOpt = None,
    min_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Least routed share / target share.")] = 0.5,
    max_share: Annotated[float, typer.Option(min=1.0, help="Most routed share / target share.")] = 2.0,
    seed: Annotated[int, typer.Option(help="Seed of the logistic regression.")] = 0,
    shards_out: Annotated[
        Path | None, typer.Option(help="Also re-shard the train split with the refit router into this directory.")
    ] = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 256,
) -> None:
    """Discriminative re-routing (§2.4.2): score the held-out documents under every path of the run, label each
    with its best path, fit a linear router to the labels with balanced shares, save it."""
    out = console()
    token = resolve_token(token)
    with user_errors(out, CorpusError, RouterError, ShardError, *EVAL_ERRORS):
        base = load_router(router)
        tokenizer = find_tokenizer(router)
        documents = load_documents(corpus, split)
        progress = Progress("refit")
        progress.update(f"scoring {len(documents):,} {split} documents under every path of run {run}", force=True)
        with connect(ctx, coordinator, token, ca_file) as client:
            run_paths = fetch_run_paths(client, run, on_fetch=progress.fetched)
            if run_paths.num_paths != base.num_paths:
                raise EvalError(f"the router has {base.num_paths} paths, run {run} has {run_paths.num_paths}")
            check_vocab(tokenizer, run_paths.config, run_id=run)
            losses = score_all_paths(
                progress.watch_paths(run_paths.build, num_paths=run_paths.num_paths),
                documents,
                num_paths=run_paths.num_paths,
                prefix_tokens=base.prefix_tokens,
                context=run_paths.config.seq_len,
                batch_size=batch_size,
                tokenizer=tokenizer,
            )
        progress.update("fitting the router to each document's best path", force=True)
        new = refit_router(losses, documents, base, min_share=min_share, max_share=max_share, seed=seed)
        new.save(out_dir)
        if tokenizer is not None:  # `dipaco eval --router OUT` then scores with the same tokens
            tokenizer.save(out_dir / TOKENIZER_FILE)
        lengths = [len(tokenizer.encode(d)) if tokenizer is not None else len(d.encode("utf-8")) for d in documents]
        scored = [max(0, n + 1 - base.prefix_tokens) for n in lengths]
        report = refit_report(losses, documents, base, new, weights=np.asarray(scored, dtype=np.float64))
        manifest = None
        if shards_out is not None:
            progress.update(f"re-sharding the train split into {shards_out}", force=True)
            options = ShardOptions(num_paths=base.num_paths, prefix_tokens=base.prefix_tokens, seed=seed)
            manifest = shard_corpus(corpus, shards_out, options, router=new, tokenizer=tokenizer)
    table = Table(title=f"refit router of run {run} in {out_dir}: {report.documents} {split} documents")
    for column in ("path", "best here", "base route", "refit route"):
        table.add_column(column, justify="right")
    for p in range(base.num_paths):
        table.add_row(
            str(p), str(report.label_histogram[p]), str(report.base_histogram[p]), str(report.new_histogram[p])
        )
    out.print(table)
    out.print(f"{report.changed} of {report.documents} documents change path")
    out.print(
        f"routed {split} perplexity: base {report.base_perplexity:.3f} -> refit {report.new_perplexity:.3f} "
        f"(every document on its best path: {report.oracle_perplexity:.3f}; measured on the documents the refit "
        "was fitted on)"
    )
    if manifest is not None:
        shares = manifest["balance"]["token_shares"]
        out.print(
            f"re-sharded the train split into {shards_out}: moved {manifest['balance']['moved_documents']} "
            f"documents while balancing, token share per shard / fair share {min(shares):.2f} to "
            f"{max(shares):.2f}, purity {manifest['purity']:.3f}"
        )
        out.print(
            f"next: create a run like run {run}, register these shards with it (`dipaco router register --shards "
            f"{shards_out} --run NEW_ID ...`), train it, and evaluate it with `--router {out_dir}`",
            highlight=False,
        )
    else:
        out.print(
            f"next: `--shards-out DIR` re-shards the train split with this router for a new run; `dipaco eval "
            f"--router {out_dir}` routes an evaluation with it",
            highlight=False,
        )
