"""`dipaco registry runs|modules|paths|islands`: read the registry through the coordinator client; tables, or
JSON with --json."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from coordinator.cli_options import CaFileOpt
from coordinator.client import ClientError, CoordinatorClient, RetryPolicy

app = typer.Typer(help="Query the registry of a running coordinator.", no_args_is_help=True)

CoordinatorOpt = Annotated[str, typer.Option("--coordinator", envvar="DIPACO_COORDINATOR", help="Coordinator base URL")]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", help="Any valid token [env DIPACO_TOKEN, then DIPACO_ADMIN_TOKEN]", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table")]
RunOpt = Annotated[int | None, typer.Option("--run-id", help="Only this run")]

COLUMNS: dict[str, list[str]] = {
    "runs": ["id", "name", "status", "current_round", "num_rounds", "num_paths", "inner_steps", "layout"],
    "modules": ["id", "run_id", "level", "level_name", "index", "sharing", "version", "num_params", "weights_hash"],
    "paths": ["id", "run_id", "index", "module_indices", "tokens_trained", "epoch", "last_train_loss"],
    "islands": ["id", "name", "site", "status", "last_heartbeat"],
}


def fetch(
    ctx: typer.Context,
    coordinator: str,
    token: str | None,
    read: Callable[[CoordinatorClient], Sequence[BaseModel]],
    ca_file: Path | None = None,
) -> list[dict[str, Any]]:
    """Every row `read` returns, as JSON-ready dicts. Client errors become one red line on stderr and exit code 1.

    `ctx.obj`, when set, is the HTTP client to talk through (tests pass the coordinator app's TestClient)."""
    token = token or os.environ.get("DIPACO_TOKEN") or os.environ.get("DIPACO_ADMIN_TOKEN")
    if not token:
        raise typer.BadParameter("no token: pass --token or set DIPACO_TOKEN / DIPACO_ADMIN_TOKEN")
    try:
        with CoordinatorClient(coordinator, token, http=ctx.obj, retry=RetryPolicy.once(), ca_file=ca_file) as client:
            return [row.model_dump(mode="json") for row in read(client)]
    except ClientError as exc:  # on stderr: stdout may be piped JSON
        Console(stderr=True).print(f"[red]error:[/red] {exc}")
        raise typer.Exit(code=1) from exc


def show(resource: str, rows: list[dict[str, Any]], as_json: bool) -> None:
    console = Console()
    if as_json:
        console.print_json(json.dumps({"data": rows, "count": len(rows)}))
        return
    table = Table(title=f"{resource} ({len(rows)})")
    for col in COLUMNS[resource]:
        table.add_column(col)
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
    console.print(table)


@app.command()
def runs(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
) -> None:
    """Runs: status, round, layout."""
    show("runs", fetch(ctx, coordinator, token, lambda c: c.runs(), ca_file), json_)


@app.command()
def modules(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    run_id: RunOpt = None,
    level: Annotated[int | None, typer.Option(help="Only this level")] = None,
) -> None:
    """Modules: one row per module, with its level, index and version."""
    show("modules", fetch(ctx, coordinator, token, lambda c: c.modules(run_id=run_id, level=level), ca_file), json_)


@app.command()
def paths(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
    run_id: RunOpt = None,
) -> None:
    """Paths: the module index on each level, tokens trained, last train loss."""
    show("paths", fetch(ctx, coordinator, token, lambda c: c.paths(run_id=run_id), ca_file), json_)


@app.command()
def islands(
    ctx: typer.Context,
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    ca_file: CaFileOpt = None,
) -> None:
    """Islands that joined, with status and last heartbeat."""
    show("islands", fetch(ctx, coordinator, token, lambda c: c.islands(), ca_file), json_)
