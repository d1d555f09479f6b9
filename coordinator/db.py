"""Engine, sessions and migrations. Nothing is built at import time."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.orm import Session, sessionmaker

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


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
        def _sqlite_connect(dbapi_conn: Any, _record: Any) -> None:
            # Let SQLAlchemy's "begin" below open transactions; WAL lets readers run beside one writer.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Any) -> None:
            # IMMEDIATE takes the write lock up front, so check-then-write sequences (pick a free path, close a
            # round) are serialised exactly as PostgreSQL's row locks serialise them.
            conn.exec_driver_sql("BEGIN IMMEDIATE")

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
