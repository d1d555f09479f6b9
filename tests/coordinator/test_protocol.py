"""The round protocol through the real app on SQLite and PostgreSQL: runs, shards, leases, uploads, apply."""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from coordinator.errors import Conflict
from coordinator.models import Lease
from coordinator.services import leases
from modules import OuterConfig, decode, nesterov_step
from tests.conftest import FakeClock
from tests.coordinator.helpers import (
    TINY_RUN,
    A,
    J,
    create_running_run,
    eventually,
    join,
    lease,
    train_lease,
    upload,
    wait_applied,
)


def test_create_run_registers_modules_paths_and_round_zero(client: TestClient) -> None:
    run = client.post("/v1/runs", json=TINY_RUN, headers=A).json()
    assert run["status"] == "waiting_for_shards" and run["num_paths"] == 4
    modules = client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()
    assert modules["count"] == 6  # embed, 2 + 2 routed, head
    assert [(m["level"], m["index"], m["version"]) for m in modules["data"]] == [
        (0, 0, 0),
        (1, 0, 0),
        (1, 1, 0),
        (2, 0, 0),
        (2, 1, 0),
        (3, 0, 0),
    ]
    # every module of a level starts from the same weights (paper §2.2)
    assert modules["data"][1]["weights_hash"] == modules["data"][2]["weights_hash"]
    paths = client.get(f"/v1/paths?run_id={run['id']}", headers=A).json()
    assert paths["count"] == 4
    assert [p["module_indices"] for p in paths["data"]] == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 1, 0, 0], [0, 1, 1, 0]]
    assert client.get(f"/v1/runs/{run['id']}/rounds", headers=A).json()["count"] == 0  # opens with the shards
    level1 = client.get(f"/v1/modules?run_id={run['id']}&level=1", headers=A).json()
    assert level1["count"] == 2


def test_run_input_errors_name_the_problem(client: TestClient) -> None:
    bad = client.post("/v1/runs", json={**TINY_RUN, "layout": "embed:shared, b0-0:routed2, head:shared"}, headers=A)
    assert bad.status_code == 422
    assert bad.json()["detail"] == "layout: blocks [1] are in no level; every block must belong to exactly one level"
    assert client.post("/v1/runs", json=TINY_RUN, headers=A).status_code == 201
    dup = client.post("/v1/runs", json=TINY_RUN, headers=A)
    assert dup.status_code == 409 and dup.json()["detail"] == "a run named 'tiny' already exists"
    assert client.get("/v1/runs", headers=A).json()["count"] == 1


