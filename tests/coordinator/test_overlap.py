"""Overlap leases (run field `overlap`): an upload that makes its path's module steps due brings the island's next
lease on that path at once, against the versions those steps will make; the island fetches them from
`GET /v1/leases/{id}/modules` when they land. Through the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from typer.testing import CliRunner

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
