"""`dipaco coordinator ...`"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="Run the coordinator: registry, rounds and the REST API.", no_args_is_help=True)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    data_dir: Annotated[Path | None, typer.Option(help="SQLite file, blobs, tokens.json [env DIPACO_DATA_DIR]")] = None,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL [env DIPACO_DATABASE_URL]")] = None,
    blob_url: Annotated[
        str | None, typer.Option(help="Blob directory or s3://bucket/prefix [env DIPACO_BLOB_URL]")
    ] = None,
    migrate: Annotated[bool, typer.Option(help="Run database migrations on start")] = True,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes (the service is stateless apart from DB/blobs)")
    ] = 1,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Serve the coordinator (SQLite + local blob directory by default)."""
    import uvicorn

    from coordinator.app import create_app, quiet_garbage_collector
    from coordinator.auth import load_service_tokens
    from coordinator.settings import Settings

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, object] = {"migrate_on_start": migrate}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if database_url is not None:
        overrides["database_url"] = database_url
    if blob_url is not None:
        overrides["blob_url"] = blob_url
    settings = Settings(**overrides)  # type: ignore[arg-type]
    tokens = load_service_tokens(settings)
    if tokens.generated_file is not None:
        typer.echo(f"admin and join tokens: {tokens.generated_file}")
    typer.echo(f"database: {settings.resolved_database_url}")
    typer.echo(f"blobs:    {settings.resolved_blob_url}")
    # Islands reuse one connection for heartbeats: keep it open past a heartbeat interval, or a heartbeat races
    # the server closing the idle connection (a reset the island has to retry).
    keep_alive = int(2 * settings.heartbeat_interval_s) + 5
    if workers == 1:
        app = create_app(settings)
        quiet_garbage_collector()
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive)
        return
    # Several processes: migrate once here, then every worker builds its app from the same environment.
    from coordinator.db import upgrade

    if migrate:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        upgrade(settings.resolved_database_url)
    os.environ.update(
        {
            "DIPACO_DATA_DIR": str(settings.data_dir.resolve()),
            "DIPACO_DATABASE_URL": settings.resolved_database_url,
            "DIPACO_BLOB_URL": settings.resolved_blob_url,
            "DIPACO_MIGRATE_ON_START": "false",
        }
    )
    uvicorn.run(
        "coordinator.app:create_app_from_env",
        factory=True,
        host=host,
        port=port,
        log_level=log_level,
        workers=workers,
        timeout_keep_alive=keep_alive,
    )
