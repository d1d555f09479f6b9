"""More concurrent requests than database connections: requests queue, none deadlocks (real HTTP, uvicorn)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, J
from tests.coordinator.test_spool import served


def test_many_requests_on_one_pooled_connection_all_complete(settings: Settings, clock: FakeClock) -> None:
    # One connection for 40 worker threads. A request that held the connection while it queued for a thread
    # (to run its session's teardown) while every thread queued for the connection froze the coordinator.
    tight = settings.model_copy(update={"db_pool_size": 1, "db_max_overflow": 0})
    with served(tight, clock) as url, httpx.Client(base_url=url, timeout=60) as http:
        joined = http.post("/v1/islands", json={"name": "i"}, headers=J).json()
        island = {"Authorization": f"Bearer {joined['token']}"}

        def call(i: int) -> int:
            with httpx.Client(base_url=url, timeout=60) as c:
                if i % 2:
                    return c.post(f"/v1/islands/{joined['island_id']}/heartbeat", headers=island).status_code
                return c.get("/v1/runs", headers=A).status_code

        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=80) as pool:
            codes = list(pool.map(call, range(160)))
        elapsed = time.monotonic() - started
    assert codes == [200] * 160
    assert elapsed < 20, f"160 requests took {elapsed:.1f} s on one connection"  # a deadlock waits out 30 s
