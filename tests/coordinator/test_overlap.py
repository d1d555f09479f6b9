"""Overlap leases (run field `overlap`): an upload that makes its path's module steps due brings the island's next
lease on that path at once, against the versions those steps will make; the island fetches them from
`GET /v1/leases/{id}/modules` when they land. Through the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, func, select
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from coordinator.models import Lease, Run
from coordinator.services import uploads as uploads_service
from coordinator.services.leases import grant_through
from dipaco.cli import app
from tests.conftest import ADMIN, FakeClock
from tests.coordinator.helpers import A, app_executor, create_running_run, join, lease, train_lease, upload
from tests.coordinator.test_registry_cli import _table

runner = CliRunner()

OVERLAP = {"sync": "async", "inner_steps": 2, "num_rounds": 3, "dn_period": 1}
"""All-async: `overlap` on by default."""


def _modules(client: TestClient, run_id: int) -> dict[int, dict[str, Any]]:
    return {m["id"]: m for m in client.get(f"/v1/modules?run_id={run_id}", headers=A).json()["data"]}


def _send(client: TestClient, body: dict[str, Any], h: dict[str, str], **kw: Any) -> Any:
    tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"]
    return upload(client, body, h, train_lease(client, body, h), tokens=tokens, **kw)


def test_an_upload_that_makes_steps_due_brings_a_lease_through_them(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    run = create_running_run(client, name="overlap", **OVERLAP)
    assert run["config"]["schedule"]["overlap"] is True
    (i0, h0), (_, h1) = join(client, "one"), join(client, "other")
    first = lease(client, i0, h0)
    assert first is not None
    reply = _send(client, first, h0, next_lease=True, overlap=True)
    assert reply.status_code == 200, reply.text
    nxt = reply.json()["next_lease"]
    # dn_period 1: the upload made a step due for each of the path's 4 modules; the lease trains through them
    assert nxt is not None and nxt["path_id"] == first["path_id"] and nxt["token_start"] == first["token_end"] - 1
    assert [(m["version"], m["weights_hash"]) for m in nxt["modules"]] == [(1, None)] * 4
    pending = client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=h0)
    assert pending.status_code == 200, pending.text
    assert pending.json()["ready"] is False and all(m["weights_hash"] is None for m in pending.json()["modules"])
    # only its island may ask; an unknown lease is 404
    assert client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=h1).status_code == 403
    assert client.get("/v1/leases/999999/modules", headers=h0).status_code == 404
    assert client.get(f"/v1/leases/{nxt['lease_id']}/modules?wait=61", headers=h0).status_code == 422
    assert app_executor(client, clock).work() == 4
    landed = client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=h0).json()
    current = _modules(client, run["id"])
    assert landed["ready"] is True
    assert [(m["version"], m["weights_hash"]) for m in landed["modules"]] == [
        (1, current[m["module_id"]]["weights_hash"]) for m in landed["modules"]
    ]
    assert all(current[m["module_id"]]["version"] == 1 for m in landed["modules"])
    listed = client.get(f"/v1/leases?run_id={run['id']}", headers=A).json()["data"]
    assert {x["id"]: x["pending_modules"] for x in listed} == {
        first["lease_id"]: None,
        nxt["lease_id"]: [m["module_id"] for m in nxt["modules"]],
    }
    # its upload counts from the versions it trained through: not stale; it says it moved onto them before step 1
    assert _send(client, {**nxt, "modules": landed["modules"]}, h0, rebased_at=1).status_code == 200
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    second = next(c for c in parts if c["lease_id"] == nxt["lease_id"])
    assert [(m["base_version"], m["staleness"], m["rebased_at"]) for m in second["modules"]] == [(1, 0, 1)] * 4
    assert all(m["rebased_at"] is None for c in parts if c is not second for m in c["modules"])
    shown = runner.invoke(app, ["registry", "contributions", "--run-id", str(run["id"]), "--token", ADMIN], obj=client)
    assert shown.exit_code == 0, shown.output
    assert {row["base_versions"] for row in _table(shown.output)} == {
        " ".join(f"{m['module_id']}:v{v}" for m in nxt["modules"]) for v in ("0", "1@1")
    }
    # a submitted lease's modules are no longer served
    assert client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=h0).status_code == 409


def test_a_rebase_step_is_checked_against_the_lease(no_executors: TestClient, clock: FakeClock) -> None:
    """`X-Dipaco-Rebased-At` names an inner step (0..H) of a lease issued with pending module versions: on any
    other lease, out of range or not an integer it is refused with 422 and nothing changes; without it an overlap
    lease's upload records that it trained from its versions throughout (an island that kept no end weights)."""
    client = no_executors
    run = create_running_run(client, name="rebase-checked", **OVERLAP)
    island, h = join(client, "one")
    first = lease(client, island, h)
    assert first is not None
    refused = _send(client, first, h, rebased_at=0)
    assert refused.status_code == 422 and "X-Dipaco-Rebased-At is for overlap leases" in refused.text, refused.text
    nxt = _send(client, first, h, next_lease=True, overlap=True).json()["next_lease"]
    assert nxt is not None and all(m["weights_hash"] is None for m in nxt["modules"])
    app_executor(client, clock).work()
    for bad, why in ((3, r"in [0, 2], got 3"), (-1, "must be in [0,"), ("one", "must be an integer")):
        answer = _send(client, nxt, h, rebased_at=bad)
        assert answer.status_code == 422 and why in answer.text, answer.text
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert [c["lease_id"] for c in parts] == [first["lease_id"]]
    assert _send(client, nxt, h).status_code == 200
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert [m["rebased_at"] for c in parts for m in c["modules"]] == [None] * 8


