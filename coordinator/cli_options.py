"""What the commands that talk to a coordinator share (`dipaco registry ...`, `eval`, `export`, `generate`,
`router register|refit`): their options, the one rule for the bearer token, and the console they print with.
Imports only Typer and Rich, so that `dipaco --help` and `dipaco registry ...` start fast.

Tokens, one rule for every command: a command that only reads (`registry`, `eval`, `export`, `generate`,
`router refit`) sends `--token`, else `$DIPACO_TOKEN`, else `$DIPACO_ADMIN_TOKEN`; any valid token reads the
registry, module weights and shards need the admin token or an island token of the run. A command that writes
(`registry create-run`, `router register`) sends the admin token: `--token`, else `$DIPACO_ADMIN_TOKEN`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

CaFileOpt = Annotated[
    Path | None,
    typer.Option(
        "--ca-file",
        envvar="DIPACO_CA_FILE",
        exists=True,
        dir_okay=False,
        help="PEM file of the certificate authority to trust for an https coordinator with its own certificate "
        "(default: the system's).",
        show_default=False,
    ),
]
ReadTokenOpt = Annotated[
    str,
    typer.Option(
        "--token",
        envvar="DIPACO_TOKEN",
        help="Bearer token (else $DIPACO_ADMIN_TOKEN): any valid token reads the registry; module weights need the "
        "admin token or an island token of the run.",
        show_default=False,
    ),
]
AdminTokenOpt = Annotated[
    str, typer.Option("--token", envvar="DIPACO_ADMIN_TOKEN", help="Admin token.", show_default=False)
]

WIDE_COLUMNS = 200
"""Width of a console that is not a terminal (piped, captured, a log file) when $COLUMNS does not say: Rich's own
default, 80, cuts table cells ("dense…") and wraps commands mid-line."""


def console(*, stderr: bool = False) -> Console:
    """A console for a command's output: a terminal's own width; otherwise $COLUMNS, else `WIDE_COLUMNS`."""
    out = Console(stderr=stderr)
    if out.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return out
    return Console(stderr=stderr, width=WIDE_COLUMNS)


def resolve_token(token: str, *, admin: bool = False) -> str:
    """The token a command sends (see the module docstring); without one, say so on stderr and exit 1."""
    token = token or os.environ.get("DIPACO_ADMIN_TOKEN", "")
    if not token:
        what, env = ("admin token", "DIPACO_ADMIN_TOKEN") if admin else ("token", "DIPACO_TOKEN or DIPACO_ADMIN_TOKEN")
        console(stderr=True).print(f"[red]error:[/red] no {what}: pass --token or set {env}")
        raise typer.Exit(code=1)
    return token
