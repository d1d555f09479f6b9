"""The data cursor of an all-async run with dynamic local updates and path sharing, under a seeded random schedule:
islands of different speeds (so each lease's H is its own, within min_inner_steps..max_inner_steps) deliver,
give leases back, go silent until their leases expire, and upload expired leases late. However the events
interleave, per path and epoch the accepted ranges follow each other from token 0 without overlap, each of its
lease's H, and an epoch leaves out only a tail shorter than `min_inner_steps` steps (a lease that does not fit
takes the tail with fewer steps: `modules.cursor.fitting_steps`)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.models import Lease, Path, Shard
from modules import decode
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, J, app_executor, create_running_run, lease, upload

MIN_H, MAX_H = 2, 6
SPEC: dict[str, Any] = {
    "layout": "embed:shared, b0-1:routed2, head:shared",  # 2 paths, 3 islands: paths are shared
    "sync": "async",
    "inner_steps": 3,
    "min_inner_steps": MIN_H,
    "max_inner_steps": MAX_H,
    "num_rounds": 12,  # 36 steps a path: about 2.5 epochs of a 500-token shard
    "path_leases": 2,
    "lease_ttl_s": 30,
}
NUM_TOKENS = 500
PER_STEP = 2 * 16  # batch x seq_len of the tiny model
REFUSALS = "over the run's max_staleness|expired and its token range was issued again|run [0-9]+ is finished"
"""The refusals a schedule may meet (stale; a late upload whose range went to another lease; after the end)."""
LATE_REFUSAL = "already has a contribution for round"
"""And a late upload's: its range was issued again as it was (same round), and the first lease, late too,
delivered it."""
SECONDS_PER_STEP = (0.4, 1.0, 2.5)
"""Each island's time for one inner step (before jitter): H follows each island's measured speed."""


@dataclass
class _Island:
    id: int
    headers: dict[str, str]
    seconds_per_step: float
    held: dict[str, Any] | None = None
    due: float = 0.0
    """When (seconds on the fake clock) its held lease is trained."""
    silent_until: float = 0.0
    """It sends no heartbeat and asks for no lease before then (its lease expires)."""


@dataclass
class _Seen:
    steps: set[int] = field(default_factory=set)
    delivered: int = 0
    refused: int = 0
    released: int = 0
    expired: int = 0
    late_accepted: int = 0
    late_refused: int = 0


def _payload(client: TestClient, body: dict[str, Any], headers: dict[str, str], rng: torch.Generator) -> Any:
    """A small random outer gradient of the lease's modules (the cursor does not care what was trained)."""
    grads: dict[str, torch.Tensor] = {}
    for m in body["modules"]:
        r = client.get(f"/v1/modules/{m['module_id']}/weights?version={m['version']}", headers=headers)
        assert r.status_code == 200, r.text
        for name, t in decode(r.content).items():
            grads[f"{m['level_name']}/{name}"] = 1e-3 * torch.randn(t.shape, generator=rng)
    return grads


