"""Expected failures of a command become one red line and exit code 1, not a traceback (shared by the CLIs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import typer
from rich.console import Console


@contextmanager
def user_errors(console: Console, *expected: type[Exception]) -> Iterator[None]:
    try:
        yield
    except expected as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(code=1) from exc
