"""`dipaco eval`: routed held-out perplexity of a run's paths, fetched from the coordinator.

`fetch_run_paths` reads, through the one client (`coordinator.client.CoordinatorClient`), the run's model config,
its paths and the current module versions; module weights are downloaded when a path needs them (cached in
memory by content hash, so a module shared by every path is downloaded once, and checked against that hash).
Each path is built with `modules.build_path` only when a document is routed to it, and evaluated by
`router.evaluate.evaluate_routed` (see there for exactly which tokens are scored). `dipaco export`, `generate`,
`router refit` and the quality driver read runs the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.table import Table

from coordinator.cli_options import CaFileOpt, ReadTokenOpt, console, resolve_token
from coordinator.client import ClientError, CoordinatorClient
from coordinator.schemas import ModulePublic, RunPublic
from dipaco.commands import connect
from dipaco.progress import Progress
from modules import CodecError, ModelConfig, build_path, decode
from modules.model import PathModel
from router.bpe import TOKENIZER_FILE, BPETokenizer
from router.corpus import CorpusError, iter_jsonl
from router.evaluate import EvalResult, evaluate_routed
from router.router import Router, RouterError
from router.tokenizer import ByteTokenizer
from router.user_errors import user_errors


class EvalError(RuntimeError):
    """The run, its weights, the router or the corpus cannot be used for evaluation."""


EVAL_ERRORS = (EvalError, RouterError, CorpusError, ClientError, ValueError)
"""What `dipaco eval` (and the commands built like it) turn into one red line and exit code 1."""


@dataclass(slots=True)
class RunPaths:
    """A run's model config and, for each path index, the module of each level (id, version, hash)."""

    run: RunPublic
    config: ModelConfig
    modules: list[list[ModulePublic]]
    client: CoordinatorClient
    on_fetch: Callable[[ModulePublic, int], None] | None = None
    """Called after each module download with its size in bytes (progress of long commands)."""
    _cache: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_paths(self) -> int:
        return len(self.modules)

    def weights(self, module: ModulePublic) -> dict[str, torch.Tensor]:
        """One module's tensors, downloaded once per content hash and verified against it."""
        digest = module.weights_hash
        if digest not in self._cache:
            body = self.client.module_weights(module.id, module.version, digest)
            if self.on_fetch is not None:
                self.on_fetch(module, len(body))
            try:
                self._cache[digest] = decode(body)
            except CodecError as exc:
                raise EvalError(f"module {module.id} version {module.version}: {exc}") from exc
        return self._cache[digest]

    def build(self, path_index: int) -> PathModel:
        return build_path(self.config, [self.weights(m) for m in self.modules[path_index]])


def fetch_run_paths(
    client: CoordinatorClient, run_id: int, *, on_fetch: Callable[[ModulePublic, int], None] | None = None
) -> RunPaths:
    """Read the run, its paths and its modules' current versions (weights are fetched lazily; `on_fetch`: see
    `RunPaths`)."""
    run = client.run(run_id)
    config = ModelConfig.from_dict(run.config["model"])
    modules = {m.id: m for m in client.modules(run_id=run_id)}
    paths = sorted(client.paths(run_id=run_id), key=lambda p: p.index)
    if [p.index for p in paths] != list(range(run.num_paths)):
        raise EvalError(
            f"run {run_id} has {run.num_paths} paths but the registry lists indices {[p.index for p in paths]}"
        )
    per_path: list[list[ModulePublic]] = []
    for p in paths:
        missing = [m for m in p.module_ids if m not in modules]
        if missing:
            raise EvalError(f"path {p.index} of run {run_id} uses modules {missing} not listed for the run")
        per_path.append([modules[m] for m in p.module_ids])
    return RunPaths(run=run, config=config, modules=per_path, client=client, on_fetch=on_fetch)


def find_tokenizer(router_or_shards: Path) -> BPETokenizer | None:
    """The BPE tokenizer saved with the shards (`tokenizer.json` in the shard directory, next to `router/`, or in
    a refit router's directory), if the shards were cut with one; None for byte-level shards. A file path is
    loaded as the tokenizer itself."""
    if router_or_shards.is_file():
        return BPETokenizer.load(router_or_shards)
    for candidate in (router_or_shards / TOKENIZER_FILE, router_or_shards.parent / TOKENIZER_FILE):
        if candidate.is_file():
            return BPETokenizer.load(candidate)
    return None


