"""Path sharing in all-async runs (`path_leases` > 1) through the real app: an island whose home path is ahead
helps the path that lags on the next token range, the cursor moves over contributions that come out of order,
a range given back is issued again as it was, and no token range is trained twice."""

from __future__ import annotations

import random
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.models import Lease, Path
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, J, app_executor, create_running_run, join, lease, train_lease, upload

SHARED = {"sync": "async", "inner_steps": 2, "num_rounds": 12, "path_leases": 2, "lease_ttl_s": 30}
TOKENS = 2 * 2 * 16  # H x batch x seq_len of SHARED on the tiny model


def _deliver(client: TestClient, clock: FakeClock, body: dict[str, Any], headers: dict[str, str]) -> Any:
    """Train and upload the lease, then let an executor take every step that came due."""
    r = upload(client, body, headers, train_lease(client, body, headers), tokens=TOKENS)
    while app_executor(client, clock).work():
        pass
    return r


def _path(client: TestClient, run_id: int, index: int) -> Path:
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        path = session.scalar(select(Path).where(Path.run_id == run_id, Path.index == index))
        assert path is not None
        session.expunge(path)
        return path


Island = tuple[int, dict[str, str]]


def _fast_helps_slow(client: TestClient, clock: FakeClock) -> tuple[Island, Island, dict[str, Any], dict[str, Any]]:
    """Two islands on a SHARED run, fast on path 0 and slow on path 1: the fast one trains its path while the slow
    one holds path 1, and once ahead by more than one of its own leases (2 steps, counting path 1's pending
    lease) it helps path 1. Returns (fast, slow, the slow island's lease, the fast island's shared lease)."""
    fast, slow = join(client, "fast"), join(client, "slow")
    body, held = lease(client, *fast), lease(client, *slow)
    assert body is not None and held is not None
    assert (body["path_index"], held["path_index"]) == (0, 1)
    for _ in range(3):
        assert _deliver(client, clock, body, fast[1]).status_code == 200
        body = lease(client, *fast)
        assert body is not None
        if body["path_index"] != 0:
            break
    assert body["path_index"] == 1, "the fast island never helped the lagging path"
    return fast, slow, held, body


def test_a_lagging_path_is_shared_on_the_next_range_and_the_cursor_waits_for_order(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="share", **SHARED)
    fast, slow, held, helper = _fast_helps_slow(client, clock)
    assert _path(client, run["id"], 0).steps_done == 6
    assert helper["token_start"] == held["token_end"] - 1 and helper["epoch"] == held["epoch"]
    assert helper["round"] == held["round"] + 1 and helper["first_step"] == 2  # the slow lease's 2 steps first
    # path 1 has as many leases as path_leases allows: a third island gets no share of it
    other = join(client, "other")
    third = lease(client, *other)
    assert third is not None and third["path_index"] == 2  # a free path instead
    assert client.post(f"/v1/leases/{third['lease_id']}/release", headers=other[1]).status_code == 200
    # the helper delivers first: accepted, but the cursor stays at the slow island's range
    assert _deliver(client, clock, helper, fast[1]).status_code == 200
    path = _path(client, run["id"], 1)
    assert (path.token_offset, path.steps_done, path.leases_done) == (held["token_start"], 2, 1)
    # the slow island delivers: the cursor moves over both ranges
    assert _deliver(client, clock, held, slow[1]).status_code == 200
    path = _path(client, run["id"], 1)
    assert (path.token_offset, path.steps_done, path.leases_done) == (helper["token_end"] - 1, 4, 2)
    # the slow island keeps path 1 as its home (the helper's lease was shared, so path 0 stays the fast one's)
    back = lease(client, *slow)
    assert back is not None and back["path_index"] == 1 and back["token_start"] == helper["token_end"] - 1
    home = lease(client, *fast)
    assert home is not None and home["path_index"] == 0
    listed = client.get(f"/v1/leases?run_id={run['id']}&limit=100", headers=A).json()["data"]
    assert [x["id"] for x in listed if x["shared"]] == [helper["lease_id"]]


def test_a_range_given_back_before_a_shared_one_is_issued_again_as_it_was(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="gap", **SHARED)
    fast, slow, held, helper = _fast_helps_slow(client, clock)
    # the slow island misses its heartbeats: its lease expires while the helper's is kept alive; back, it is
    # given its range again (a gap before the helper's range), with the same round number and H
    clock.advance(20)
    assert client.post(f"/v1/islands/{fast[0]}/heartbeat", headers=fast[1]).status_code == 200
    clock.advance(15)
    again = lease(client, *slow)
    assert again is not None and again["path_index"] == 1
    assert (again["token_start"], again["token_end"], again["round"], again["inner_steps"]) == (
        held["token_start"],
        held["token_end"],
        held["round"],
        held["inner_steps"],
    )
    # the expired lease's late upload is refused: its range belongs to the new lease
    late = upload(client, held, slow[1], train_lease(client, held, slow[1]), tokens=TOKENS)
    assert late.status_code == 409, late.text
    assert "expired and its token range was issued again" in late.json()["detail"]
    assert _path(client, run["id"], 1).leases_done == 0


