"""What one upload costs the database, and the probe that follows its commit (services/rounds.after_upload).

Under 256 islands the upload's tail latency was its SQL: 18 statements, half of them the same reads before the
payload validation and again under the run lock. It is 9 now (docs/LOG.md, 2026-12-03); this keeps it there."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from coordinator.models import Run
from coordinator.services.rounds import after_upload
from tests.conftest import FakeClock
from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload

UPLOAD_STATEMENTS = 9
"""Two reads before validation (lease with run, prior contribution and round status; the path's modules), the
run lock, the same read again, four writes (contribution, its parts, lease, path), the close probe."""


@contextmanager
def counted(client: TestClient) -> Iterator[list[str]]:
    seen: list[str] = []
    engine = client.app.state.dipaco.engine  # type: ignore[attr-defined]

    def count(_conn: object, _cursor: object, statement: str, *_: object) -> None:
        if not statement.startswith("BEGIN"):  # SQLite's BEGIN IMMEDIATE (`db.make_engine`)
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", count)


def test_an_upload_takes_nine_statements_and_the_closing_one_reports_the_round(quiet: TestClient) -> None:
    client = quiet
    run = create_running_run(client)
    islands = [join(client, f"i{p}") for p in range(run["num_paths"])]
    leases = [lease(client, iid, h) for iid, h in islands]
    payloads = [train_lease(client, body, h) for body, (_, h) in zip(leases, islands, strict=True)]
    answers = []
    for p, (body, (_, h)) in enumerate(zip(leases, islands, strict=True)):
        with counted(client) as statements:
            r = upload(client, body, h, payloads[p])
        assert r.status_code == 200, r.text
        answers.append(r.json())
        if p < run["num_paths"] - 1:
            assert len(statements) <= UPLOAD_STATEMENTS, statements
    assert [a["round_applied"] for a in answers] == [False] * (run["num_paths"] - 1) + [True]
    # a retry of an accepted upload: the same contribution, no close probe, not "applied" again
    with counted(client) as statements:
        again = upload(client, leases[0], islands[0][1], payloads[0])
    assert again.status_code == 200 and again.json()["id"] == answers[0]["id"]
    assert again.json()["round_applied"] is False
    assert len(statements) <= 3, statements


def test_after_upload_tells_open_ready_and_closed(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    run = create_running_run(client, quorum=0.5, round_deadline_s=60, lease_ttl_s=600)
    sessions = client.app.state.dipaco.sessions  # type: ignore[attr-defined]
    islands = [join(client, f"i{p}") for p in range(2)]
    for iid, h in islands:
        body = lease(client, iid, h)
        assert body is not None
        assert upload(client, body, h, train_lease(client, body, h)).json()["round_applied"] is False
    with sessions() as session:
        assert after_upload(session, run["id"], 0, clock()) == "open"  # 2 of 4 in, before the deadline
        clock.advance(61)
        assert after_upload(session, run["id"], 0, clock()) == "ready"  # past it, with the quorum of 2
        assert after_upload(session, run["id"], 1, clock()) == "open"  # a round not opened yet
    assert client.app.state.dipaco.closer.closed_with(sessions(), run["id"], 0, now=clock())  # type: ignore[attr-defined]
    with sessions() as session:
        assert after_upload(session, run["id"], 0, clock()) == "closed"


LEASE_STATEMENTS = 9
"""The island (auth), a pending offer, the open rounds, the unlocked free-path probe, the run lock, the free path
again with its shard and the stale-lease flag, the island's capacity, the path's modules, the insert."""


def test_a_lease_grant_takes_nine_statements(quiet: TestClient) -> None:
    client = quiet
    run = create_running_run(client, lease_ttl_s=600)
    islands = [join(client, f"i{p}") for p in range(run["num_paths"] - 1)]
    held = []
    for iid, h in islands:
        with counted(client) as statements:
            body = lease(client, iid, h)
        assert body is not None
        held.append(body["lease_id"])
        assert len(statements) <= LEASE_STATEMENTS, statements
    # a path is still free, and the island's capacity (one lease at a time by default) refuses it, naming the lease
    iid, h = islands[0]
    r = client.post(f"/v1/islands/{iid}/lease", headers=h)
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == (
        f"island {iid} already holds 1 lease(s) ({held[0]}), as many as it may at once; upload or release one first"
    )


def test_an_upload_passes_a_lease_grants_run_lock_and_waits_for_a_closes(quiet: TestClient) -> None:
    """On PostgreSQL a grant locks the run row FOR NO KEY UPDATE and an upload FOR KEY SHARE: an upload never
    queues behind lease grants, while a close or a step commit (FOR UPDATE) still excludes it."""
    client = quiet
    engine = client.app.state.dipaco.engine  # type: ignore[attr-defined]
    if engine.dialect.name != "postgresql":
        pytest.skip("row lock modes are PostgreSQL's; SQLite serialises every writer with BEGIN IMMEDIATE")
    run = create_running_run(client, lease_ttl_s=600)
    islands = [join(client, f"i{p}") for p in range(2)]
    leases = [lease(client, iid, h) for iid, h in islands]
    assert all(body is not None for body in leases)
    payloads = [train_lease(client, body, h) for body, (_, h) in zip(leases, islands, strict=True)]  # type: ignore[arg-type]

    def upload_in_thread(p: int) -> tuple[threading.Thread, list[int]]:
        codes: list[int] = []
        worker = threading.Thread(
            target=lambda: codes.append(upload(client, leases[p], islands[p][1], payloads[p]).status_code)  # type: ignore[arg-type]
        )
        worker.start()
        return worker, codes

    for key_share, p in ((True, 0), (False, 1)):  # a grant's lock, then a close's
        with engine.connect() as other:
            other.execute(select(Run.id).where(Run.id == run["id"]).with_for_update(key_share=key_share))
            worker, codes = upload_in_thread(p)
            worker.join(timeout=1.5 if not key_share else 15)
            if key_share:
                assert not worker.is_alive() and codes == [200], "an upload waited for a lease grant's lock"
            else:
                assert worker.is_alive(), "an upload went past a close's lock"
            other.rollback()
        worker.join(timeout=15)
        assert codes == [200]
