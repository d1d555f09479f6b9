"""A heartbeat's transaction commits without waiting for the WAL flush on PostgreSQL (`synchronous_commit` off),
and only that transaction: the next one on the same connection (an upload's, say) is durable again."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import event, select, text

from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Island
from coordinator.services import islands
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.helpers import join


def test_a_heartbeat_is_recorded_and_leaves_the_connection_durable(
    client: TestClient, settings: Settings, clock: FakeClock
) -> None:
    island_id, _ = join(client, "beat")
    clock.advance(5)
    engine = make_engine(settings.resolved_database_url, pool_size=1, max_overflow=0)  # one connection: reused
    try:
        sent: list[str] = []
        event.listen(engine, "before_cursor_execute", lambda _c, _cur, statement, *_: sent.append(statement))
        sessions = make_sessionmaker(engine)
        with sessions() as session:
            assert islands.heartbeat(session, island_id, now=clock()) == []
        postgres = engine.dialect.name == "postgresql"
        assert ("SET LOCAL synchronous_commit TO OFF" in sent) == postgres
        with sessions() as session:
            seen = session.scalar(select(Island.last_heartbeat).where(Island.id == island_id))
            assert seen is not None and seen.replace(tzinfo=None) == clock().replace(tzinfo=None)
            if postgres:
                assert session.scalar(text("SHOW synchronous_commit")) == "on"
    finally:
        engine.dispose()