@pytest.mark.parametrize("seed", [7, 11, 23])
def test_shared_paths_train_every_range_once_per_epoch(no_executors: TestClient, clock: FakeClock, seed: int) -> None:
    """Islands deliver, go silent or give leases back in a random (seeded) order until the run's budget is
    spent: per path and epoch the accepted ranges follow each other without overlap from token 0."""
    client = no_executors
    run = create_running_run(client, name="exact", **(SHARED | {"num_rounds": 8, "max_staleness": 1000}))
    rng = random.Random(seed)
    islands = [join(client, f"island-{i}") for i in range(3)]
    held: dict[int, dict[str, Any]] = {}
    for _ in range(200):
        for i, (island_id, h) in enumerate(islands):
            if i not in held and (got := lease(client, island_id, h)) is not None:
                held[i] = got
        if not held:
            break
        i = rng.choice(sorted(held))
        body, h = held.pop(i), islands[i][1]
        roll = rng.random()
        if roll < 0.7:
            r = _deliver(client, clock, body, h)
            assert r.status_code in (200, 409), r.text
        elif roll < 0.85:
            assert client.post(f"/v1/leases/{body['lease_id']}/release", headers=h).status_code == 200
        else:
            clock.advance(31)  # every lease not heartbeated expires
            held.clear()
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished"
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        done = session.execute(
            select(Lease.path_id, Lease.epoch, Lease.token_start, Lease.token_end)
            .where(Lease.run_id == run["id"], Lease.status == "submitted")
            .order_by(Lease.path_id, Lease.epoch, Lease.token_start)
        ).all()
        paths = {p.id: p for p in session.scalars(select(Path).where(Path.run_id == run["id"]))}
        shared = session.scalars(select(Lease.id).where(Lease.shared.is_(True))).all()
    assert sum(p.steps_done for p in paths.values()) == 4 * 8 * 2
    assert shared, "the random schedule never shared a path"
    cursor: dict[tuple[int, int], int] = {}
    for path_id, epoch, start, end in done:
        expected = cursor.get((path_id, epoch), 0)
        assert start == expected, f"path {path_id} epoch {epoch}: a range starts at {start}, expected {expected}"
        cursor[(path_id, epoch)] = end - 1
    for path_id, path in paths.items():
        last = max(epoch for pid, epoch in cursor if pid == path_id)
        assert (path.epoch, path.token_offset) == (last, cursor[(path_id, last)])


def test_a_gap_left_by_a_late_upload_is_issued_in_whole_steps(no_executors: TestClient, clock: FakeClock) -> None:
    """An expired lease of H 2 delivers late, after its range went to a lease of H 8 that expired too while a
    shared lease held the range after it: the 6 steps in between are no lease's range, and are issued as such
    (the path is not left waiting for a range that nobody will give back)."""
    client = no_executors
    create_running_run(client, name="late", layout="embed:shared, b0-1:shared, head:shared", sync="async",
                       inner_steps=4, num_rounds=8, min_inner_steps=2, max_inner_steps=8,
                       lease_ttl_s=30)  # fmt: skip
    islands = {}
    for name, speed in (("slow", 100.0), ("fast", 1000.0), ("helper", 400.0)):
        r = client.post("/v1/islands", json={"name": name, "capabilities": {"tokens_per_s": speed}}, headers=J)
        assert r.status_code == 201, r.text
        islands[name] = (r.json()["island_id"], {"Authorization": f"Bearer {r.json()['token']}"})
    per_step = 2 * 16
    first = lease(client, *islands["slow"])
    assert first is not None and (first["token_start"], first["inner_steps"]) == (0, 2)
    clock.advance(31)  # the slow island's lease expires, and it is no longer live
    longer = lease(client, *islands["fast"])
    assert longer is not None and (longer["token_start"], longer["inner_steps"]) == (0, 8)
    after = lease(client, *islands["helper"])
    assert after is not None and after["token_start"] == 8 * per_step
    clock.advance(20)
    assert client.post(f"/v1/islands/{islands['helper'][0]}/heartbeat", headers=islands["helper"][1]).status_code == 200
    clock.advance(15)  # the fast island's lease expires; the helper's is alive
    late = upload(
        client, first, islands["slow"][1], train_lease(client, first, islands["slow"][1]), tokens=2 * per_step
    )
    assert late.status_code == 200, late.text  # nothing else holds its range
    while app_executor(client, clock).work():  # the one path's modules step on each upload (period of 1)
        pass
    gap = lease(client, *islands["slow"])
    assert gap is not None
    assert (gap["token_start"], gap["token_end"], gap["inner_steps"]) == (2 * per_step, 8 * per_step + 1, 6)