def test_without_overlap_the_path_is_held_until_its_steps_commit(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    run = create_running_run(client, name="held", **{**OVERLAP, "overlap": False})
    assert run["config"]["schedule"]["overlap"] is False
    island = join(client, "one")
    first = lease(client, *island)
    assert first is not None
    assert _send(client, first, island[1], next_lease=True, overlap=True).json()["next_lease"] is None
    other = lease(client, *island)  # its home path steps: with affinity on, the island waits for it
    assert other is None
    app_executor(client, clock).work()
    again = lease(client, *island)
    assert again is not None and again["path_id"] == first["path_id"]
    assert all(m["weights_hash"] is not None for m in again["modules"])


def test_an_island_that_does_not_ask_gets_no_lease_through_a_step(no_executors: TestClient) -> None:
    client = no_executors
    create_running_run(client, name="asks-not", **OVERLAP)
    island = join(client, "one")
    first = lease(client, *island)
    assert first is not None
    assert _send(client, first, island[1], next_lease=True).json()["next_lease"] is None
    assert lease(client, *island) is None  # a plain lease request never trains through a step


def test_overlap_needs_every_level_async(client: TestClient) -> None:
    r = client.post(
        "/v1/runs",
        json={
            "name": "hybrid",
            "model": {"flavour": "debug"},
            "layout": "embed:shared:async, b0-1:routed2, head:shared",
            "overlap": True,
        },
        headers=A,
    )
    assert r.status_code == 422, r.text
    assert "overlap (training through a path's module step) needs every level async" in r.text
    assert client.get("/v1/runs", headers=A).json()["data"] == []
    layout = "embed:shared:async, b0-1:routed2, head:shared"
    spec = {"name": "hybrid", "model": {"flavour": "debug"}, "layout": layout}
    hybrid = client.post("/v1/runs", json=spec, headers=A)
    assert hybrid.status_code == 201, hybrid.text
    assert hybrid.json()["config"]["schedule"]["overlap"] is False  # on by default only where every level is async


def test_a_lease_may_train_through_steps_another_islands_upload_made_due(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """Periods of 2 on two paths: island B's second upload makes the shared embedding's and head's steps due, which
    holds path 0 too. Island A's upload on path 0, which makes nothing due, brings its next lease on path 0 at
    once: the embedding and head at the versions those steps will make, its routed block as it is."""
    client = no_executors
    layout = "embed:shared, b0-1:routed2, head:shared"
    create_running_run(client, name="others", layout=layout, **{**OVERLAP, "dn_period": 2})
    (ia, ha), (ib, hb) = join(client, "a"), join(client, "b")
    mine, theirs = lease(client, ia, ha), lease(client, ib, hb)
    assert mine is not None and theirs is not None and (mine["path_index"], theirs["path_index"]) == (0, 1)
    assert _send(client, theirs, hb).status_code == 200
    again = lease(client, ib, hb)
    assert again is not None and again["path_index"] == 1
    assert _send(client, again, hb).status_code == 200  # fills the embedding's and head's periods
    assert lease(client, ia, ha) is None  # a plain request: path 0 is held while they step
    reply = _send(client, mine, ha, next_lease=True, overlap=True).json()
    nxt = reply["next_lease"]
    assert nxt is not None and nxt["path_index"] == 0
    assert [(m["level_name"], m["version"], m["weights_hash"] is None) for m in nxt["modules"]] == [
        ("embed", 1, True),
        ("b0-1", 0, False),
        ("head", 1, True),
    ]
    assert client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=ha).json()["ready"] is False
    assert app_executor(client, clock).work() == 3  # and path 1's routed block
    assert client.get(f"/v1/leases/{nxt['lease_id']}/modules?wait=5", headers=ha).json()["ready"] is True


@contextmanager
def commits(client: TestClient) -> Iterator[list[int]]:
    """Counts the database commits made while the block runs (by every connection of the app's engine)."""
    seen: list[int] = []
    engine = client.app.state.dipaco.engine  # type: ignore[attr-defined]

    def count(_conn: object) -> None:
        seen.append(1)

    event.listen(engine, "commit", count)
    try:
        yield seen
    finally:
        event.remove(engine, "commit", count)


def test_the_lease_through_is_committed_with_the_upload(quiet: TestClient, clock: FakeClock) -> None:
    """The next lease an upload's reply brings through its path's steps is granted in the upload's own
    transaction: one commit for both (the lease issued after the upload's checks), where a grant of its own
    after the upload took two; an upload that does not ask commits once too, and brings no lease."""
    client = quiet
    run = create_running_run(client, name="one-commit", **OVERLAP)
    island, h = join(client, "one")
    first = lease(client, island, h)
    assert first is not None
    payload = train_lease(client, first, h)
    with commits(client) as seen:
        reply = upload(client, first, h, payload, next_lease=True, overlap=True)
    assert reply.status_code == 200, reply.text
    nxt = reply.json()["next_lease"]
    assert nxt is not None and nxt["path_id"] == first["path_id"]
    assert len(seen) == 1, f"{len(seen)} commits for an upload and the lease its reply brought"
    listed = {x["id"]: x for x in client.get(f"/v1/leases?run_id={run['id']}", headers=A).json()["data"]}
    contribution = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"][0]
    assert listed[nxt["lease_id"]]["issued_at"] >= contribution["created_at"]
    assert listed[first["lease_id"]]["status"] == "submitted" and listed[nxt["lease_id"]]["status"] == "active"
    app_executor(client, clock).work()
    landed = {**nxt, "modules": client.get(f"/v1/leases/{nxt['lease_id']}/modules", headers=h).json()["modules"]}
    payload = train_lease(client, landed, h)
    with commits(client) as seen:
        plain = upload(client, landed, h, payload)
    assert plain.status_code == 200 and plain.json()["next_lease"] is None and len(seen) == 1


def test_a_grant_that_fails_leaves_the_upload_accepted_and_no_lease(
    no_executors: TestClient, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is granted in a savepoint of the upload's transaction: a grant that fails after writing its lease
    takes only the lease back; the upload is accepted, its reply has no lease, and the island asks as usual."""
    client = no_executors
    run = create_running_run(client, name="grant-fails", **OVERLAP)
    island, h = join(client, "one")
    first = lease(client, island, h)
    assert first is not None

    def grant_then_fail(session: Session, *args: Any, **kwargs: Any) -> Any:
        granted = grant_through(session, *args, **kwargs)
        assert granted is not None  # written and flushed: the savepoint must take it back
        assert session.scalar(select(func.count()).select_from(Lease)) == 2
        raise RuntimeError("injected: the grant failed after writing its lease")

    monkeypatch.setattr(uploads_service, "grant_through", grant_then_fail)
    reply = _send(client, first, h, next_lease=True, overlap=True)
    assert reply.status_code == 200, reply.text
    assert reply.json()["next_lease"] is None
    listed = client.get(f"/v1/leases?run_id={run['id']}", headers=A).json()["data"]
    assert [(x["id"], x["status"]) for x in listed] == [(first["lease_id"], "submitted")]
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert [(c["lease_id"], c["status"]) for c in parts] == [(first["lease_id"], "accepted")]
    assert lease(client, island, h) is None  # its path steps: a plain request waits for that
    assert app_executor(client, clock).work() == 4
    again = lease(client, island, h)
    assert again is not None and again["path_id"] == first["path_id"]
    assert all(m["weights_hash"] is not None for m in again["modules"])


def test_an_upload_that_grants_a_lease_takes_the_run_row_as_a_grant_does(no_executors: TestClient) -> None:
    """On PostgreSQL a plain upload takes the run row FOR KEY SHARE (uploads side by side); one that asks for a lease
    through its path takes it FOR UPDATE from the start, as an async lease grant does: grants stay serialised (two
    must not plan on the same snapshot), and it never holds the shared lock while asking for the exclusive one (two
    such uploads would deadlock). So it waits while another upload holds the row, and a plain one does not."""
    client = no_executors
    engine = client.app.state.dipaco.engine  # type: ignore[attr-defined]
    if engine.dialect.name != "postgresql":
        pytest.skip("row lock modes are PostgreSQL's; SQLite serialises every writer with BEGIN IMMEDIATE")
    run = create_running_run(client, name="lock-mode", lease_ttl_s=600, **OVERLAP)
    islands = [join(client, name) for name in ("a", "b")]
    firsts = [lease(client, iid, h) for iid, h in islands]
    bodies = [b for b in firsts if b is not None]
    assert len(bodies) == 2
    payloads = [train_lease(client, body, h) for body, (_, h) in zip(bodies, islands, strict=True)]
    for p, through in ((0, False), (1, True)):
        with engine.connect() as other, ThreadPoolExecutor(max_workers=1) as pool:
            other.execute(select(Run.id).where(Run.id == run["id"]).with_for_update(read=True, key_share=True))
            sent = pool.submit(
                upload, client, bodies[p], islands[p][1], payloads[p], next_lease=through, overlap=through
            )
            done, _ = wait([sent], timeout=1.5 if through else 15)
            if through:
                assert not done, "an upload that grants a lease went past another upload's shared lock"
            else:
                assert done and sent.result().status_code == 200, "a plain upload waited for another's shared lock"
            other.rollback()
            reply = sent.result(timeout=15)
        assert reply.status_code == 200, reply.text
        assert (reply.json()["next_lease"] is not None) is through
