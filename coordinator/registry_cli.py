"""`dipaco registry runs|modules|paths|islands`: read the registry over REST; tables, or JSON with --json."""

from __future__ import annotations

import json
import os
from typing import Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

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


def fetch(coordinator: str, token: str | None, resource: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    token = token or os.environ.get("DIPACO_TOKEN") or os.environ.get("DIPACO_ADMIN_TOKEN")
    if not token:
        raise typer.BadParameter("no token: pass --token or set DIPACO_TOKEN / DIPACO_ADMIN_TOKEN")
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=coordinator, timeout=httpx.Timeout(30.0)) as client:
        offset = 0
        while True:
            query = {k: v for k, v in params.items() if v is not None} | {"offset": offset, "limit": 1000}
            try:
                r = client.get(f"/v1/{resource}", params=query, headers={"Authorization": f"Bearer {token}"})
            except httpx.HTTPError as exc:
                raise typer.BadParameter(f"cannot reach the coordinator at {coordinator}: {exc}") from exc
            if r.status_code != 200:
                detail = r.json().get("detail") if r.headers.get("content-type") == "application/json" else r.text
                raise typer.BadParameter(f"GET /v1/{resource} -> {r.status_code}: {detail}")
            body = r.json()
            rows.extend(body["data"])
            offset += len(body["data"])
            if offset >= body["count"] or not body["data"]:
                return rows


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
def runs(coordinator: CoordinatorOpt = "http://127.0.0.1:8000", token: TokenOpt = None, json_: JsonOpt = False) -> None:
    """Runs: status, round, layout."""
    show("runs", fetch(coordinator, token, "runs", {}), json_)


@app.command()
def modules(
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    run_id: RunOpt = None,
    level: Annotated[int | None, typer.Option(help="Only this level")] = None,
) -> None:
    """Modules: one row per module, with its level, index and version."""
    show("modules", fetch(coordinator, token, "modules", {"run_id": run_id, "level": level}), json_)


@app.command()
def paths(
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000",
    token: TokenOpt = None,
    json_: JsonOpt = False,
    run_id: RunOpt = None,
) -> None:
    """Paths: the module index on each level, tokens trained, last train loss."""
    show("paths", fetch(coordinator, token, "paths", {"run_id": run_id}), json_)


@app.command()
def islands(
    coordinator: CoordinatorOpt = "http://127.0.0.1:8000", token: TokenOpt = None, json_: JsonOpt = False
) -> None:
    """Islands that joined, with status and last heartbeat."""
    show("islands", fetch(coordinator, token, "islands", {}), json_)
