"""`dipaco registry runs|modules|paths|islands|create-run`: read the registry through the coordinator client
(tables, or JSON with --json), and create a run from a spec file or flags.

Start-up matters here (a person types these while islands train): the module imports only Typer and Rich; the
client (httpx, pydantic) is imported when a command runs, and nothing imports torch or the server stack.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from coordinator.cli_options import AdminTokenOpt, CaFileOpt, ReadTokenOpt, console, resolve_token

if TYPE_CHECKING:
    from pydantic import BaseModel

    from coordinator.client import CoordinatorClient
    from coordinator.schemas import RunPublic

app = typer.Typer(help="Query the registry of a running coordinator, and create runs.", no_args_is_help=True)

CoordinatorOpt = Annotated[str, typer.Option("--coordinator", envvar="DIPACO_COORDINATOR", help="Coordinator base URL")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]
RunOpt = Annotated[int | None, typer.Option("--run-id", help="Only this run")]

COLUMNS: dict[str, list[str]] = {
    "runs": ["id", "name", "status", "current_round", "num_rounds", "num_paths", "inner_steps", "layout"],
    "modules": [
        "id",
        "run_id",
        "level",
        "level_name",
        "index",
        "sharing",
        "mode",
        "version",
        "num_params",
        "weights_hash",
    ],
    "contributions": [
        "id",
        "run_id",
        "round",
        "path_index",
        "island_id",
        "tokens",
        "train_loss",
        "base_versions",
        "staleness",
    ],
    "paths": ["id", "run_id", "index", "module_indices", "tokens_trained", "epoch", "last_train_loss"],
    "islands": ["id", "name", "site", "status", "last_heartbeat", "lease"],
}


def _client(ctx: typer.Context, coordinator: str, token: str, ca_file: Path | None) -> CoordinatorClient:
    """The command's one client: one attempt per request (a person is waiting and can run it again).

    `ctx.obj`, when set, is the HTTP client to talk through (tests pass the coordinator app's TestClient)."""
    from coordinator.client import CoordinatorClient, RetryPolicy

    return CoordinatorClient(coordinator, token, http=ctx.obj, retry=RetryPolicy.once(), ca_file=ca_file)


def _fail(exc: Exception) -> typer.Exit:
    """A client error as one red line on stderr (stdout may be piped JSON); exit code 1."""
    console(stderr=True).print(f"[red]error:[/red] {exc}", highlight=False)
    return typer.Exit(code=1)


def rows(models: Sequence[BaseModel]) -> list[dict[str, Any]]:
    return [row.model_dump(mode="json") for row in models]


def fetch(
    ctx: typer.Context,
    coordinator: str,
    token: str,
    read: Callable[[CoordinatorClient], list[dict[str, Any]]],
    ca_file: Path | None = None,
) -> list[dict[str, Any]]:
    """The rows `read` returns (JSON-ready dicts). Client errors become one red line on stderr and exit code 1."""
    from coordinator.client import ClientError

    token = resolve_token(token)
    try:
        with _client(ctx, coordinator, token, ca_file) as client:
            return read(client)
    except ClientError as exc:
        raise _fail(exc) from exc


def show(resource: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    out = console()
    if as_json:
        out.print_json(json.dumps({"data": rows, "count": len(rows)}))
        return
    table = Table(title=f"{resource} ({len(rows)})")
    for col in COLUMNS[resource]:
        table.add_column(col, overflow="fold")
    for row in rows:
        cells = []
        for col in COLUMNS[resource]:
            value = row.get(col)
            if col == "weights_hash" and isinstance(value, str):
                value = value[:12]
            if isinstance(value, float):
                value = f"{value:.4f}"
            cells.append("" if value is None else str(value))
        table.add_row(*cells)
    out.print(table)


@app.command()
def runs(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: ReadTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
) -> None:
    """Runs: status, round, layout."""
    show("runs", fetch(ctx, coordinator, token, lambda c: rows(c.runs()), ca_file), json_)


@app.command()
def modules(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: ReadTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    run_id: RunOpt = None,
    level: Annotated[int | None, typer.Option(help="Only this level")] = None,
) -> None:
    """Modules: one row per module, with its level, index and version."""
    show(
        "modules", fetch(ctx, coordinator, token, lambda c: rows(c.modules(run_id=run_id, level=level)), ca_file), json_
    )


@app.command()
def paths(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: ReadTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    run_id: RunOpt = None,
) -> None:
    """Paths: the module index on each level, tokens trained, last train loss."""
    show("paths", fetch(ctx, coordinator, token, lambda c: rows(c.paths(run_id=run_id)), ca_file), json_)


@app.command()
def islands(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: ReadTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
) -> None:
    """Islands that joined: status, last heartbeat, and the run, round and path of each one's active lease."""
    from coordinator.states import LeaseStatus

    def read(client: CoordinatorClient) -> list[dict[str, Any]]:
        found = rows(client.islands())
        leases: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for lease in rows(client.leases(status=LeaseStatus.ACTIVE)):
            leases[lease["island_id"]].append({k: lease[k] for k in ("id", "run_id", "round", "path_index", "shared")})
        for island in found:
            island["leases"] = sorted(leases[island["id"]], key=lambda x: x["id"])
        return found

    found = fetch(ctx, coordinator, token, read, ca_file)
    if not json_:
        for island in found:  # the table's rendering of "leases"
            island["lease"] = ", ".join(
                f"run {x['run_id']} round {x['round']} path {x['path_index']}" + (" (shared)" if x["shared"] else "")
                for x in island["leases"]
            )
    show("islands", found, json_)


@app.command()
def contributions(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: ReadTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    run_id: RunOpt = None,
    round_: Annotated[
        int | None, typer.Option("--round", help="Only this round (all-async runs: the path's lease)")
    ] = None,
) -> None:
    """Accepted uploads: path, island, loss, and per module the version its lease trained from and its staleness
    (module steps taken since; always 0 on round levels). `id:vN@k`: an overlap lease trained k inner steps from
    its island's own end weights of the path before it moved onto version N."""
    found = fetch(ctx, coordinator, token, lambda c: rows(c.contributions(run_id=run_id, round=round_)), ca_file)
    if not json_:
        for row in found:  # per module "id:version[@rebased_at]" and "id:staleness", in level order
            row["base_versions"] = " ".join(
                f"{m['module_id']}:v{m['base_version']}"
                + ("" if m.get("rebased_at") is None else f"@{m['rebased_at']}")
                for m in row["modules"]
            )
            row["staleness"] = " ".join(f"{m['module_id']}:{m['staleness']}" for m in row["modules"])
    show("contributions", found, json_)


def load_run_spec(path: Path) -> dict[str, Any]:
    """A run spec file: the JSON body of `POST /v1/runs`, or the same in YAML (.yaml/.yml, needs PyYAML)."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise ValueError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the spec as JSON"
            ) from exc
        spec = yaml.safe_load(text)
    else:
        spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: a run spec is a mapping of fields, got {type(spec).__name__}")
    return spec


def merge_spec(spec: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any]:
    """`spec` with the flags given on the command line (None: not given) put in their places."""
    merged = json.loads(json.dumps(spec))  # a deep copy
    places = {
        "name": ("name",),
        "flavour": ("model", "flavour"),
        "block": ("model", "block"),
        "layout": ("layout",),
        "inner_steps": ("inner_steps",),
        "rounds": ("num_rounds",),
        "batch_size": ("inner", "batch_size"),
        "seed": ("seed",),
        "sync": ("sync",),
    }
    for flag, value in flags.items():
        if value is None:
            continue
        *parents, leaf = places[flag]
        node = merged
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return merged


def _describe(run: RunPublic) -> str:
    model = run.config.get("model", {})
    return (
        f"run {run.id} {run.name!r}: {run.num_paths} paths ({run.layout}), {run.num_rounds} rounds x "
        f"H={run.inner_steps}, model {model.get('d_model')}x{model.get('n_layers')} {model.get('block')}, "
        f"{run.schedule} updates; status {run.status}"
    )


@app.command("create-run")
def create_run(
    ctx: typer.Context,
    spec: Annotated[
        Path | None,
        typer.Option(
            exists=True, dir_okay=False, help="Run spec: the JSON (or YAML) body of POST /v1/runs; flags override it"
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="Run name")] = None,
    flavour: Annotated[
        str | None, typer.Option(help="Model flavour: debug, small or paper-150m (default: debug)")
    ] = None,
    block: Annotated[str | None, typer.Option(help="Transformer block: llama or gpt2 (default: the flavour's)")] = None,
    layout: Annotated[
        str | None, typer.Option(help="Levels, e.g. 'embed:shared, b0-0:routed2, b1-1:routed2, head:shared'")
    ] = None,
    inner_steps: Annotated[int | None, typer.Option(help="H: inner AdamW steps per round (default: 20)")] = None,
    rounds: Annotated[int | None, typer.Option(help="Outer rounds (default: 3)")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per inner step (default: 8)")] = None,
    seed: Annotated[int | None, typer.Option(help="Seed of the run (default: 0)")] = None,
    sync: Annotated[
        str | None,
        typer.Option(help="round (default) or async: how modules are updated, unless the layout says per level"),
    ] = None,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: AdminTokenOpt = "",
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    wait: Annotated[
        float,
        typer.Option(min=0, help="Seconds to keep trying while the coordinator does not answer yet (0: one try)"),
    ] = 0.0,
) -> None:
    """Create a run from a spec file and/or flags (admin); it starts once every path has a shard.

    Next: `dipaco router register --run ID ...` uploads one shard per path."""
    from pydantic import ValidationError

    from coordinator.client import ClientError
    from coordinator.schemas import RunCreate

    flags = {
        "name": name,
        "flavour": flavour,
        "block": block,
        "layout": layout,
        "inner_steps": inner_steps,
        "rounds": rounds,
        "batch_size": batch_size,
        "seed": seed,
        "sync": sync,
    }
    try:
        body = merge_spec(load_run_spec(spec) if spec is not None else {}, flags)
        validated = RunCreate.model_validate(body)
    except ValidationError as exc:
        errors = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
        raise _fail(ValueError(f"run spec: {errors}")) from exc
    except (OSError, ValueError) as exc:
        raise _fail(exc) from exc
    token = resolve_token(token, admin=True)
    try:
        with _client(ctx, coordinator, token, ca_file) as client:
            if wait > 0:  # a coordinator started a moment ago: wait for /healthz, then create once (not idempotent)
                client.health(give_up_after_s=wait)
            run = client.create_run(validated)
    except ClientError as exc:
        raise _fail(exc) from exc
    if json_:
        console().print_json(run.model_dump_json())
        return
    out = console()
    out.print(_describe(run), highlight=False)
    out.print(f"next: register one shard per path with `dipaco router register --run {run.id} ...`", highlight=False)
