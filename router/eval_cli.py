"""`dipaco eval`: routed held-out perplexity of a run's paths, fetched from the coordinator over REST.

The run's model config comes from `GET /v1/runs/{id}`, its paths from `GET /v1/paths?run_id=`, the current
module versions from `GET /v1/modules?run_id=` and their weights from `GET /v1/modules/{id}/weights?version=`
(cached in memory by content hash, so a module shared by every path is downloaded once, and checked against
that hash). Each path is built with `modules.build_path` only when a document is routed to it, and evaluated by
`router.evaluate.evaluate_routed` (see there for exactly which tokens are scored).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import torch
import typer
from rich.console import Console
from rich.table import Table

from modules import CodecError, ModelConfig, build_path, decode
from modules.model import PathModel
from router.bpe import TOKENIZER_FILE, BPETokenizer
from router.corpus import CorpusError, iter_jsonl
from router.evaluate import EvalResult, evaluate_routed
from router.router import Router, RouterError
from router.tokenizer import ByteTokenizer
from router.user_errors import user_errors

REQUEST_TIMEOUT_S = 60.0
"""One module download (a few MB to a few hundred MB over a LAN) must finish within this."""
PAGE = 1000
"""Page size for list endpoints (the coordinator's maximum)."""


class EvalError(RuntimeError):
    """The run, its weights, the router or the corpus cannot be used for evaluation."""


def _get(client: httpx.Client, url: str, **params: Any) -> httpx.Response:
    try:
        response = client.get(url, params=params or None)
    except httpx.HTTPError as exc:
        raise EvalError(f"cannot reach the coordinator for GET {url}: {exc}") from exc
    if not response.is_success:
        try:
            detail = response.json().get("detail", response.text)
        except ValueError:
            detail = response.text
        raise EvalError(f"GET {url}: HTTP {response.status_code}: {detail}")
    return response


def _list(client: httpx.Client, url: str, **params: Any) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    while True:
        page = _get(client, url, **params, offset=len(items), limit=PAGE).json()
        items.extend(page["data"])
        if not page["data"] or len(items) >= page["count"]:
            return items


@dataclass(slots=True)
class RunPaths:
    """A run's model config and, for each path index, the (module id, version, hash) of each level."""

    run: dict[str, Any]
    config: ModelConfig
    modules: list[list[dict[str, Any]]]
    client: httpx.Client
    _cache: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_paths(self) -> int:
        return len(self.modules)

    def weights(self, module: dict[str, Any]) -> dict[str, torch.Tensor]:
        """One module's tensors, downloaded once per content hash and verified against it."""
        digest = module["weights_hash"]
        if digest not in self._cache:
            body = _get(self.client, f"/v1/modules/{module['id']}/weights", version=module["version"]).content
            actual = hashlib.sha256(body).hexdigest()
            if actual != digest:
                raise EvalError(f"module {module['id']} version {module['version']}: body has sha256 {actual}, "
                                f"the registry says {digest}")
            try:
                self._cache[digest] = decode(body)
            except CodecError as exc:
                raise EvalError(f"module {module['id']} version {module['version']}: {exc}") from exc
        return self._cache[digest]

    def build(self, path_index: int) -> PathModel:
        return build_path(self.config, [self.weights(m) for m in self.modules[path_index]])


def fetch_run_paths(client: httpx.Client, run_id: int) -> RunPaths:
    """Read the run, its paths and its modules' current versions (weights are fetched lazily)."""
    run = _get(client, f"/v1/runs/{run_id}").json()
    config = ModelConfig.from_dict(run["config"]["model"])
    modules = {m["id"]: m for m in _list(client, "/v1/modules", run_id=run_id)}
    paths = sorted(_list(client, "/v1/paths", run_id=run_id), key=lambda p: p["index"])
    if [p["index"] for p in paths] != list(range(run["num_paths"])):
        raise EvalError(f"run {run_id} has {run['num_paths']} paths but the registry lists indices "
                        f"{[p['index'] for p in paths]}")
    per_path: list[list[dict[str, Any]]] = []
    for p in paths:
        missing = [m for m in p["module_ids"] if m not in modules]
        if missing:
            raise EvalError(f"path {p['index']} of run {run_id} uses modules {missing} not listed for the run")
        per_path.append([modules[m] for m in p["module_ids"]])
    return RunPaths(run=run, config=config, modules=per_path, client=client)


def find_tokenizer(router_or_shards: Path) -> BPETokenizer | None:
    """The BPE tokenizer saved with the shards (`tokenizer.json` in the shard directory, next to `router/`), if
    the shards were cut with one; None for byte-level shards."""
    for candidate in (router_or_shards / TOKENIZER_FILE, router_or_shards.parent / TOKENIZER_FILE):
        if candidate.is_file():
            return BPETokenizer.load(candidate)
    return None


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
    client: httpx.Client,
    *,
    run_id: int,
    router: Router,
    documents: list[str],
    every: int | None = None,
    stride: int | None = None,
    batch_size: int = 256,
    tokenizer: BPETokenizer | None = None,
) -> EvalResult:
    """Routed evaluation of a run's current module versions; the client carries base URL and bearer token.
    `tokenizer`: the BPE tokenizer the run's shards were cut with (None: bytes)."""
    run_paths = fetch_run_paths(client, run_id)
    if router.num_paths != run_paths.num_paths:
        raise EvalError(f"the router has {router.num_paths} paths, run {run_id} has {run_paths.num_paths}")
    vocab = tokenizer.vocab_size if tokenizer is not None else ByteTokenizer.vocab_size
    if vocab > run_paths.config.vocab_size:
        raise EvalError(f"the tokenizer has {vocab} tokens, run {run_id}'s model only {run_paths.config.vocab_size}")
    result = evaluate_routed(run_paths.build, router, documents, prefix_tokens=router.prefix_tokens,
                             context=run_paths.config.seq_len, every=every, stride=stride, batch_size=batch_size,
                             tokenizer=tokenizer)
    result.extra.update({"run_id": run_id, "run_name": run_paths.run["name"],
                         "round": run_paths.run["current_round"],
                         "module_versions": [[m["version"] for m in ms] for ms in run_paths.modules]})
    return result


