"""Commits that may be lost in a power cut do not wait for the database's log to reach the disk
(`db.without_flush_wait`: SQLite at `synchronous=NORMAL` for that transaction, PostgreSQL `synchronous_commit`
off): a heartbeat and an apply executor's claim of a step. Only those: the transactions after them on the same
connection (an upload's, a step's result) wait for the disk again."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event, select, text

from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Island, ModuleVersion
from coordinator.services import islands
from coordinator.services.apply import ApplyExecutor
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload


class Durability:
    """Whether each statement sent on `engine` ran in a transaction whose commit waits for the disk: SQLite's
    `PRAGMA synchronous` level at the time, and PostgreSQL's `SET LOCAL synchronous_commit TO OFF` until the
    transaction ends."""

    def __init__(self, engine: Engine) -> None:
        self.level = "FULL"
        self.pg_off = False
        self.sent: list[tuple[str, bool]] = []
        event.listen(engine, "before_cursor_execute", self._statement)
        event.listen(engine, "commit", self._ended)
        event.listen(engine, "rollback", self._ended)

    def _statement(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if statement.startswith("PRAGMA synchronous="):
            self.level = statement.partition("=")[2]
        elif statement == "SET LOCAL synchronous_commit TO OFF":
            self.pg_off = True
        self.sent.append((statement, self.level == "FULL" and not self.pg_off))

    def _ended(self, _conn: Any) -> None:
        self.pg_off = False

    def waits(self, *fragments: str) -> list[bool]:
        """For each statement holding every fragment, in order: whether its transaction's commit waits."""
        return [durable for statement, durable in self.sent if all(f in statement for f in fragments)]


def _one_connection(settings: Settings) -> Engine:
    return make_engine(settings.resolved_database_url, pool_size=1, max_overflow=0)  # one connection: reused


def test_a_heartbeat_commits_without_a_flush_wait_and_the_next_transaction_waits_again(
    client: TestClient, settings: Settings, clock: FakeClock
) -> None:
    island_id, _ = join(client, "beat")
    clock.advance(5)
    engine = _one_connection(settings)
    try:
        seen = Durability(engine)
        sessions = make_sessionmaker(engine)
        with sessions() as session:
            assert islands.heartbeats(session, [island_id], now=clock())[island_id] == []
        with sessions() as session:
            beat = session.scalar(select(Island.last_heartbeat).where(Island.id == island_id))
            assert beat is not None and beat.replace(tzinfo=None) == clock().replace(tzinfo=None)
            if engine.dialect.name == "postgresql":
                assert session.scalar(text("SHOW synchronous_commit")) == "on"
            else:
                assert session.scalar(text("PRAGMA synchronous")) == 2  # FULL
        assert seen.waits("UPDATE islands SET last_heartbeat") == [False]
        assert seen.waits("FROM islands") == [True]
    finally:
        engine.dispose()


def test_a_step_claim_commits_without_a_flush_wait_and_the_step_itself_waits(
    no_executors: TestClient, settings: Settings, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="claims")
    for p in range(run["num_paths"]):
        island_id, h = join(client, f"island-{p}")
        body = lease(client, island_id, h)
        assert body is not None
        assert upload(client, body, h, train_lease(client, body, h)).status_code == 200
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    engine = _one_connection(settings)
    try:
        seen = Durability(engine)
        sessions = make_sessionmaker(engine)
        executor = ApplyExecutor(sessions=sessions, blobs=state.blobs, clock=clock, name="test-executor-0")
        assert executor.work() == 6  # embed, 2 + 2 routed, head
        claims = seen.waits("UPDATE module_steps SET status", "claimed_at=")
        results = seen.waits("UPDATE module_steps SET status", "done_at=")
        assert claims == [False] * 6
        assert results == [True] * 6
        assert seen.waits("INSERT INTO module_versions") == [True] * 6
        assert seen.waits("UPDATE contribution_grads") == []  # every part folded in as sent: its row says so
        with sessions() as session:
            assert len(session.scalars(select(ModuleVersion).where(ModuleVersion.version == 1)).all()) == 6
    finally:
        engine.dispose()


def test_a_heartbeat_over_http_commits_without_a_flush_wait(client: TestClient) -> None:
    island_id, h = join(client, "beat-http")
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    seen = Durability(state.sessions.kw["bind"])
    r = client.post(f"/v1/islands/{island_id}/heartbeat", headers=h)
    assert r.status_code == 200, r.text
    assert seen.waits("UPDATE islands SET last_heartbeat") == [False]
