"""What the commands that talk to the coordinator share (`dipaco eval`, `export`, `generate`, `router register`,
`router refit`): the command's one `CoordinatorClient`. The token rule and the console are in
`coordinator.cli_options` (shared with `dipaco registry`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer

from coordinator.client import CoordinatorClient, RetryPolicy


@contextmanager
def connect(
    ctx: typer.Context, coordinator: str, token: str, ca_file: Path | None = None
) -> Iterator[CoordinatorClient]:
    """The command's one client: one attempt per request (a person is waiting and can run it again).

    `ctx.obj`, when set, is the HTTP client to talk through instead of a fresh one on `coordinator`: tests hand
    in the coordinator app's TestClient with `CliRunner().invoke(app, args, obj=test_client)`."""
    with CoordinatorClient(coordinator, token, http=ctx.obj, retry=RetryPolicy.once(), ca_file=ca_file) as client:
        yield client