def test_auth_scopes(client: TestClient) -> None:
    assert client.get("/v1/runs").status_code == 401
    assert client.get("/v1/runs").json()["detail"] == "missing bearer token: send 'Authorization: Bearer <token>'"
    wrong = client.get("/v1/runs", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["detail"] == "unknown token"
    scope = client.post("/v1/runs", json=TINY_RUN, headers=J)
    assert scope.status_code == 403
    assert scope.json()["detail"] == "this needs a token of scope admin, got one of scope join"
    island_id, h = join(client)
    other_id, _ = join(client, "other")
    assert client.post(f"/v1/islands/{other_id}/lease", headers=h).status_code == 403
    assert client.get("/v1/islands", headers=h).json()["count"] == 2


def test_shard_validation(client: TestClient) -> None:
    run = client.post("/v1/runs", json=TINY_RUN, headers=A).json()
    odd = client.post(f"/v1/runs/{run['id']}/shards/0?num_documents=1", content=b"\x01\x02\x03", headers=A)
    assert odd.status_code == 422 and "2-byte (uint16) tokens" in odd.json()["detail"]
    big = client.post(
        f"/v1/runs/{run['id']}/shards/0?num_documents=1", content=(300).to_bytes(2, "little") * 200, headers=A
    )
    assert big.status_code == 422
    assert big.json()["detail"] == "shard holds token id 300, the model's vocabulary is 257"
    short = client.post(f"/v1/runs/{run['id']}/shards/0?num_documents=1", content=b"\x01\x00" * 10, headers=A)
    assert short.status_code == 422 and "one round needs 65" in short.json()["detail"]
    missing = client.post(f"/v1/runs/{run['id']}/shards/9?num_documents=1", content=b"\x01\x00" * 100, headers=A)
    assert missing.status_code == 404
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "waiting_for_shards"


def test_full_round_applies_nesterov_on_the_mean_outer_gradient(client: TestClient) -> None:
    run = create_running_run(client)
    island_id, h = join(client)
    before = {m["id"]: m for m in client.get("/v1/modules", headers=A).json()["data"]}
    uploads: dict[int, list[dict[str, torch.Tensor]]] = {mid: [] for mid in before}
    seen_paths = []
    for _ in range(4):
        lb = lease(client, island_id, h)
        assert lb is not None
        seen_paths.append(lb["path_index"])
        grads = train_lease(client, lb, h)
        r = upload(client, lb, h, grads)
        assert r.status_code == 200, r.text
        for m in lb["modules"]:
            prefix = m["level_name"] + "/"
            uploads[m["module_id"]].append({k[len(prefix) :]: v for k, v in grads.items() if k.startswith(prefix)})
    assert sorted(seen_paths) == [0, 1, 2, 3]
    assert r.json()["round_applied"] is True  # this upload completed the round; the executors apply it
    wait_applied(client, run["id"])
    after = {m["id"]: m for m in client.get("/v1/modules", headers=A).json()["data"]}
    assert all(m["version"] == 1 for m in after.values())
    outer = OuterConfig()
    for mid, grads_list in uploads.items():
        base = decode(client.get(f"/v1/modules/{mid}/weights?version=0", headers=A).content)
        mean = {k: sum(g[k] for g in grads_list) / len(grads_list) for k in base}
        expected, _ = nesterov_step(base, mean, None, outer)
        got = decode(client.get(f"/v1/modules/{mid}/weights", headers=A).content)
        for k in base:
            torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-6)
    # shared modules saw 4 paths, routed modules 2
    assert len(uploads[1]) == 4 and len(uploads[2]) == 2
    rounds = client.get(f"/v1/runs/{run['id']}/rounds", headers=A).json()["data"]
    assert [(r["number"], r["status"], r["contributions"]) for r in rounds] == [(0, "applied", 4), (1, "open", 0)]


def test_duplicate_upload_is_a_noop_and_closed_round_gets_409(client: TestClient) -> None:
    create_running_run(client)
    island_id, h = join(client)
    first = lease(client, island_id, h)
    assert first is not None
    grads = train_lease(client, first, h)
    r1 = upload(client, first, h, grads)
    r2 = upload(client, first, h, grads)
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["id"] == r2.json()["id"]
    # a second island holds a lease of round 0 while the round completes without it
    other_id, oh = join(client, "slow")
    slow = lease(client, other_id, oh)
    assert slow is not None
    client.post(f"/v1/leases/{slow['lease_id']}/release", headers=oh)
    for _ in range(3):
        lb = lease(client, island_id, h)
        assert lb is not None
        assert upload(client, lb, h, train_lease(client, lb, h)).status_code == 200
    wait_applied(client, slow["run_id"])
    late = upload(client, slow, oh, grads)
    assert late.status_code == 409
    assert late.json()["detail"] == f"lease {slow['lease_id']} was issued for round 0, the run is at round 1"


