"""`dipaco coordinator ...`"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Annotated, Any

import typer

app = typer.Typer(help="Run the coordinator: registry, rounds and the REST API.", no_args_is_help=True)


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    data_dir: Annotated[
        Path | None, typer.Option(help="SQLite file, blobs, tokens.json (default: $DIPACO_DATA_DIR, else .dipaco)")
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: $DIPACO_DATABASE_URL, else SQLite in the data dir)")
    ] = None,
    blob_url: Annotated[
        str | None,
        typer.Option(help="Blob directory or s3://bucket/prefix (default: $DIPACO_BLOB_URL, else <data dir>/blobs)"),
    ] = None,
    migrate: Annotated[
        bool | None,
        typer.Option(
            "--migrate/--no-migrate",
            help="Run database migrations on start (default: $DIPACO_MIGRATE_ON_START, else yes)",
            show_default=False,
        ),
    ] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes (the service is stateless apart from DB/blobs)")
    ] = 1,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
    apply_workers: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=64,
            help="Apply executors (threads) per process; 0: rounds are applied by `apply-worker` processes only "
            "(default: $DIPACO_APPLY_WORKERS, else 1)",
            show_default=False,
        ),
    ] = None,
    ssl_certfile: Annotated[
        Path | None,
        typer.Option(envvar="DIPACO_SSL_CERTFILE", help="TLS certificate (PEM, chain included): serve https"),
    ] = None,
    ssl_keyfile: Annotated[
        Path | None, typer.Option(envvar="DIPACO_SSL_KEYFILE", help="TLS private key (PEM) of --ssl-certfile")
    ] = None,
) -> None:
    """Serve the coordinator (SQLite + local blob directory by default)."""
    import uvicorn

    from coordinator.app import create_app, quiet_garbage_collector, use_torch_threads
    from coordinator.auth import load_service_tokens
    from coordinator.settings import Settings, redact_url

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise typer.BadParameter("--ssl-certfile and --ssl-keyfile go together")
    for path in (ssl_certfile, ssl_keyfile):
        if path is not None and not path.is_file():
            raise typer.BadParameter(f"{path} is not a file")
    tls: dict[str, Any] = {"ssl_certfile": str(ssl_certfile), "ssl_keyfile": str(ssl_keyfile)} if ssl_certfile else {}
    if not tls and not _loopback(host):
        logging.getLogger("coordinator").warning(
            "serving %s over plain http: bearer tokens, weights and training data travel in clear; use "
            "--ssl-certfile/--ssl-keyfile or a TLS-terminating proxy in front",
            host,
        )
    overrides: dict[str, object] = {} if migrate is None else {"migrate_on_start": migrate}
    if apply_workers is not None:
        overrides["apply_workers"] = apply_workers
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
    typer.echo(f"database: {redact_url(settings.resolved_database_url)}")
    typer.echo(f"blobs:    {redact_url(settings.resolved_blob_url)}")
    # Islands reuse one connection for heartbeats: keep it open past a heartbeat interval, or a heartbeat races
    # the server closing the idle connection (a reset the island has to retry).
    keep_alive = int(2 * settings.heartbeat_interval_s) + 5
    if workers == 1:
        app = create_app(settings)
        quiet_garbage_collector()
        use_torch_threads(settings)
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive, **tls)
        return
    # Several processes: migrate once here, then every worker builds its app from the same environment.
    from coordinator.db import upgrade

    if settings.migrate_on_start:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        upgrade(settings.resolved_database_url)
    os.environ.update(
        {
            "DIPACO_DATA_DIR": str(settings.data_dir.resolve()),
            "DIPACO_DATABASE_URL": settings.resolved_database_url,
            "DIPACO_BLOB_URL": settings.resolved_blob_url,
            "DIPACO_MIGRATE_ON_START": "false",
            "DIPACO_APPLY_WORKERS": str(settings.apply_workers),
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
        **tls,
    )


@app.command()
def tokens(
    data_dir: Annotated[
        Path, typer.Option(envvar="DIPACO_DATA_DIR", help="The coordinator's data directory (holds tokens.json)")
    ] = Path(".dipaco"),
    export: Annotated[
        bool,
        typer.Option("--export", help="Print one `export DIPACO_ADMIN_TOKEN=... DIPACO_JOIN_TOKEN=...` line for eval"),
    ] = False,
) -> None:
    """Print the admin and join tokens kept in <data-dir>/tokens.json (mode 0600), creating the file as `serve`
    does on its first start when there is none. In a shell: eval "$(dipaco coordinator tokens --export)".

    A coordinator started with DIPACO_ADMIN_TOKEN / DIPACO_JOIN_TOKEN in its environment uses those instead."""
    import json
    import shlex

    path = data_dir / "tokens.json"
    if not path.is_file():
        from coordinator.auth import load_service_tokens
        from coordinator.settings import Settings

        # the rule of `serve`'s first start, with the environment's tokens left out: it writes both to the file
        load_service_tokens(Settings(data_dir=data_dir, admin_token=None, join_token=None))
        typer.echo(f"created {path} (mode 0600); `dipaco coordinator serve` reads it", err=True)
    try:
        stored = json.loads(path.read_text())
        admin, join = stored["admin_token"], stored["join_token"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        typer.echo(f"error: cannot read the tokens in {path}: {exc!r}", err=True)
        raise typer.Exit(code=1) from exc
    if export:
        typer.echo(f"export DIPACO_ADMIN_TOKEN={shlex.quote(admin)} DIPACO_JOIN_TOKEN={shlex.quote(join)}")
        return
    typer.echo(f"admin token (DIPACO_ADMIN_TOKEN: create runs, register shards, read everything): {admin}")
    typer.echo(f"join token  (DIPACO_JOIN_TOKEN: islands join with it): {join}")
    typer.echo(f"from {path.resolve()}")


@app.command("apply-worker")
def apply_worker(
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Holds the default SQLite file and blobs (default: $DIPACO_DATA_DIR, else .dipaco)"),
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: $DIPACO_DATABASE_URL, else SQLite in the data dir)")
    ] = None,
    blob_url: Annotated[
        str | None,
        typer.Option(help="Blob directory or s3://bucket/prefix (default: $DIPACO_BLOB_URL, else <data dir>/blobs)"),
    ] = None,
    threads: Annotated[int, typer.Option(min=1, max=64, help="Executors in this process")] = 1,
    poll_s: Annotated[float, typer.Option(min=0.05, help="Seconds between looks for closed rounds")] = 1.0,
    log_level: Annotated[str, typer.Option(help="debug, info, warning")] = "info",
) -> None:
    """Apply closed rounds: claim module steps, fold their outer gradients, commit each exactly once, until
    SIGTERM/SIGINT. Run any number, on any machine that reaches the database and the blob store; `serve` runs
    its own unless started with `--apply-workers 0`."""
    import signal
    import threading

    from coordinator import db
    from coordinator.app import use_torch_threads
    from coordinator.blobstore import open_blob_store
    from coordinator.faults import FaultInjector
    from coordinator.services.apply import ApplyExecutor, executor_name, release_dead_claims
    from coordinator.services.leases import Affinity
    from coordinator.settings import Settings, redact_url
    from coordinator.timeutil import utcnow

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, object] = {}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if database_url is not None:
        overrides["database_url"] = database_url
    if blob_url is not None:
        overrides["blob_url"] = blob_url
    settings = Settings(**overrides)  # type: ignore[arg-type]
    use_torch_threads(settings)
    engine = db.make_engine(settings.resolved_database_url, pool_size=threads + 1, max_overflow=0)
    sessions = db.make_sessionmaker(engine)
    blobs = open_blob_store(settings.resolved_blob_url, s3_endpoint_url=settings.s3_endpoint_url)
    affinity = Affinity(reserve_s=settings.path_reservation_s, live_s=3 * settings.heartbeat_interval_s)
    faults = FaultInjector(pause_at=settings.fault_pause_at, marker_dir=settings.data_dir.resolve())  # crash tests
    stop, wake = threading.Event(), threading.Event()

    def _stop(*_: object) -> None:
        stop.set()
        wake.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop)
    with sessions() as session:
        release_dead_claims(session)
    typer.echo(
        f"apply worker: {threads} executor(s) on {redact_url(settings.resolved_database_url)}, "
        f"blobs {redact_url(settings.resolved_blob_url)}"
    )
    workers = [
        threading.Thread(
            target=ApplyExecutor(
                sessions=sessions,
                blobs=blobs,
                clock=utcnow,
                name=executor_name(index),
                faults=faults,
                affinity=affinity,
                claim_s=settings.apply_claim_s,
            ).serve,
            args=(stop, wake),
            kwargs={"poll_s": poll_s},
            name=f"dipaco-apply-{index}",
        )
        for index in range(threads)
    ]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    engine.dispose()


@app.command()
def migrate(
    data_dir: Annotated[
        Path | None, typer.Option(help="Holds the default SQLite file (default: $DIPACO_DATA_DIR, else .dipaco)")
    ] = None,
    database_url: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL (default: $DIPACO_DATABASE_URL, else SQLite in the data dir)")
    ] = None,
    check: Annotated[
        bool, typer.Option("--check", help="Change nothing: exit 0 when the schema is at head, 1 when it is not")
    ] = False,
) -> None:
    """Bring the database schema to the latest revision and exit: the one-shot step that runs before new
    coordinator replicas start with `serve --no-migrate`. On PostgreSQL it holds an advisory lock while it
    migrates, so concurrent runs apply each migration once."""
    from sqlalchemy.exc import OperationalError

    from coordinator.settings import Settings, redact_url

    overrides: dict[str, object] = {}
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if database_url is not None:
        overrides["database_url"] = database_url
    settings = Settings(**overrides)  # type: ignore[arg-type]
    url = settings.resolved_database_url
    shown = redact_url(url)
    try:
        current, heads = _schema_revisions(url)
        if check:
            if current != heads:
                typer.echo(f"database {shown} is at {_revs(current)}, the code's head is {_revs(heads)}", err=True)
                raise typer.Exit(code=1)
            typer.echo(f"database {shown} is at head {_revs(heads)}")
            return
        from coordinator.db import upgrade

        upgrade(url)
    except OperationalError as exc:  # unreachable or refusing: one line, not a traceback
        typer.echo(f"database {shown} did not answer: {exc.orig or exc}", err=True)
        raise typer.Exit(code=1) from exc
    if current == heads:
        typer.echo(f"database {shown} was already at head {_revs(heads)}")
    else:
        typer.echo(f"database {shown} migrated from {_revs(current)} to {_revs(heads)}")


def _schema_revisions(url: str) -> tuple[set[str], set[str]]:
    """(revisions the database is at, head revisions of the migrations shipped with this code)."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    from coordinator.db import alembic_config, make_engine

    heads = set(ScriptDirectory.from_config(alembic_config(url)).get_heads())
    engine = make_engine(url, pool_size=1, max_overflow=0)  # also makes a SQLite file's directory
    try:
        with engine.connect() as connection:
            current = set(MigrationContext.configure(connection).get_current_heads())
    finally:
        engine.dispose()
    return current, heads


def _revs(revisions: set[str]) -> str:
    return ", ".join(sorted(revisions)) or "no revision (empty schema)"


def _loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
