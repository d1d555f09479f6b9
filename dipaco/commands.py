"""What the commands that talk to the coordinator share (`dipaco eval`, `export`, `generate`, `router register`,
`router refit`): the bearer token, the command's one `CoordinatorClient`, and client errors as one red line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console

from coordinator.client import CoordinatorClient, RetryPolicy


def require_token(console: Console, token: str, *, admin: bool = False) -> str:
    """`--token` (or its environment variable), else `DIPACO_ADMIN_TOKEN`; without one, say so and exit 1."""
    token = token or os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        what, env = ("admin token", "DIPACO_ADMIN_TOKEN") if admin else ("token", "DIPACO_TOKEN")
        console.print(f"[red]error:[/red] no {what}: pass --token or set {env}")
        raise typer.Exit(code=1)
    return token


@contextmanager
def connect(
    ctx: typer.Context, coordinator: str, token: str, ca_file: Path | None = None
) -> Iterator[CoordinatorClient]:
    """The command's one client: one attempt per request (a person is waiting and can run it again).

    `ctx.obj`, when set, is the HTTP client to talk through instead of a fresh one on `coordinator`: tests hand
    in the coordinator app's TestClient with `CliRunner().invoke(app, args, obj=test_client)`."""
    with CoordinatorClient(coordinator, token, http=ctx.obj, retry=RetryPolicy.once(), ca_file=ca_file) as client:
        yield client