def check_vocab(tokenizer: BPETokenizer | None, config: ModelConfig, *, run_id: int) -> None:
    """Refuse a tokenizer that the run's model cannot read, and byte tokens for a model trained on BPE (a model
    whose vocabulary is larger than bytes was made for a tokenizer: scoring it with bytes is meaningless)."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise EvalError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, run {run_id}'s model only {config.vocab_size}"
        )
    if tokenizer is None and config.vocab_size > ByteTokenizer.vocab_size:
        raise EvalError(
            f"run {run_id}'s model has {config.vocab_size} tokens, so it was trained on BPE shards, but no "
            f"{TOKENIZER_FILE} was found with the router: give the shard directory (it holds the tokenizer)"
        )


def load_router(directory: Path) -> Router:
    """A saved router from its own directory or from a shard directory holding it in `router/`."""
    if not (directory / "router.json").is_file() and (directory / "router" / "router.json").is_file():
        directory = directory / "router"
    return Router.load(directory)


def load_documents(corpus_dir: Path, split: str) -> list[str]:
    path = corpus_dir / f"{split}.jsonl"
    if not path.is_file():
        raise CorpusError(f"no {split!r} split at {path}")
    return [str(d["text"]) for d in iter_jsonl(path)]


def evaluate_run(
    client: CoordinatorClient,
    *,
    run_id: int,
    router: Router,
    documents: list[str],
    every: int | None = None,
    stride: int | None = None,
    batch_size: int = 256,
    tokenizer: BPETokenizer | None = None,
    progress: Progress | None = None,
) -> EvalResult:
    """Routed evaluation of a run's current module versions. `tokenizer`: the BPE tokenizer the run's shards were
    cut with (None: bytes). `progress`: told about each module fetched and each batch scored."""
    run_paths = fetch_run_paths(client, run_id, on_fetch=progress.fetched if progress is not None else None)
    if router.num_paths != run_paths.num_paths:
        raise EvalError(f"the router has {router.num_paths} paths, run {run_id} has {run_paths.num_paths}")
    check_vocab(tokenizer, run_paths.config, run_id=run_id)
    build = run_paths.build if progress is None else progress.watch_paths(run_paths.build, num_paths=router.num_paths)
    result = evaluate_routed(
        build,
        router,
        documents,
        prefix_tokens=router.prefix_tokens,
        context=run_paths.config.seq_len,
        every=every,
        stride=stride,
        batch_size=batch_size,
        tokenizer=tokenizer,
    )
    result.extra.update(
        {
            "run_id": run_id,
            "run_name": run_paths.run.name,
            "round": run_paths.run.current_round,
            "module_versions": [[m.version for m in ms] for ms in run_paths.modules],
        }
    )
    return result


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def result_table(result: EvalResult, *, title: str) -> Table:
    table = Table(title=title)
    for column in ("path", "documents", "tokens", "loss (nats)", "perplexity"):
        table.add_column(column, justify="right")
    for p in result.per_path:
        table.add_row(
            str(p.path_index), str(p.num_documents), f"{p.num_tokens:,}", _fmt(p.loss), _fmt(p.perplexity, ".2f")
        )
    table.add_row(
        "all",
        str(result.num_documents),
        f"{result.num_tokens:,}",
        _fmt(result.loss),
        _fmt(result.perplexity, ".2f"),
        style="bold",
    )
    return table


def eval_command(
    ctx: typer.Context,
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id whose paths are evaluated (current module versions).")],
    router: Annotated[Path, typer.Option(help="Router directory, or the shard directory holding router/.")],
    corpus: Annotated[Path, typer.Option(help="Corpus directory (from `dipaco router corpus`).")],
    split: Annotated[str, typer.Option(help="Split to score: reads SPLIT.jsonl in the corpus.")] = "heldout",
    every: Annotated[int | None, typer.Option(min=1, help="Re-route every W tokens (paper §2.5).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    token: ReadTokenOpt = "",
    ca_file: CaFileOpt = None,
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 256,
) -> None:
    """Routed held-out perplexity of a run: each document goes to one path by its prefix; the prefix is not
    scored."""
    out = console()
    token = resolve_token(token)
    with user_errors(out, *EVAL_ERRORS):
        routing = load_router(router)
        documents = load_documents(corpus, split)
        tokenizer = find_tokenizer(router)
        progress = Progress("eval")
        progress.update(f"scoring {len(documents):,} {split} documents of run {run}", force=True)
        with connect(ctx, coordinator, token, ca_file) as client:
            result = evaluate_run(
                client,
                run_id=run,
                router=routing,
                documents=documents,
                every=every,
                batch_size=batch_size,
                tokenizer=tokenizer,
                progress=progress,
            )
    if json_output:
        typer.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return
    title = (
        f"run {run} ({result.extra['run_name']}), round {result.extra['round']}: {split}, prefix "
        f"{result.prefix_tokens} tokens excluded" + (f", re-routed every {every}" if every else "")
    )
    out.print(result_table(result, title=title))
    if result.skipped_documents:
        out.print(f"{result.skipped_documents} document(s) had no token after the prefix and were skipped")
