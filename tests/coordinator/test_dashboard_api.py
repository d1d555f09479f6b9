"""The reads the dashboard polls (history, run stats, leases, events), the events the coordinator records (lease
expiries, refused uploads, revocations) and the dashboard's files, through the real app on SQLite and
PostgreSQL with the fake clock."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.client import CoordinatorClient, RetryPolicy
from coordinator.states import EventKind, LeaseStatus, RoundStatus
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied

LOSSES = [4.0, 5.0, 6.0, 7.0]
"""Train loss each path reports in round 0 (by path index)."""


def _complete_round_zero(client: TestClient, clock: FakeClock) -> tuple[int, dict[str, str], dict[str, Any]]:
    """A running 2x2 run whose round 0 one island completes in 5 s (loss by path: LOSSES); returns the island,
    its headers and the run."""
    run = create_running_run(client, lease_ttl_s=30)
    island_id, h = join(client, "a")
    for i in range(4):
        lb = lease(client, island_id, h)
        assert lb is not None
        if i == 3:
            clock.advance(5)
        r = upload(client, lb, h, train_lease(client, lb, h), loss=LOSSES[lb["path_index"]], tokens=32)
        assert r.status_code == 200, r.text
    wait_applied(client, run["id"])
    return island_id, h, run


def test_history_holds_every_paths_loss_per_round(client: TestClient, clock: FakeClock) -> None:
    island_id, h, run = _complete_round_zero(client, clock)
    lb = lease(client, island_id, h)  # round 1: one path done, the run goes on
    assert lb is not None and lb["round"] == 1
    assert upload(client, lb, h, train_lease(client, lb, h), loss=3.5).status_code == 200

    r = client.get(f"/v1/runs/{run['id']}/history", headers=A)
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["run_id"], body["num_paths"], body["num_rounds"], body["current_round"], body["count"]) == (
        run["id"],
        4,
        3,
        1,
        2,
    )
    zero, one = body["data"]
    assert (zero["number"], zero["status"], zero["contributions"], zero["quorum_paths"]) == (0, "applied", 4, 4)
    assert [(x["path_index"], x["train_loss"], x["tokens"], x["island_id"]) for x in zero["losses"]] == [
        (p, LOSSES[p], 32, island_id) for p in range(4)
    ]
    assert zero["applied_at"] is not None and zero["applied_at"] > zero["opened_at"]
    assert (one["number"], one["status"], one["contributions"], one["applied_at"]) == (1, "open", 1, None)
    assert [(x["path_index"], x["train_loss"]) for x in one["losses"]] == [(lb["path_index"], 3.5)]

    # a page from round 1 on: what a poller asks once round 0 is applied
    page = client.get(f"/v1/runs/{run['id']}/history", params={"offset": 1}, headers=A).json()
    assert page["count"] == 2 and [x["number"] for x in page["data"]] == [1]


def test_history_and_lists_refuse_bad_input_with_a_specific_detail(client: TestClient) -> None:
    run = create_running_run(client)
    missing = client.get("/v1/runs/999/history", headers=A)
    assert missing.status_code == 404 and missing.json()["detail"] == "run 999 does not exist"
    for url in ("/v1/events", "/v1/leases"):
        r = client.get(url, params={"run_id": 999}, headers=A)
        assert r.status_code == 404 and r.json()["detail"] == "run 999 does not exist", url
    for url, params in [
        (f"/v1/runs/{run['id']}/history", {"limit": 0}),
        (f"/v1/runs/{run['id']}/history", {"limit": 1001}),
        ("/v1/events", {"after": -1}),
        ("/v1/events", {"order": "sideways"}),
        ("/v1/events", {"kind": "party"}),
        ("/v1/leases", {"status": "lost"}),
        ("/v1/leases", {"run_id": 2**63}),
        ("/v1/run-stats", {"limit": 5000}),
        ("/v1/events", {"offset": 2**63}),
    ]:
        r = client.get(url, params=params, headers=A)
        assert r.status_code == 422, (url, params, r.text)
        assert str(next(iter(params))) in r.text, (url, params, r.text)  # the detail names the parameter
    for url in (f"/v1/runs/{run['id']}/history", "/v1/run-stats", "/v1/leases", "/v1/events"):
        assert client.get(url).status_code == 401, url
        assert client.get(url, headers={"Authorization": "Bearer not-a-token-at-all"}).status_code == 401, url


def test_run_stats_and_active_leases(client: TestClient, clock: FakeClock) -> None:
    island_id, h, run = _complete_round_zero(client, clock)
    lb = lease(client, island_id, h)
    assert lb is not None

    stats = client.get("/v1/run-stats", headers=A).json()
    assert stats["count"] == 1
    (s,) = stats["data"]
    assert (s["run_id"], s["rounds_applied"], s["tokens_trained"], s["islands_active"]) == (run["id"], 1, 4 * 32, 1)
    assert s["latest_train_loss"] == pytest.approx(sum(LOSSES) / 4)
    assert s["mean_round_s"] == pytest.approx(5, abs=0.01) and s["last_round_s"] == pytest.approx(5, abs=0.01)

    active = client.get("/v1/leases", params={"status": "active"}, headers=A).json()
    assert active["count"] == 1
    (a,) = active["data"]
    assert (a["id"], a["island_id"], a["run_id"], a["round"], a["path_index"], a["status"]) == (
        lb["lease_id"],
        island_id,
        run["id"],
        1,
        lb["path_index"],
        "active",
    )
    every = client.get("/v1/leases", params={"run_id": run["id"], "limit": 2}, headers=A).json()
    assert every["count"] == 5 and [x["id"] for x in every["data"]] == [lb["lease_id"], lb["lease_id"] - 1]

    # an island that stopped heartbeating no longer counts as active on the run
    clock.advance(31)
    (s,) = client.get("/v1/run-stats", headers=A).json()["data"]
    assert s["islands_active"] == 0


def test_refused_uploads_expiries_and_revocations_are_events(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client, lease_ttl_s=30)
    a_id, ah = join(client, "a")
    b_id, bh = join(client, "b")
    la = lease(client, a_id, ah)
    assert la is not None

    bad = upload(client, la, ah, b"not a safetensors file")
    assert bad.status_code == 422
    unknown = client.post(
        "/v1/leases/999/outer-gradients",
        content=b"x",
        headers={
            **ah,
            "X-Dipaco-Tokens": "1",
            "X-Dipaco-Train-Loss": "1.0",
            "Content-Type": "application/octet-stream",
        },
    )
    assert unknown.status_code == 404
    clock.advance(31)  # a's lease runs out; b's request finds it stale and takes the path
    lb = lease(client, b_id, bh)
    assert lb is not None and lb["path_index"] == la["path_index"]
    assert client.delete(f"/v1/islands/{a_id}", headers=A).status_code == 204  # revoked

    events = client.get("/v1/events", headers=A).json()
    assert events["count"] == 4
    refused, unknown_lease, expired, revoked = events["data"]
    assert (refused["kind"], refused["run_id"], refused["island_id"], refused["lease_id"]) == (
        "upload_refused",
        run["id"],
        a_id,
        la["lease_id"],
    )
    assert (refused["round"], refused["path_index"]) == (0, la["path_index"])
    assert refused["detail"] == f"HTTP 422: {bad.json()['detail']}"
    assert (unknown_lease["kind"], unknown_lease["run_id"], unknown_lease["lease_id"]) == ("upload_refused", None, 999)
    assert unknown_lease["detail"] == "HTTP 404: lease 999 does not exist"
    assert (expired["kind"], expired["lease_id"], expired["island_id"], expired["round"]) == (
        "lease_expired",
        la["lease_id"],
        a_id,
        0,
    )
    assert "expired without an upload" in expired["detail"]
    assert (revoked["kind"], revoked["island_id"], revoked["run_id"]) == ("island_revoked", a_id, None)
    assert revoked["detail"] == "island 1 (a) was revoked by an admin; 0 pending lease(s) went back to the pool"
    assert [e["id"] for e in events["data"]] == sorted(e["id"] for e in events["data"])

    # the cursor and the filters
    newer = client.get("/v1/events", params={"after": unknown_lease["id"]}, headers=A).json()
    assert newer["count"] == 2 and [e["kind"] for e in newer["data"]] == ["lease_expired", "island_revoked"]
    newest = client.get("/v1/events", params={"order": "desc", "limit": 1}, headers=A).json()
    assert newest["count"] == 4 and [e["id"] for e in newest["data"]] == [revoked["id"]]
    of_run = client.get("/v1/events", params={"run_id": run["id"]}, headers=A).json()
    assert [e["id"] for e in of_run["data"]] == [refused["id"], expired["id"]]
    kind = client.get("/v1/events", params={"kind": "upload_refused"}, headers=A).json()
    assert kind["count"] == 2

    # the round's counts in the history
    (zero,) = client.get(f"/v1/runs/{run['id']}/history", headers=A).json()["data"]
    assert (zero["refused_uploads"], zero["lease_expiries"]) == (1, 1)
    # a refused upload changed nothing else: round 0 has no contribution
    assert zero["contributions"] == 0 and zero["status"] == RoundStatus.OPEN


def test_an_untaken_offer_expiring_is_an_event(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client)
    a_id, ah = join(client, "a")
    for _ in range(4):
        lb = lease(client, a_id, ah)
        assert lb is not None
        assert upload(client, lb, ah, train_lease(client, lb, ah)).status_code == 200
    wait_applied(client, run["id"])
    clock.advance(11)  # a's offers for round 1 (path reservation: 10 s) are not taken up
    b_id, bh = join(client, "b")
    assert lease(client, b_id, bh) is not None
    expired = client.get("/v1/events", params={"run_id": run["id"], "kind": "lease_expired"}, headers=A).json()
    assert expired["count"] == 1
    (e,) = expired["data"]
    assert e["island_id"] == a_id and e["round"] == 1 and "was not taken up in time" in e["detail"]


def test_typed_client_reads_the_dashboard_endpoints(client: TestClient, clock: FakeClock) -> None:
    island_id, h, run = _complete_round_zero(client, clock)
    lb = lease(client, island_id, h)
    assert lb is not None
    assert upload(client, lb, h, b"garbage").status_code == 422
    with CoordinatorClient("http://testserver", A["Authorization"][7:], http=client, retry=RetryPolicy.once()) as c:
        c.page_size = 1  # every call walks pages
        history = c.history(run["id"])
        assert history.count == 2 and [r.number for r in history.data] == [0, 1]
        assert [x.train_loss for x in history.data[0].losses] == LOSSES
        assert [r.number for r in c.history(run["id"], from_round=1).data] == [1]
        (stats,) = c.run_stats()
        assert stats.rounds_applied == 1
        assert [x.id for x in c.leases(status=LeaseStatus.ACTIVE)] == [lb["lease_id"]]
        assert len(c.leases(run_id=run["id"])) == 5
        (refused,) = c.events(kind=EventKind.UPLOAD_REFUSED)
        assert refused.lease_id == lb["lease_id"] and refused.detail.startswith("HTTP 422: outer-gradient payload")
        assert c.events(after=refused.id) == []


def test_dashboard_files_are_served_without_a_token_and_nothing_else(client: TestClient) -> None:
    redirect = client.get("/ui", follow_redirects=False)
    assert redirect.status_code == 307 and redirect.headers["location"] == "ui/"
    page = client.get("/ui/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "script-src 'self'" in csp
    # everything the page loads is shipped here: no other origin
    for needle in ('src="http', "src='http", 'href="http', "href='http", "//cdn", "@import"):
        assert needle not in page.text, needle
    for name, media in [
        ("app.js", "text/javascript"),
        ("app.css", "text/css"),
        ("vendor/uPlot.iife.min.js", "text/javascript"),
        ("vendor/uPlot.min.css", "text/css"),
        ("vendor/uPlot.LICENSE", "text/plain"),
    ]:
        r = client.get(f"/ui/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(media), name
        if not name.endswith("LICENSE"):
            assert f'="{name}"' in page.text, name  # what the page loads
    again = client.get("/ui/app.js", headers={"If-None-Match": client.get("/ui/app.js").headers["etag"]})
    assert again.status_code == 304
    for name in ("nope.js", "../app.py", "..%2Fapp.py", "vendor", "vendor/", "/etc/passwd", "static/app.js"):
        r = client.get(f"/ui/{name}")
        assert r.status_code == 404, (name, r.status_code)
