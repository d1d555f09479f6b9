"""`dipaco island ...`: join a run as a worker island. Thin: parse flags, build `IslandConfig`, run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.logging import RichHandler

from island.worker import Island, IslandConfig, default_name

app = typer.Typer(help="Join a DiPaCo run as a worker island.", no_args_is_help=True)


@app.callback()
def _main() -> None:
    """Join a DiPaCo run as a worker island."""
    # A callback keeps `join` a named subcommand even while it is the only one.


@app.command()
def join(
    coordinator: Annotated[str, typer.Option(envvar="DIPACO_COORDINATOR", help="Coordinator base URL.")],
    token: Annotated[str, typer.Option(envvar="DIPACO_JOIN_TOKEN", help="Join token.")],
    device: Annotated[str, typer.Option(help="auto (cuda if available), cpu, cuda or cuda:N.")] = "auto",
    name: Annotated[str | None, typer.Option(help="Island name [default: hostname-pid].")] = None,
    site: Annotated[str, typer.Option(help="Site label.")] = "local",
    cache_dir: Annotated[Path, typer.Option(help="Weights/shard cache.")] = Path("~/.cache/dipaco/island"),
    max_rounds: Annotated[
        int | None, typer.Option(min=1, help="Stop after this many uploaded leases [default: until done].")
    ] = None,
    exit_when_idle: Annotated[
        bool, typer.Option("--exit-when-idle/--wait", help="Exit 0 when no run is running, or keep polling.")
    ] = False,
    give_up_after: Annotated[
        float, typer.Option(min=0, help="Seconds one coordinator call keeps retrying before exit 3.")
    ] = 300.0,
    seed_offset: Annotated[int, typer.Option(help="Added to each lease's seed.")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Join a run and train leased paths until the run finishes (exit codes: see island.worker)."""
    console = Console(stderr=True)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=console, show_path=False)]
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request is noise here
    try:
        config = IslandConfig(
            coordinator=coordinator,
            token=token,
            name=name or default_name(),
            site=site,
            device=device,
            cache_dir=cache_dir,
            max_rounds=max_rounds,
            exit_when_idle=exit_when_idle,
            give_up_after_s=give_up_after,
            seed_offset=seed_offset,
            quiet=quiet,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    raise typer.Exit(Island(config, console=console).run())