@contextmanager
def _client(coordinator: str, token: str) -> Iterator[httpx.Client]:
    """The one client of a command (tests swap in the coordinator app's TestClient here)."""
    with httpx.Client(base_url=coordinator, headers={"Authorization": f"Bearer {token}"},
                      timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        yield client


EVAL_ERRORS = (EvalError, RouterError, CorpusError, ValueError)


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def result_table(result: EvalResult, *, title: str) -> Table:
    table = Table(title=title)
    for column in ("path", "documents", "tokens", "loss (nats)", "perplexity"):
        table.add_column(column, justify="right")
    for p in result.per_path:
        table.add_row(str(p.path_index), str(p.num_documents), f"{p.num_tokens:,}", _fmt(p.loss),
                      _fmt(p.perplexity, ".2f"))
    table.add_row("all", str(result.num_documents), f"{result.num_tokens:,}", _fmt(result.loss),
                  _fmt(result.perplexity, ".2f"), style="bold")
    return table


def eval_command(
    coordinator: Annotated[str, typer.Option(help="Coordinator base URL, e.g. http://127.0.0.1:8000.")],
    run: Annotated[int, typer.Option(help="Run id whose paths are evaluated (current module versions).")],
    router: Annotated[Path, typer.Option(help="Router directory, or the shard directory holding router/.")],
    corpus: Annotated[Path, typer.Option(help="Corpus directory (from `dipaco router corpus`).")],
    split: Annotated[str, typer.Option(help="Split to score: reads SPLIT.jsonl in the corpus.")] = "heldout",
    every: Annotated[int | None, typer.Option(min=1, help="Re-route every W tokens (paper §2.5).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    token: Annotated[str, typer.Option(envvar="DIPACO_TOKEN", help="Any valid bearer token.")] = "",
    batch_size: Annotated[int, typer.Option(min=1, help="Windows per forward pass.")] = 256,
) -> None:
    """Routed held-out perplexity of a run: each document goes to one path by its prefix; the prefix is not
    scored."""
    console = Console()
    token = token or os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        console.print("[red]error:[/red] no token: pass --token or set DIPACO_TOKEN")
        raise typer.Exit(code=1)
    with user_errors(console, *EVAL_ERRORS):
        routing = load_router(router)
        documents = load_documents(corpus, split)
        tokenizer = find_tokenizer(router)
        with _client(coordinator, token) as client:
            result = evaluate_run(client, run_id=run, router=routing, documents=documents, every=every,
                                  batch_size=batch_size, tokenizer=tokenizer)
    if json_output:
        typer.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
        return
    title = (f"run {run} ({result.extra['run_name']}), round {result.extra['round']}: {split}, prefix "
             f"{result.prefix_tokens} tokens excluded" + (f", re-routed every {every}" if every else ""))
    console.print(result_table(result, title=title))
    if result.skipped_documents:
        console.print(f"{result.skipped_documents} document(s) had no token after the prefix and were skipped")