def test_expired_lease_returns_path_to_pool_and_range_is_reissued(client: TestClient, clock: FakeClock) -> None:
    create_running_run(client, lease_ttl_s=30)
    a_id, ah = join(client, "a", max_leases=4)
    b_id, bh = join(client, "b", max_leases=4)
    leases_a = [lease(client, a_id, ah) for _ in range(4)]
    assert all(lb is not None for lb in leases_a)
    assert lease(client, b_id, bh) is None  # every path is taken
    clock.advance(20)
    assert client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah).json()["active_lease_ids"] == [
        lb["lease_id"] for lb in leases_a if lb
    ]
    clock.advance(20)  # heartbeat extended to t=50; not expired yet at t=40
    assert lease(client, b_id, bh) is None
    clock.advance(31)
    again = lease(client, b_id, bh)
    assert again is not None and again["path_index"] == 0
    first = leases_a[0]
    assert first is not None
    assert (again["token_start"], again["token_end"]) == (first["token_start"], first["token_end"])
    hb = client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah).json()
    assert hb["active_lease_ids"] == []


def test_release_frees_the_path_at_once(client: TestClient) -> None:
    create_running_run(client)
    a_id, ah = join(client, "a", max_leases=4)
    b_id, bh = join(client, "b", max_leases=4)
    taken = [lease(client, a_id, ah) for _ in range(4)]
    assert lease(client, b_id, bh) is None
    first = taken[0]
    assert first is not None
    r = client.post(f"/v1/leases/{first['lease_id']}/release", headers=ah)
    assert r.status_code == 200 and r.json() == {"lease_id": first["lease_id"], "status": "released"}
    got = lease(client, b_id, bh)
    assert got is not None and got["path_index"] == first["path_index"]


def test_leave_releases_leases_and_revoked_token_is_refused(client: TestClient) -> None:
    create_running_run(client)
    a_id, ah = join(client, "a")
    assert lease(client, a_id, ah) is not None
    assert client.delete(f"/v1/islands/{a_id}", headers=A).status_code == 204
    refused = client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah)
    assert refused.status_code == 401 and refused.json()["detail"] == f"island {a_id}'s token was revoked"
    b_id, bh = join(client, "b")
    got = lease(client, b_id, bh)
    assert got is not None and got["path_index"] == 0


def test_data_cursor_advances_and_wraps_into_a_new_epoch(client: TestClient) -> None:
    # 2 steps x batch 2 x seq 16 + 1 = 65 tokens a lease; 100 tokens hold one lease, then wrap.
    create_running_run(client, num_tokens=100)
    island_id, h = join(client)
    ranges = []
    for _ in range(8):
        lb = lease(client, island_id, h, wait=10)  # across the apply of round 0
        assert lb is not None
        if lb["path_index"] == 0:
            ranges.append((lb["epoch"], lb["token_start"], lb["token_end"]))
        assert upload(client, lb, h, train_lease(client, lb, h)).status_code == 200
    assert ranges == [(0, 0, 65), (1, 0, 65)]


def test_run_finishes_and_islands_are_told(client: TestClient) -> None:
    run = create_running_run(client, num_rounds=1)
    island_id, h = join(client)
    for _ in range(4):
        lb = lease(client, island_id, h)
        assert lb is not None
        upload(client, lb, h, train_lease(client, lb, h))
    assert wait_applied(client, run["id"])["status"] == "finished"
    r = client.post(f"/v1/islands/{island_id}/lease", headers=h)
    assert r.status_code == 204 and r.headers["X-Dipaco-Idle"] == "no-running-runs"


def test_weights_etag_and_history(client: TestClient) -> None:
    create_running_run(client)
    r = client.get("/v1/modules/1/weights", headers=A)
    etag = r.headers["ETag"]
    assert client.get("/v1/modules/1/weights", headers={**A, "If-None-Match": etag}).status_code == 304
    missing = client.get("/v1/modules/1/weights?version=7", headers=A)
    assert missing.status_code == 404
    assert missing.json()["detail"] == "module 1 has no version 7; current version is 0"


