"""`dipaco island ...`: join a run as a worker island. Thin: parse flags, build `IslandConfig`, run.

The worker (torch) is imported when `join` runs, not when its options are read."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from coordinator.cli_options import CaFileOpt

app = typer.Typer(help="Join a DiPaCo run as a worker island.", no_args_is_help=True)


@app.callback()
def _main() -> None:
    """Join a DiPaCo run as a worker island."""
    # A callback keeps `join` a named subcommand even while it is the only one.


@app.command()
def join(
    coordinator: Annotated[str, typer.Option(envvar="DIPACO_COORDINATOR", help="Coordinator base URL.")],
    token: Annotated[str, typer.Option(envvar="DIPACO_JOIN_TOKEN", help="Join token.")],
    device: Annotated[
        str, typer.Option(envvar="DIPACO_ISLAND_DEVICE", help="auto (cuda if available), cpu, cuda or cuda:N.")
    ] = "auto",
    name: Annotated[
        str | None, typer.Option(envvar="DIPACO_ISLAND_NAME", help="Island name.", show_default="hostname-pid")
    ] = None,
    site: Annotated[str, typer.Option(envvar="DIPACO_ISLAND_SITE", help="Site label.")] = "local",
    cache_dir: Annotated[Path, typer.Option(envvar="DIPACO_ISLAND_CACHE_DIR", help="Weights/shard cache.")] = Path(
        "~/.cache/dipaco/island"
    ),
    max_rounds: Annotated[
        int | None,
        typer.Option(
            min=1,
            envvar="DIPACO_ISLAND_MAX_ROUNDS",
            help="Stop after this many uploaded leases (default: no limit).",
        ),
    ] = None,
    exit_when_idle: Annotated[
        bool,
        typer.Option(
            "--exit-when-idle/--wait",
            envvar="DIPACO_ISLAND_EXIT_WHEN_IDLE",
            help="While no run is running: --wait asks again until one starts, --exit-when-idle exits 0 at once. "
            "Either way, an island that has trained something leaves (exit 0) once no run is running.",
        ),
    ] = False,
    lease_wait: Annotated[
        float,
        typer.Option(
            min=0,
            max=60,
            envvar="DIPACO_ISLAND_LEASE_WAIT_S",
            help="Seconds the coordinator may hold a lease request while there is no work (0: poll every 2 s).",
        ),
    ] = 10.0,
    give_up_after: Annotated[
        float,
        typer.Option(
            min=0,
            envvar="DIPACO_ISLAND_GIVE_UP_AFTER_S",
            help="Seconds one coordinator call keeps retrying before exit 3.",
        ),
    ] = 300.0,
    max_backoff: Annotated[
        float,
        typer.Option(min=0.01, envvar="DIPACO_ISLAND_MAX_BACKOFF_S", help="Largest sleep between two retries."),
    ] = 30.0,
    seed_offset: Annotated[
        int, typer.Option(envvar="DIPACO_ISLAND_SEED_OFFSET", help="Added to each lease's seed.")
    ] = 0,
    optimizer_cache: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="DIPACO_ISLAND_OPTIMIZER_CACHE",
            help="Paths whose inner AdamW state is kept across rounds (single-process islands).",
        ),
    ] = 4,
    overlap_wait: Annotated[
        float,
        typer.Option(
            min=0,
            envvar="DIPACO_ISLAND_OVERLAP_WAIT",
            help="Overlap leases: wait before the first step for the versions, up to this share of the lease's "
            "expected training time, before training on through them from the end weights (0: at once).",
        ),
    ] = 0.1,
    nproc: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="DIPACO_ISLAND_NPROC",
            help="Processes training each lease with DDP (rank 0 talks to the coordinator).",
        ),
    ] = 1,
    probe: Annotated[
        bool, typer.Option("--probe/--no-probe", envvar="DIPACO_ISLAND_PROBE", help="Measure tokens/s before joining.")
    ] = True,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", envvar="DIPACO_ISLAND_QUIET", help="No progress bar.")
    ] = False,
    ca_file: CaFileOpt = None,
) -> None:
    """Join a run and train leased paths until no run is running (exit codes: see docs/ISLAND.md)."""
    from rich.console import Console
    from rich.logging import RichHandler

    from island.capabilities import resolve_device
    from island.distributed import check_gpus, follower_main, launch_followers, ranks_from_env
    from island.errors import IslandError
    from island.worker import Island, IslandConfig, default_name

    console = Console(stderr=True)
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(message)s", handlers=[RichHandler(console=console, show_path=False)]
        )
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request is noise here
    ranks = ranks_from_env()
    if ranks.rank > 0:  # a follower rank under torchrun: no coordinator, no cache, just DDP steps
        raise typer.Exit(follower_main(device))
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
            lease_wait_s=lease_wait,
            give_up_after_s=give_up_after,
            max_backoff_s=max_backoff,
            seed_offset=seed_offset,
            optimizer_cache=optimizer_cache,
            overlap_wait=overlap_wait,
            probe=probe,
            quiet=quiet,
            ca_file=ca_file,
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    followers: list[subprocess.Popen[bytes]] = []
    if nproc > 1 and not ranks.distributed:
        try:
            cuda = resolve_device(device).type == "cuda"
        except IslandError as exc:
            raise typer.BadParameter(str(exc), param_hint="--device") from exc
        try:
            if cuda:
                check_gpus(nproc)
        except IslandError as exc:
            raise typer.BadParameter(str(exc), param_hint="--nproc") from exc
        followers = launch_followers(nproc, device=device)
        ranks = ranks_from_env()
    try:
        code = Island(config, console=console, ranks=ranks).run()
    finally:
        code_followers = _reap(followers)
    raise typer.Exit(code if code else code_followers)


def _reap(followers: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> int:
    """Wait for the follower ranks (rank 0 told them to stop); kill any that hang. Non-zero if one failed."""
    worst = 0
    for proc in followers:
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        if rc:
            worst = 1
    return worst
