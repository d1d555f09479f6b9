"""The dashboard's measurements through the real app, on SQLite and PostgreSQL: each module's weight norm (version
0 and after an outer step) equals the norm of the weights it serves; each island's contributions, tokens, upload
bytes and tokens/s measured over its last contributions, read for a page of islands in a fixed number of queries."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from coordinator.models import Contribution, Lease, Path
from coordinator.services import registry
from coordinator.services.registry import RECENT_CONTRIBUTIONS
from coordinator.states import ContributionStatus, LeaseStatus
from modules import decode, encode
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied


def _served_norm(client: TestClient, module_id: int) -> float:
    """The L2 norm of the weights the module serves, computed here in fp32 from the downloaded file."""
    r = client.get(f"/v1/modules/{module_id}/weights", headers=A)
    assert r.status_code == 200, r.text
    weights = decode(r.content)
    return float(torch.cat([t.float().flatten() for t in weights.values()]).norm())


def _modules(client: TestClient, run_id: int) -> list[dict[str, Any]]:
    r = client.get(f"/v1/modules?run_id={run_id}", headers=A)
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def _check_norms(client: TestClient, run_id: int, *, version: int) -> None:
    modules = _modules(client, run_id)
    assert len(modules) == 6  # embed, 2 + 2 routed, head
    for m in modules:
        assert m["version"] == version
        assert m["weight_norm"] is not None and m["weight_norm"] > 0
        assert m["weight_norm"] == pytest.approx(_served_norm(client, m["id"]), rel=1e-4), m


def _islands(client: TestClient) -> dict[str, dict[str, Any]]:
    r = client.get("/v1/islands", headers=A)
    assert r.status_code == 200, r.text
    return {i["name"]: i for i in r.json()["data"]}


def test_weight_norms_and_island_stats_over_a_round(client: TestClient, clock: FakeClock) -> None:
    run = create_running_run(client)
    _check_norms(client, run["id"], version=0)
    a_id, a = join(client, "island-a", max_leases=3)
    b_id, b = join(client, "island-b")
    join(client, "island-idle")
    leases_a = [lease(client, a_id, a) for _ in range(3)]
    lease_b = lease(client, b_id, b)
    assert all(body is not None for body in leases_a) and lease_b is not None
    tokens = 32
    sent: dict[str, list[int]] = {"island-a": [], "island-b": []}
    clock.advance(2.0)  # island-a's three leases: 2 s each from lease to upload
    for body in leases_a:
        assert body is not None
        payload = encode(train_lease(client, body, a))
        assert upload(client, body, a, payload, tokens=tokens).status_code == 200
        sent["island-a"].append(len(payload))
    clock.advance(4.0)  # island-b's lease: 6 s
    payload = encode(train_lease(client, lease_b, b))
    assert upload(client, lease_b, b, payload, tokens=tokens).status_code == 200
    sent["island-b"].append(len(payload))

    wait_applied(client, run["id"], rounds=1)
    _check_norms(client, run["id"], version=1)

    islands = _islands(client)
    assert islands["island-a"]["stats"] == {
        "contributions": 3,
        "tokens_trained": 3 * tokens,
        "upload_bytes": sum(sent["island-a"]),
        "tokens_per_s": pytest.approx(3 * tokens / (3 * 2.0)),
    }
    assert islands["island-b"]["stats"] == {
        "contributions": 1,
        "tokens_trained": tokens,
        "upload_bytes": sent["island-b"][0],
        "tokens_per_s": pytest.approx(tokens / 6.0),
    }
    assert islands["island-idle"]["stats"] == {
        "contributions": 0,
        "tokens_trained": 0,
        "upload_bytes": 0,
        "tokens_per_s": None,
    }


def test_tokens_per_s_counts_only_the_last_contributions_and_one_query_serves_a_page(
    client: TestClient, clock: FakeClock
) -> None:
    run = create_running_run(client)
    islands = [join(client, f"island-{n}")[0] for n in range(3)]
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    extra = 2
    start = clock()
    with state.sessions() as session:
        path_id = session.scalar(select(Path.id).where(Path.run_id == run["id"], Path.index == 0))
        assert path_id is not None
        # island 0: the oldest contributions took 1000 s each, the last RECENT_CONTRIBUTIONS 1 s each;
        # rounds far past the run's, so that they do not meet its real rounds
        for n in range(RECENT_CONTRIBUTIONS + extra):
            issued = start + timedelta(seconds=10_000 * n)
            took = 1000.0 if n < extra else 1.0
            row = Lease(
                run_id=run["id"],
                island_id=islands[0],
                path_id=path_id,
                round=1000 + n,
                status=LeaseStatus.SUBMITTED,
                base_versions={},
                token_start=0,
                token_end=100,
                epoch=0,
                issued_at=issued,
                expires_at=issued + timedelta(seconds=2000),
            )
            session.add(row)
            session.flush()
            session.add(
                Contribution(
                    lease_id=row.id,
                    run_id=run["id"],
                    round=1000 + n,
                    path_id=path_id,
                    tokens=100,
                    train_loss=5.0,
                    upload_bytes=10,
                    status=ContributionStatus.ACCEPTED,
                    created_at=issued + timedelta(seconds=took),
                )
            )
        session.commit()

    stats = _islands(client)["island-0"]["stats"]
    assert stats["contributions"] == RECENT_CONTRIBUTIONS + extra
    assert stats["tokens_trained"] == 100 * (RECENT_CONTRIBUTIONS + extra)
    assert stats["upload_bytes"] == 10 * (RECENT_CONTRIBUTIONS + extra)
    assert stats["tokens_per_s"] == pytest.approx(100.0)  # the 1000 s ones are left out

    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    event.listen(state.engine, "before_cursor_execute", count)
    try:
        with state.sessions() as session:
            page, total = registry.list_islands(session, status=None, offset=0, limit=100)
    finally:
        event.remove(state.engine, "before_cursor_execute", count)
    assert total == 3 and [i.stats is not None for i in page] == [True, True, True]
    selects = [s for s in statements if s.lstrip().upper().startswith("SELECT")]
    assert len(selects) == 4, selects  # the count, the page, the sums, the recent contributions