def test_round_closes_by_deadline_and_quorum_with_one_path_missing(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client, quorum=0.75, round_deadline_s=60, lease_ttl_s=600)
    island_id, h = join(client)
    straggler_id, sh = join(client, "straggler")
    held = lease(client, straggler_id, sh)  # path 0 is held and never uploaded
    assert held is not None and held["path_index"] == 0
    for _ in range(3):
        lb = lease(client, island_id, h)
        assert lb is not None
        assert upload(client, lb, h, train_lease(client, lb, h)).json()["round_applied"] is False
    clock.advance(59)
    assert lease(client, island_id, h) is None  # before the deadline: wait for all paths
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    clock.advance(2)
    assert lease(client, island_id, h) is None  # this lease request closes the round: 3 of 4 >= quorum 0.75
    nxt = lease(client, island_id, h, wait=10)  # and round 1 opens once the executors applied round 0
    assert nxt is not None and nxt["round"] == 1
    rounds = client.get(f"/v1/runs/{run['id']}/rounds", headers=A).json()["data"]
    assert [(r["number"], r["status"], r["contributions"]) for r in rounds] == [(0, "applied", 3), (1, "open", 0)]
    modules = {(m["level"], m["index"]): m["version"] for m in client.get("/v1/modules", headers=A).json()["data"]}
    # path 0 = modules (0, 0, 0, 0): level 1/2 module 0 still got path 1 / path 2 respectively
    assert modules == {(0, 0): 1, (1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1, (3, 0): 1}
    late = upload(client, held, sh, train_lease(client, held, sh))
    assert late.status_code == 409
    assert late.json()["detail"] == f"lease {held['lease_id']} was issued for round 0, the run is at round 1"


def test_round_past_deadline_without_quorum_stays_open(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client, quorum=0.75, round_deadline_s=10)
    island_id, h = join(client)
    for _ in range(2):
        lb = lease(client, island_id, h)
        assert lb is not None
        upload(client, lb, h, train_lease(client, lb, h))
    clock.advance(100)
    lb = lease(client, island_id, h)
    assert lb is not None and lb["round"] == 0  # 2 of 4 < quorum: keep leasing the same round
    assert upload(client, lb, h, train_lease(client, lb, h)).json()["round_applied"] is True
    assert wait_applied(client, run["id"])["current_round"] == 1


def test_an_upload_whose_round_a_sweep_closed_first_still_reports_it_complete(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The background sweep may close a round between the commit of its last upload and that upload's own close
    probe; the upload still completed the round and says so."""
    run = create_running_run(client)
    island_id, h = join(client, max_leases=4)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    own_probe = state.closer.close_ready
    swept: list[int] = []

    def sweep_first(session: Session, run_ids: list[int] | None, *, now: datetime) -> int:
        with state.sessions() as other:  # the sweeper's own session wins the close
            swept.append(own_probe(other, None, now=now))
        return own_probe(session, run_ids, now=now)

    monkeypatch.setattr(state.closer, "close_ready", sweep_first)
    answers = []
    for _ in range(4):
        lb = lease(client, island_id, h)
        assert lb is not None
        answers.append(upload(client, lb, h, train_lease(client, lb, h)).json()["round_applied"])
    assert answers == [False, False, False, True]
    assert sum(swept) == 1  # the competitor closed it (the app's own sweeper also goes through this probe)
    assert wait_applied(client, run["id"])["current_round"] == 1


def test_metrics_count_rounds_contributions_and_rejections(client: TestClient) -> None:
    create_running_run(client, num_rounds=1)
    island_id, h = join(client, max_leases=4)
    for _ in range(4):
        lb = lease(client, island_id, h)
        assert lb is not None
        grads = train_lease(client, lb, h)
        upload(client, lb, h, grads)
    upload(client, lb, h, grads)  # duplicate
    upload(client, lb, h, b"junk")  # duplicate check comes first: still a duplicate
    text = eventually(lambda: client.get("/metrics").text, lambda t: "dipaco_rounds_applied_total 1.0" in t)
    assert "dipaco_rounds_closed_total 1.0" in text
    assert 'dipaco_contributions_total{result="accepted"} 4.0' in text
    assert 'dipaco_contributions_total{result="duplicate"} 2.0' in text
    assert "dipaco_leases_issued_total 4.0" in text
    assert "dipaco_active_islands 1.0" in text
    r = client.post(f"/v1/leases/{lb['lease_id']}/outer-gradients", content=b"x", headers={"X-Dipaco-Tokens": "1"})
    assert r.status_code == 401  # answered at the door, before the body is read
    assert 'dipaco_refused_requests_total{reason="unauthorized"} 1.0' in client.get("/metrics").text


def test_paths_stay_with_their_island_across_rounds(client: TestClient, clock: FakeClock) -> None:
    create_running_run(client)
    a_id, ah = join(client, "a", max_leases=4)
    b_id, bh = join(client, "b", max_leases=4)
    owner = {}
    for island_id, h in [(a_id, ah), (b_id, bh), (a_id, ah), (b_id, bh)]:
        lb = lease(client, island_id, h)
        assert lb is not None
        owner[lb["path_index"]] = island_id
        upload(client, lb, h, train_lease(client, lb, h))
    assert owner == {0: a_id, 1: b_id, 2: a_id, 3: b_id}
    wait_applied(client, lb["run_id"])
    # round 1: a is fast; it gets its own two paths back, then b's paths are kept for b ...
    got = [lease(client, a_id, ah) for _ in range(2)]
    assert [g["path_index"] for g in got if g] == [0, 2]
    assert lease(client, a_id, ah) is None
    b_first = lease(client, b_id, bh)
    assert b_first is not None and b_first["path_index"] == 1
    # ... until the reservation (10 s after the round opened) runs out
    clock.advance(11)
    client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah)
    client.post(f"/v1/islands/{b_id}/heartbeat", headers=bh)
    late = lease(client, a_id, ah)
    assert late is not None and late["path_index"] == 3


def _two_islands_train_round_zero(client: TestClient) -> tuple[tuple[int, dict[str, str]], tuple[int, dict[str, str]]]:
    a_id, ah = join(client, "a", max_leases=4)
    b_id, bh = join(client, "b", max_leases=4)
    for island_id, h in [(a_id, ah), (b_id, bh), (a_id, ah), (b_id, bh)]:
        lb = lease(client, island_id, h)
        assert lb is not None
        applied = upload(client, lb, h, train_lease(client, lb, h)).json()["round_applied"]
    assert applied is True  # a trained paths 0 and 2, b paths 1 and 3
    wait_applied(client, lb["run_id"])
    return (a_id, ah), (b_id, bh)


def test_round_apply_offers_each_island_its_path_which_it_takes_or_loses(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client, lease_ttl_s=120)
    (a_id, ah), (b_id, bh) = _two_islands_train_round_zero(client)
    # The apply offered a path 0 and b path 1 (each island's lowest); an offer is not extended by heartbeats.
    clock.advance(5)
    assert client.post(f"/v1/islands/{b_id}/heartbeat", headers=bh).json()["active_lease_ids"] == []
    taken = lease(client, a_id, ah)
    assert taken is not None and (taken["round"], taken["path_index"]) == (1, 0)
    assert taken["expires_at"].startswith("2026-01-01T00:02:05")  # taking an offer starts the lease's full TTL
    assert taken["modules"][1]["version"] == 1 and taken["token_start"] > 0  # the new round's versions and range
    # b never asks: 10 s after the round opened its offer has expired and path 1 is anyone's
    clock.advance(6)
    client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah)
    client.post(f"/v1/islands/{b_id}/heartbeat", headers=bh)
    assert [lease(client, a_id, ah)["path_index"] for _ in range(2)] == [2, 1]  # type: ignore[index]
    last = lease(client, b_id, bh)
    assert last is not None and last["path_index"] == 3
    issued = client.get("/metrics").text
    assert "dipaco_leases_issued_total 8.0" in issued
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1


def test_an_island_that_leaves_gives_its_offer_back(client: TestClient, clock: FakeClock) -> None:
    create_running_run(client)
    (a_id, ah), (b_id, bh) = _two_islands_train_round_zero(client)
    assert client.delete(f"/v1/islands/{b_id}", headers=bh).status_code == 204
    got = [lease(client, a_id, ah) for _ in range(4)]
    assert [g["path_index"] for g in got if g] == [0, 2, 1, 3]  # b's offer (path 1) went back at once


def test_long_polled_lease_request_wakes_when_a_path_is_given_back(client: TestClient) -> None:
    create_running_run(client)
    a_id, ah = join(client, "a", max_leases=4)
    b_id, bh = join(client, "b", max_leases=4)
    held = [lease(client, a_id, ah) for _ in range(4)]  # a holds every path
    assert all(held)
    idle = client.post(f"/v1/islands/{b_id}/lease?wait=0.3", headers=bh)
    assert idle.status_code == 204 and idle.headers["Retry-After"] == "0"
    assert 250 <= int(idle.headers["X-Dipaco-Held-Ms"]) < 3000  # held for the wait, then told to ask again

    got: list[httpx.Response] = []
    waiter = threading.Thread(target=lambda: got.append(client.post(f"/v1/islands/{b_id}/lease?wait=30", headers=bh)))
    started = time.monotonic()
    waiter.start()
    time.sleep(0.5)  # b is held now
    assert client.post(f"/v1/leases/{held[2]['lease_id']}/release", headers=ah).status_code == 200
    waiter.join(timeout=20)
    assert got and got[0].status_code == 200, got
    assert got[0].json()["path_index"] == held[2]["path_index"]
    assert time.monotonic() - started < 10  # woken by the release, not by the 30 s timeout
    assert int(got[0].headers["X-Dipaco-Held-Ms"]) >= 300
    too_long = client.post(f"/v1/islands/{b_id}/lease?wait=61", headers=bh)
    assert too_long.status_code == 422


def test_held_islands_get_their_offers_when_the_round_opens(client: TestClient) -> None:
    """Three islands wait (long poll) while the fourth finishes the round: the apply's offers reach all three
    at once, taken up in the database (the heartbeat extends them), each its own path of round 0."""
    create_running_run(client)
    islands = [join(client, name) for name in "abcd"]
    leases = [lease(client, island_id, h) for island_id, h in islands]
    assert all(leases)
    trained = {i: train_lease(client, lb, islands[i][1]) for i, lb in enumerate(leases) if lb}
    for i in range(3):
        assert upload(client, leases[i], islands[i][1], trained[i]).json()["round_applied"] is False  # type: ignore[arg-type]

    got: dict[int, httpx.Response] = {}

    def wait_for_work(i: int) -> None:
        island_id, h = islands[i]
        got[i] = client.post(f"/v1/islands/{island_id}/lease?wait=30", headers=h)

    waiters = [threading.Thread(target=wait_for_work, args=(i,)) for i in range(3)]
    for w in waiters:
        w.start()
    time.sleep(0.5)  # all three are held now
    started = time.monotonic()
    assert upload(client, leases[3], islands[3][1], trained[3]).json()["round_applied"] is True  # type: ignore[arg-type]
    for w in waiters:
        w.join(timeout=20)
    assert time.monotonic() - started < 10  # woken by the apply, not by the 30 s timeout
    for i in range(3):
        assert got[i].status_code == 200, got[i].text
        body = got[i].json()
        assert (body["round"], body["path_index"]) == (1, leases[i]["path_index"])  # type: ignore[index]
        assert int(got[i].headers["X-Dipaco-Held-Ms"]) > 0  # held until the round was applied
        island_id, h = islands[i]
        beat = client.post(f"/v1/islands/{island_id}/heartbeat", headers=h).json()
        assert beat["active_lease_ids"] == [body["lease_id"]]  # active in the database, not only in the reply
    assert len(client.app.state.dipaco.offers) == 1  # type: ignore[attr-defined]  # d's, until d asks


def test_an_upload_may_bring_the_islands_next_lease(client: TestClient) -> None:
    """`?next_lease=true`: the reply carries the island's next lease when one is ready at once (an active lease
    like any other), never for a retried upload (its first reply may have carried one) nor for the upload that
    closes its round (the next round's leases follow the apply); without it the reply carries none."""
    create_running_run(client)
    a_id, ah = join(client, "a")
    b_id, bh = join(client, "b")
    first = lease(client, a_id, ah)
    assert first is not None
    trained = train_lease(client, first, ah)
    got = upload(client, first, ah, trained, next_lease=True)
    assert got.status_code == 200, got.text
    nxt = got.json()["next_lease"]
    assert nxt is not None and nxt["round"] == 0 and nxt["path_index"] != first["path_index"]
    assert nxt["status"] == "active" and [m["version"] for m in nxt["modules"]] == [0, 0, 0, 0]
    beat = client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah).json()
    assert beat["active_lease_ids"] == [nxt["lease_id"]]  # issued in the database, not only in the reply
    again = upload(client, first, ah, trained, next_lease=True)  # the first reply was lost: the upload again
    assert again.status_code == 200 and again.json()["id"] == got.json()["id"] and again.json()["next_lease"] is None
    assert client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah).json()["active_lease_ids"] == [nxt["lease_id"]]
    assert upload(client, nxt, ah, train_lease(client, nxt, ah)).json()["next_lease"] is None  # not asked for
    mine = lease(client, b_id, bh)  # b trains the round's last two paths, the second one from its upload's reply
    assert mine is not None
    last = upload(client, mine, bh, train_lease(client, mine, bh), next_lease=True).json()["next_lease"]
    assert last is not None and last["round"] == 0
    reply = upload(client, last, bh, train_lease(client, last, bh), next_lease=True).json()
    assert reply["round_applied"] is True and reply["next_lease"] is None  # it closed the round
    with client.app.state.dipaco.sessions() as session:  # type: ignore[attr-defined]
        statuses = sorted(session.scalars(select(Lease.status).where(Lease.round == 0)).all())
    assert statuses == ["submitted"] * 4  # one lease a path: nothing issued twice


