"""Engine, sessions and migrations. Nothing is built at import time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"

_READING: ContextVar[bool] = ContextVar("dipaco_reading", default=False)
_FLUSH_WAIT: ContextVar[bool] = ContextVar("dipaco_flush_wait", default=True)
_SQLITE_SYNC = "dipaco_synchronous"
"""Key in a SQLite connection's `info`: the `PRAGMA synchronous` level it runs at now."""


@contextmanager
def reading() -> Iterator[None]:
    """Transactions that begin inside (in this thread, or in what it hands its context to) only read.

    On SQLite they begin with a plain, deferred `BEGIN`: in WAL mode a reader works on a snapshot beside the one
    writer instead of queueing for the write lock as every other transaction does (`BEGIN IMMEDIATE`, see
    `make_engine`), and writers (an upload, a module step's commit) no longer queue behind it. Nothing changes on
    PostgreSQL. Only for transactions that write nothing: on SQLite a deferred transaction that tries to write
    after another one committed fails ("database is locked")."""
    token = _READING.set(True)
    try:
        yield
    finally:
        _READING.reset(token)


def start_writing(session: Session) -> None:
    """Inside `reading`, where a reader found that it has something to write: the rest is a writer's. On SQLite the
    reader's transaction ends here (rolled back: the caller reads again, under its locks, what it writes from) so
    that the next statement begins with the write lock; on PostgreSQL the transaction goes on as it is."""
    if not _READING.get():
        return
    _READING.set(False)  # until the enclosing `reading` ends
    if session.get_bind().dialect.name == "sqlite":
        session.rollback()


@contextmanager
def without_flush_wait(session: Session) -> Iterator[None]:
    """The session's writes inside commit without waiting for the database's log to reach the disk, for writes
    that may be lost in a power cut or an OS crash (never in a crash of the coordinator alone): a heartbeat, an
    apply executor's claim of a step. A commit that must survive (an upload's, a step's result) waits for the
    log as always, and with it for every commit before it: the log is written in order, so none of these is
    lost unless the later durable ones are too.

    PostgreSQL: `SET LOCAL synchronous_commit TO OFF`, for the session's current or next transaction only.
    SQLite (WAL): the transactions that begin inside run at `PRAGMA synchronous=NORMAL` (the commit appends to
    the WAL; the next checkpoint or FULL commit syncs it); a transaction already open stays as it began (the
    level cannot change inside one). Every other transaction runs at FULL (`make_engine`)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SET LOCAL synchronous_commit TO OFF"))
        yield
        return
    token = _FLUSH_WAIT.set(False)
    try:
        yield
    finally:
        _FLUSH_WAIT.reset(token)


def make_engine(url: str, *, pool_size: int = 20, max_overflow: int = 20) -> Engine:
    """pool_size + max_overflow should cover the server's worker threads (40 for FastAPI's default
    threadpool), so requests queue for a thread, not for a connection."""
    if url.startswith("sqlite"):
        if url.startswith("sqlite:///") and not url.startswith("sqlite:///:memory:"):
            Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            connect_args={"timeout": 60, "check_same_thread": False},
            pool_size=pool_size,
            max_overflow=max_overflow,
        )

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn: Any, record: Any) -> None:
            # Let SQLAlchemy's "begin" below open transactions; WAL lets readers run beside one writer.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA synchronous=FULL")  # every commit durable, except inside `without_flush_wait`
            cur.close()
            record.info[_SQLITE_SYNC] = "FULL"

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front, so check-then-write sequences (pick a free path, close a
            # round) are serialised exactly as PostgreSQL's row locks serialise them; readers need not (`reading`).
            level = "FULL" if _FLUSH_WAIT.get() else "NORMAL"
            if conn.info.get(_SQLITE_SYNC) != level:  # outside any transaction: the only place it may change
                conn.exec_driver_sql(f"PRAGMA synchronous={level}")
                conn.info[_SQLITE_SYNC] = level
            conn.exec_driver_sql("BEGIN" if _READING.get() else "BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=pool_size, max_overflow=max_overflow)


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def pinned_session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    """A session that keeps one pooled connection across its transactions: one checkout (and one pre-ping, a
    round trip on PostgreSQL) for a request that commits or rolls back more than once, as an upload does. The
    connection sits idle between the transactions, holding no transaction; the pool covers the server's worker
    threads (`make_engine`), so holding it cannot starve other requests."""
    with sessions.kw["bind"].connect() as connection, sessions(bind=connection) as session:
        yield session


def ping(session: Session) -> None:
    """One round trip to the database (raises when it does not answer)."""
    session.execute(text("SELECT 1"))


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)
