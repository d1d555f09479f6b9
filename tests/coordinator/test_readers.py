"""Read-only transactions (`db.reading`): on SQLite they begin deferred and read a WAL snapshot beside the one
writer; every other transaction still takes the write lock up front (`BEGIN IMMEDIATE`)."""

from __future__ import annotations

import contextvars
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from coordinator.app import create_app
from coordinator.db import make_engine, make_sessionmaker, reading
from coordinator.services.apply import claim_step
from coordinator.settings import Settings
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import A, create_running_run, join, lease


def _writer_can_start(db: Path) -> bool:
    """Whether another connection gets the write lock at once (and writes a row) while the session's transaction
    is open."""
    other = sqlite3.connect(db, timeout=0, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute("INSERT INTO t VALUES (2)")
        other.execute("COMMIT")
        return True
    except sqlite3.OperationalError as exc:
        assert "locked" in str(exc)
        return False
    finally:
        other.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "r.db"
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("CREATE TABLE t (x INTEGER)")
        conn.execute("INSERT INTO t VALUES (1)")
    return path


def test_a_reader_reads_a_snapshot_beside_the_writer_and_other_transactions_still_lock(db: Path) -> None:
    engine = make_engine(f"sqlite:///{db}")
    sessions = make_sessionmaker(engine)
    try:
        with sessions() as session:
            with reading():
                assert session.scalar(text("SELECT count(*) FROM t")) == 1
                assert _writer_can_start(db)  # the reader holds no write lock
                assert session.scalar(text("SELECT count(*) FROM t")) == 1  # its snapshot: the new row unseen
                session.rollback()
            # out of `reading` again: the next transaction takes the write lock at its first statement
            assert session.scalar(text("SELECT count(*) FROM t")) == 2
            assert not _writer_can_start(db)
            session.rollback()
            assert _writer_can_start(db)
    finally:
        engine.dispose()


def test_reading_follows_the_context_into_a_worker_thread_and_no_further(db: Path) -> None:
    """As `run_in_threadpool` hands a request's context to its worker thread; a thread started outside it
    (another request) is not a reader."""
    engine = make_engine(f"sqlite:///{db}")
    sessions = make_sessionmaker(engine)
    seen: dict[str, bool] = {}

    def probe(name: str) -> None:
        with sessions() as session:
            session.scalar(text("SELECT 1 FROM t"))
            seen[name] = _writer_can_start(db)
            session.rollback()

    try:
        with reading():
            handed = contextvars.copy_context()
            outside = threading.Thread(target=probe, args=("other thread",))  # starts in a context of its own
        inside = threading.Thread(target=handed.run, args=(probe, "handed context"))
        for thread in (inside, outside):
            thread.start()
            thread.join()
    finally:
        engine.dispose()
    assert seen == {"handed context": True, "other thread": False}


def test_reads_and_searches_that_find_nothing_do_not_queue_behind_a_writer(tmp_path: Path, clock: FakeClock) -> None:
    """A registry read and a weights download answer, an apply executor finds that there is no step to claim,
    and an island that there is no free path, while another process holds SQLite's write lock (as writers they
    would wait out the 60 s busy timeout)."""
    settings = Settings(
        data_dir=tmp_path / "coordinator",
        database_url=f"sqlite:///{tmp_path / 'registry.db'}",
        admin_token=ADMIN,
        join_token=JOIN,  # type: ignore[arg-type]
    )
    with TestClient(create_app(settings, clock=clock)) as client:
        run = create_running_run(client, name="readers")
        module = client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"][0]
        for p in range(run["num_paths"]):  # every path leased: one more island finds no work
            assert lease(client, *join(client, f"busy-{p}")) is not None
        idle = join(client, "idle")
        holder = sqlite3.connect(tmp_path / "registry.db", timeout=0, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            started = time.monotonic()
            for url in (f"/v1/runs/{run['id']}", "/v1/modules", f"/v1/modules/{module['id']}/weights"):
                r = client.get(url, headers=A)
                assert r.status_code == 200, (url, r.text)
            with client.app.state.dipaco.sessions() as session:  # type: ignore[attr-defined]
                assert claim_step(session, "probe", now=clock()) is None
            assert lease(client, *idle) is None
            assert time.monotonic() - started < 10
        finally:
            holder.execute("ROLLBACK")
            holder.close()