@pytest.mark.parametrize("seed", [3, 17])
def test_dynamic_h_shared_paths_train_every_range_once_per_epoch(
    no_executors: TestClient, clock: FakeClock, seed: int
) -> None:
    client = no_executors
    run = create_running_run(client, name="cursor", num_tokens=NUM_TOKENS, **SPEC)
    rng, grads = random.Random(seed), torch.Generator().manual_seed(seed)
    islands = []
    for i, cost in enumerate(SECONDS_PER_STEP):
        r = client.post(
            "/v1/islands", json={"name": f"island-{i}", "capabilities": {"tokens_per_s": PER_STEP / cost}}, headers=J
        )
        assert r.status_code == 201, r.text
        islands.append(_Island(r.json()["island_id"], {"Authorization": f"Bearer {r.json()['token']}"}, cost))
    start = clock.now
    seen = _Seen()
    late: list[tuple[float, _Island, dict[str, Any]]] = []
    """Leases of silent islands, uploaded once expired (when, island, lease)."""

    def now() -> float:
        return (clock.now - start).total_seconds()

    def wait_until(t: float) -> None:
        """Move the clock to `t`, heartbeating every island that is not silent at least every 10 s."""
        while t - now() > 1e-3:  # the clock counts microseconds
            clock.advance(min(10.0, t - now()))
            for island in islands:
                if island.silent_until <= now():
                    r = client.post(f"/v1/islands/{island.id}/heartbeat", headers=island.headers)
                    assert r.status_code == 200, r.text

    def deliver(island: _Island, body: dict[str, Any], *, late: bool = False) -> int:
        steps = body["inner_steps"]
        r = upload(client, body, island.headers, _payload(client, body, island.headers, grads), tokens=steps * PER_STEP)
        assert r.status_code in (200, 409), r.text
        if r.status_code == 409:  # each retires the lease: its island may take new work at once
            assert re.search(REFUSALS, r.text) or (late and LATE_REFUSAL in r.text), r.text
        while app_executor(client, clock).work():
            pass
        return int(r.status_code)

    for _ in range(400):
        for island in islands:
            if island.held is None and island.silent_until <= now():
                got = lease(client, island.id, island.headers)
                if got is not None:
                    island.held = got
                    island.due = now() + got["inner_steps"] * island.seconds_per_step * rng.uniform(0.8, 1.25)
                    seen.steps.add(got["inner_steps"])
        busy = [island for island in islands if island.held is not None]
        if not busy and not late:
            if client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished":
                break
            wait_until(now() + 1)  # a silent island's lease expiring may be what the others wait for
            continue
        roll = rng.random()
        if late and (roll < 0.1 or not busy):
            late.sort(key=lambda x: x[0])
            wait_until(late[0][0])
            _, island, body = late.pop(0)
            if deliver(island, body, late=True) == 200:
                seen.late_accepted += 1
            else:
                seen.late_refused += 1
            continue
        island = min(busy, key=lambda x: x.due)
        wait_until(island.due)
        held, island.held = island.held, None
        assert held is not None
        body = held
        if roll < 0.75:
            if deliver(island, body) == 200:
                seen.delivered += 1
            else:
                seen.refused += 1
        elif roll < 0.85:
            r = client.post(f"/v1/leases/{body['lease_id']}/release", headers=island.headers)
            assert r.status_code == 200, r.text
            seen.released += 1
        else:
            island.silent_until = now() + 35  # past the lease TTL: its lease expires; it uploads it later
            late.append((island.silent_until + rng.uniform(0, 30), island, body))
            seen.expired += 1
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished", seen

    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        done = session.execute(
            select(Lease.path_id, Lease.epoch, Lease.token_start, Lease.token_end, Lease.inner_steps)
            .where(Lease.run_id == run["id"], Lease.status == "submitted")
            .order_by(Lease.path_id, Lease.epoch, Lease.token_start)
        ).all()
        paths = {p.id: p for p in session.scalars(select(Path).where(Path.run_id == run["id"]))}
        shards = {
            i: n
            for i, n in session.execute(select(Shard.path_index, Shard.num_tokens).where(Shard.run_id == run["id"]))
        }
        shared = session.scalars(select(Lease.id).where(Lease.run_id == run["id"], Lease.shared.is_(True))).all()
    budget = int(SPEC["num_rounds"] * SPEC["inner_steps"])
    assert all(p.steps_done == budget for p in paths.values())
    by_path: dict[int, dict[int, list[tuple[int, int, int]]]] = {}
    for path_id, epoch, token_start, token_end, steps in done:
        by_path.setdefault(path_id, {}).setdefault(epoch, []).append((token_start, token_end, steps))
    for path_id, path in paths.items():
        epochs = by_path[path_id]
        assert sum(steps for ranges in epochs.values() for _, _, steps in ranges) == budget
        assert sorted(epochs) == list(range(len(epochs))), f"path {path_id}: an epoch without an accepted range"
        for epoch, ranges in epochs.items():
            cursor = 0
            for token_start, token_end, steps in ranges:
                assert token_start == cursor, f"path {path_id} epoch {epoch}: a range at {token_start}, not {cursor}"
                assert token_end - token_start == steps * PER_STEP + 1, (path_id, epoch, token_start, steps)
                cursor = token_end - 1
            if epoch + 1 in epochs:  # left out: a tail shorter than min_inner_steps (else a shorter lease took it)
                rest = shards[path.index] - cursor
                assert rest < MIN_H * PER_STEP + 1, f"path {path_id} epoch {epoch}: {rest} tokens left untrained"
        last = max(epochs)
        assert (path.epoch, path.token_offset) == (last, epochs[last][-1][1] - 1)
    # the schedule did what it is here for: H varied, paths were shared, leases expired, were released and came late
    assert len(seen.steps) >= 3 and seen.steps <= set(range(1, MAX_H + 1)), seen  # 1: the budget's last steps
    assert shared and seen.released and seen.expired and seen.late_accepted + seen.late_refused, seen