def test_an_offer_taken_up_is_not_held_again_whichever_put_comes_late(client: TestClient) -> None:
    """The apply that made a round's offers and the sweep that read them from the database both hand them to the
    offer book, in either order, and an island may take its offer up in between, from the book or from the
    database: a late hand-over must not hold the taken offer again (CI saw the book hold two offers for one)."""
    create_running_run(client)
    (a_id, ah), (b_id, bh) = _two_islands_train_round_zero(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        made = leases.pending_offers(session, now=state.clock())  # as the sweep reads them
    assert sorted(o.island_id for o in made) == [a_id, b_id] and len(state.offers) == 2
    got = lease(client, a_id, ah)  # a takes its offer from the book
    assert got is not None and got["round"] == 1
    assert state.offers.put(made, now=state.clock()) == 0  # the other hand-over comes late
    assert len(state.offers) == 1  # b's only
    b_offer = state.offers.pop(b_id, now=state.clock())  # the book has not been handed b's offer yet ...
    assert b_offer is not None
    found = state.dispatcher._from_database(b_id)  # ... so b's request takes it from the database
    assert found.lease is not None and found.lease.lease_id == b_offer.lease_id
    assert state.offers.put([b_offer], now=state.clock()) == 0  # then the apply's hand-over arrives
    assert len(state.offers) == 0


def test_an_offer_made_after_the_requests_look_for_one_is_taken_not_refused(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race that most likely stopped an island in a CI run: an island's lease request looks for an offer,
    finds none, and the round closes (in the apply executor) before it picks a free path, offering the island
    one. Its one slot is then full of that offer: the request takes it, instead of a 409 (which stops an island)."""
    create_running_run(client)
    a_id, ah = join(client, "a")  # one lease at a time
    b_id, bh = join(client, "b")
    for island_id, h in [(a_id, ah), (b_id, bh), (a_id, ah), (b_id, bh)]:
        lb = lease(client, island_id, h)
        assert lb is not None
        upload(client, lb, h, train_lease(client, lb, h))
    wait_applied(client, lb["run_id"])
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        offer = session.scalars(select(Lease).where(Lease.island_id == a_id, Lease.status == "offered")).one()
    calls: list[int] = []
    take_offer = leases.take_offer

    def late(session: Session, island_id: int, *, now: datetime) -> object:
        calls.append(island_id)  # the first look misses the offer, as it did before the close committed
        return None if len(calls) == 1 else take_offer(session, island_id, now=now)

    monkeypatch.setattr(leases, "take_offer", late)
    found = state.dispatcher._from_database(a_id)
    assert calls == [a_id, a_id]
    assert found.lease is not None and (found.lease.lease_id, found.lease.round) == (offer.id, 1)
    with pytest.raises(leases.OfferPending, match=f"island {b_id} has an offer waiting"):
        with state.sessions() as session:  # b's slot is full of its offer too: a grant is refused with the reason
            rounds = leases.open_rounds(session)
            leases.acquire_lease(session, b_id, rounds, now=state.clock())
    with state.sessions() as session:
        statuses = sorted(session.scalars(select(Lease.status).where(Lease.round == 1)).all())
    assert statuses == ["active", "offered"]  # a's offer taken, b's still waiting for b; nothing else issued


def test_an_offer_the_database_no_longer_holds_is_not_handed_out_from_memory(client: TestClient) -> None:
    """The offer book is a cache: when the offer is gone in the database (here: expired behind this process's
    back, as another worker's sweep would do), the island gets a lease from the database instead."""
    create_running_run(client)
    (a_id, ah), _ = _two_islands_train_round_zero(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        session.execute(
            update(Lease).where(Lease.island_id == a_id, Lease.status == "offered").values(status="expired")
        )
        session.commit()
    got = lease(client, a_id, ah)
    assert got is not None and got["round"] == 1 and got["path_index"] == 0  # its warm path, leased afresh
    with state.sessions() as session:
        statuses = session.scalars(select(Lease.status).where(Lease.island_id == a_id, Lease.round == 1)).all()
    assert sorted(statuses) == ["active", "expired"]


def test_replies_carry_the_coordinators_own_time_without_the_hold(client: TestClient) -> None:
    create_running_run(client)
    a_id, ah = join(client, "a", max_leases=4)
    beat = client.post(f"/v1/islands/{a_id}/heartbeat", headers=ah)
    assert re.fullmatch(r"app;dur=\d+\.\d", beat.headers["Server-Timing"])
    held = [lease(client, a_id, ah) for _ in range(4)]  # every path taken: the next request is held
    assert all(held)
    idle = client.post(f"/v1/islands/{a_id}/lease?wait=0.5", headers=ah)
    assert idle.status_code == 204 and int(idle.headers["X-Dipaco-Held-Ms"]) >= 450
    timings = idle.headers.get_list("Server-Timing")
    assert len(timings) == 1  # the route's own (hold excluded); the middleware leaves it alone
    assert float(timings[0].partition("dur=")[2]) < 450


def test_an_island_that_left_while_its_request_waited_gets_no_lease(client: TestClient) -> None:
    """A lease request held waiting for work when its island leaves (another thread of the island, an admin's
    revocation) finds a free path later: it is refused, and nothing is issued."""
    create_running_run(client)
    island_id, _ = join(client, "gone")
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        rounds = leases.open_rounds(session)  # the request's look, before the island left
    assert client.delete(f"/v1/islands/{island_id}", headers=A).status_code == 204  # revoked by an admin
    with pytest.raises(Conflict, match=f"island {island_id} has status revoked: it gets no lease"):
        with state.sessions() as session:
            leases.acquire_lease(session, island_id, rounds, now=state.clock())
    with state.sessions() as session:
        assert session.scalars(select(Lease).where(Lease.island_id == island_id)).all() == []
