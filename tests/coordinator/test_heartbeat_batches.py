"""Heartbeats that arrive together are recorded in one transaction (`batching.GroupCommit`), and each island
still gets exactly its own leases back."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any

from fastapi.testclient import TestClient

from coordinator.batching import GroupCommit
from coordinator.services import islands
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, create_running_run, eventually, join, lease
from tests.coordinator.test_overlap import commits


def test_heartbeats_that_arrive_together_share_one_transaction(quiet: TestClient, clock: FakeClock) -> None:
    run = create_running_run(quiet)
    held = [join(quiet, f"i{k}") for k in range(run["num_paths"])]
    leased = {island_id: lease(quiet, island_id, h) for island_id, h in held}
    idle_id, idle_h = join(quiet, "no-lease")
    assert all(body is not None for body in leased.values())
    group = quiet.app.state.dipaco.heartbeats  # type: ignore[attr-defined]
    run_batch = group._run
    batches: list[list[int]] = []
    first_in, release = threading.Event(), threading.Event()

    def held_batch(ids: list[int]) -> list[list[int]]:
        batches.append(list(ids))
        if len(batches) == 1:  # hold the first batch until the others have queued behind it
            first_in.set()
            assert release.wait(30)
        return run_batch(ids)

    group._run = held_batch
    callers = [*held, *held, (idle_id, idle_h)]  # every island twice, and one with no lease

    def beat(caller: tuple[int, dict[str, str]]) -> tuple[int, dict[str, Any]]:
        island_id, h = caller
        r = quiet.post(f"/v1/islands/{island_id}/heartbeat", headers=h)
        assert r.status_code == 200, r.text
        return island_id, r.json()

    clock.advance(5)
    with commits(quiet) as seen, ThreadPoolExecutor(max_workers=len(callers) + 1) as pool:
        first = pool.submit(beat, held[0])
        assert first_in.wait(30)
        rest = [pool.submit(beat, caller) for caller in callers]
        eventually(group.waiting, lambda n: n == len(callers), timeout_s=30)
        release.set()
        replies = [first.result(timeout=30), *(f.result(timeout=30) for f in rest)]
    assert [len(b) for b in batches] == [1, len(callers)]
    assert len(seen) == 2  # one commit a batch, not one a heartbeat
    for island_id, body in replies:
        mine = [leased[island_id]["lease_id"]] if island_id in leased else []  # type: ignore[index]
        assert body == {
            "island_id": island_id,
            "active_lease_ids": mine,
            "heartbeat_interval_s": body["heartbeat_interval_s"],
        }
    # each lease runs its TTL from the heartbeat now, 5 s after it was issued
    ttl = timedelta(seconds=run["lease_ttl_s"])
    for row in quiet.get("/v1/leases", headers=A).json()["data"]:
        assert datetime.fromisoformat(row["expires_at"]) == clock() + ttl


def test_one_call_beats_many_islands_and_answers_each(quiet: TestClient, clock: FakeClock) -> None:
    """The service: repeats once, an island with no lease and an unknown island get [], a lease already past its
    expiry is not revived."""
    run = create_running_run(quiet, lease_ttl_s=30)
    (a, ah), (b, bh) = join(quiet, "a"), join(quiet, "b")
    la, lb = lease(quiet, a, ah), lease(quiet, b, bh)
    assert la is not None and lb is not None
    c, _ = join(quiet, "c")
    sessions = quiet.app.state.dipaco.sessions  # type: ignore[attr-defined]
    clock.advance(20)
    with sessions() as session:
        got = islands.heartbeats(session, [b, a, c, a, 987654], now=clock())
    assert got == {a: [la["lease_id"]], b: [lb["lease_id"]], c: [], 987654: []}
    assert run["num_paths"] >= 2
    clock.advance(31)  # past the expiry the beat above gave
    with sessions() as session:
        assert islands.heartbeats(session, [a, b], now=clock()) == {a: [], b: []}


def test_a_failed_batch_reaches_each_of_its_requests_and_the_next_batch_runs() -> None:
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        calls.append(items)
        if 0 in items:
            raise RuntimeError("database went away")
        return [item * 10 for item in items]

    async def scenario() -> list[Any]:
        group: GroupCommit[int, int] = GroupCommit(run)
        first = await asyncio.gather(group.submit(0), group.submit(1), return_exceptions=True)
        second = await asyncio.gather(group.submit(2), group.submit(3))
        return [*first, *second]

    a, b, c, d = asyncio.run(scenario())
    assert isinstance(a, RuntimeError) and isinstance(b, RuntimeError)
    assert (c, d) == (20, 30)
    assert calls == [[0, 1], [2, 3]]


def test_a_request_that_goes_away_does_not_cancel_its_batch() -> None:
    started = threading.Event()
    go = threading.Event()

    def run(items: list[int]) -> list[int]:
        started.set()
        assert go.wait(10)
        return list(items)

    async def scenario() -> tuple[int, bool]:
        group: GroupCommit[int, int] = GroupCommit(run)
        leaving = asyncio.create_task(group.submit(1))
        staying = asyncio.create_task(group.submit(2))
        await asyncio.to_thread(started.wait, 10)
        leaving.cancel()
        go.set()
        return await staying, leaving.cancelled()

    assert asyncio.run(scenario()) == (2, True)
