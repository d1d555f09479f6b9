"""Async and hybrid levels through the real app: periods, staleness (recorded, damped, refused), leases held
while a module steps, runs that never wait for another path, dynamic local updates, the end of a run."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event, select

from coordinator.models import Lease, ModuleStep
from coordinator.services.apply import ApplyExecutor, StepDone, apply_step, claim_step, claim_steps
from coordinator.services.leases import work_signature
from coordinator.states import StepStatus
from tests.conftest import FakeClock
from tests.coordinator.helpers import (
    TINY_RUN,
    A,
    J,
    app_executor,
    closed_round,
    create_running_run,
    join,
    lease,
    train_lease,
    upload,
)

ASYNC = {"sync": "async", "inner_steps": 2, "num_rounds": 2}


def _modules(client: TestClient, run_id: int) -> list[dict[str, Any]]:
    return list(client.get(f"/v1/modules?run_id={run_id}", headers=A).json()["data"])


def _steps(client: TestClient) -> list[tuple[int, int, str]]:
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        rows = session.execute(select(ModuleStep.module_id, ModuleStep.round, ModuleStep.status)).all()
    return sorted((m, r, str(s)) for m, r, s in rows)


def _train_and_upload(client: TestClient, body: dict[str, Any], h: dict[str, str]) -> Any:
    tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"]
    return upload(client, body, h, train_lease(client, body, h), tokens=tokens)


def test_an_async_run_steps_modules_on_periods_and_finishes_without_rounds(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="async", **ASYNC)
    assert run["schedule"] == "async"
    assert client.get(f"/v1/runs/{run['id']}/rounds", headers=A).json()["data"] == []  # no rounds at all
    islands = [join(client, f"island-{p}") for p in range(4)]
    leases = [lease(client, i, h) for i, h in islands]
    assert [body["path_index"] for body in leases if body] == [0, 1, 2, 3]
    # path 0 uploads and leases again at once: nobody waits for the other paths
    assert _train_and_upload(client, leases[0], islands[0][1]).status_code == 200  # type: ignore[arg-type]
    again = lease(client, *islands[0])
    assert again is not None and again["path_index"] == 0 and again["round"] == 1 and again["first_step"] == 2
    assert again["token_start"] == leases[0]["token_end"] - 1  # type: ignore[index]
    assert _steps(client) == []  # every period still filling (embed/head: 4 users; routed: 2)
    # path 1 fills the period of the routed module paths 0 and 1 share (b0 module 0; paths pick (b0, b1) modules
    # (0, 0), (0, 1), (1, 0), (1, 1)): one step due
    assert _train_and_upload(client, leases[1], islands[1][1]).status_code == 200  # type: ignore[arg-type]
    modules = {(m["level"], m["index"]): m for m in _modules(client, run["id"])}
    assert all(m["mode"] == "async" for m in modules.values())
    assert [(m, r) for m, r, _ in _steps(client)] == [(modules[1, 0]["id"], 0)]
    # while it waits for an executor, paths 0 and 1 are held back (their leases would train stale weights)
    assert lease(client, *islands[1]) is None
    assert app_executor(client, clock).work() == 1
    assert modules[1, 0]["version"] == 0 and _modules(client, run["id"])[1]["version"] == 1
    relet = lease(client, *islands[1])
    assert relet is not None and relet["path_index"] == 1
    # path 0's second lease started before that step: its upload is one step stale, accepted and damped
    assert _train_and_upload(client, again, islands[0][1]).status_code == 200
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    second = next(c for c in parts if c["path_index"] == 0 and c["round"] == 1)
    assert [(m["base_version"], m["staleness"]) for m in second["modules"]] == [(0, 0), (0, 1), (0, 0), (0, 0)]


def test_a_contribution_staler_than_the_run_allows_is_refused_with_409(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="stale", max_staleness=0, dn_period=1, **ASYNC)
    (i0, h0), (i1, h1) = join(client, "fast"), join(client, "slow")
    first, slow = lease(client, i0, h0), lease(client, i1, h1)
    assert first is not None and slow is not None
    assert _train_and_upload(client, first, h0).status_code == 200
    assert app_executor(client, clock).work() == 4  # dn_period 1: each module of path 0 stepped
    r = _train_and_upload(client, slow, h1)
    assert r.status_code == 409, r.text
    detail = r.json()["detail"]
    assert "from version 0; it has taken 1 steps since, over the run's max_staleness of 0" in detail
    # nothing changed: the slow path's data cursor did not move, its next lease trains the same range again
    retry = lease(client, i1, h1)
    assert retry is not None and retry["path_index"] == slow["path_index"]
    assert (retry["token_start"], retry["round"]) == (slow["token_start"], slow["round"])
    assert _train_and_upload(client, retry, h1).status_code == 200
    events = client.get(f"/v1/events?run_id={run['id']}", headers=A).json()["data"]
    assert any("max_staleness" in e["detail"] for e in events)


def test_the_run_finishes_after_its_last_partial_periods_are_stepped(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = create_running_run(client, name="finish", dn_period=3, **ASYNC)  # 4 uploads a path: periods of 3
    island = join(client, "only")
    executor = app_executor(client, clock)
    uploads = 0
    while True:
        body = lease(client, *island)
        if body is None:
            if executor.work() == 0:
                break
            continue
        assert _train_and_upload(client, body, island[1]).status_code == 200
        uploads += 1
    assert uploads == 4 * 2  # 4 paths x a budget of 2 leases (num_rounds 2 x H 2 steps)
    final = client.get(f"/v1/runs/{run['id']}", headers=A).json()
    assert final["status"] == "finished" and final["current_round"] == 0
    versions = {(m["level"], m["index"]): m["version"] for m in _modules(client, run["id"])}
    # embed/head: 8 contributions in periods of 3 -> 3 steps (3, 3, 2); each routed module: 4 -> 2 steps (3, 1)
    assert versions == {(0, 0): 3, (1, 0): 2, (1, 1): 2, (2, 0): 2, (2, 1): 2, (3, 0): 3}
    assert all(status == StepStatus.DONE for _, _, status in _steps(client))


def test_a_hybrid_run_steps_async_levels_on_arrival_and_the_rest_per_round(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    layout = "embed:shared:async, b0-0:routed2, b1-1:routed2, head:shared:async"
    run = create_running_run(client, name="hybrid", layout=layout, dn_period=2, inner_steps=2, num_rounds=1)
    assert run["schedule"] == "hybrid"
    islands = [join(client, f"island-{p}") for p in range(4)]
    bodies = [lease(client, i, h) for i, h in islands]
    executor = app_executor(client, clock)
    for p in (0, 1):
        assert _train_and_upload(client, bodies[p], islands[p][1]).status_code == 200  # type: ignore[arg-type]
    modules = {(m["level"], m["index"]): m["id"] for m in _modules(client, run["id"])}
    # two uploads filled one period of embed and head; the blocks wait for the round
    assert [(m, r) for m, r, _ in _steps(client)] == [(modules[0, 0], 0), (modules[3, 0], 0)]
    assert executor.work() == 2
    for p in (2, 3):
        assert _train_and_upload(client, bodies[p], islands[p][1]).status_code == 200  # type: ignore[arg-type]
    assert executor.work() == 2 + 4  # the async levels' second period and the round's 4 block modules
    final = client.get(f"/v1/runs/{run['id']}", headers=A).json()
    assert final["status"] == "finished"
    versions = {(m["level"], m["index"]): (m["mode"], m["version"]) for m in _modules(client, run["id"])}
    assert versions[0, 0] == ("async", 2) and versions[1, 0] == ("round", 1) and versions[3, 0] == ("async", 2)
    parts = client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    # paths 2 and 3 leased before the first embed step: one step stale on the async levels only
    late = [c for c in parts if c["path_index"] in (2, 3)]
    assert all([m["staleness"] for m in c["modules"]] == [1, 0, 0, 1] for c in late)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"min_inner_steps": 1, "max_inner_steps": 4}, "need every level async"),
        ({"sync": "async", "min_inner_steps": 1}, "set both or neither"),
        ({"sync": "async", "min_inner_steps": 3, "max_inner_steps": 4}, "must lie within"),
        ({"layout": "embed:shared:later, b0-0:routed2, b1-1:routed2, head:shared"}, "unknown update mode 'later'"),
        ({"sync": "sometimes"}, "sync"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"dn_period": 0}, "dn_period"),
        ({"path_leases": 2}, "path sharing) needs every level async"),
        ({"sync": "async", "path_leases": 0}, "path_leases"),
        ({"sync": "async", "outer": {"async_lr": 0}}, "async_lr"),
        ({"sync": "async", "outer": {"async_lr": "fast"}}, "async_lr"),
        ({"sync": "async", "outer": {"async_momentum": 1}}, "async_momentum"),
        ({"sync": "async", "outer": {"async_momentum": -0.1}}, "async_momentum"),
        ({"outer": {"async_lr": 0.3}}, "outer.async_lr step the modules of async levels, and this run has none"),
        ({"outer": {"async_momentum": 0.5, "async_lr": 0.3}}, "outer.async_lr and outer.async_momentum step"),
    ],
)
def test_bad_async_settings_are_refused_with_422(client: TestClient, spec: dict[str, Any], message: str) -> None:
    r = client.post("/v1/runs", json={**TINY_RUN, "name": "bad", "inner_steps": 2, **spec}, headers=A)
    assert r.status_code == 422, r.text
    assert message in r.text
    assert client.get("/v1/runs", headers=A).json()["data"] == []


@pytest.mark.parametrize(
    ("spec", "stored", "momentum"),
    [
        ({}, None, None),  # round levels only: no async step size
        ({"sync": "async"}, 0.35, 0.6),  # half of outer.lr, 0.6
        ({"sync": "async", "outer": {"lr": 0.4, "momentum": 0.95}}, 0.2, 0.6),
        ({"sync": "async", "outer": {"async_lr": 0.5, "async_momentum": 0.0}}, 0.5, 0.0),
        ({"layout": "embed:shared:async, b0-0:routed2, b1-1:routed2, head:shared:async"}, 0.35, 0.6),  # hybrid
    ],
)
def test_a_run_with_async_levels_stores_its_async_step_size_and_momentum(
    client: TestClient, spec: dict[str, Any], stored: float | None, momentum: float | None
) -> None:
    r = client.post("/v1/runs", json={**TINY_RUN, "name": "lr", "inner_steps": 2, **spec}, headers=A)
    assert r.status_code == 201, r.text
    outer = client.get(f"/v1/runs/{r.json()['id']}", headers=A).json()["config"]["outer"]
    assert outer["async_lr"] == pytest.approx(stored) if stored is not None else outer["async_lr"] is None
    assert outer["async_momentum"] == momentum
    assert outer["lr"] == spec.get("outer", {}).get("lr", 0.7)
    assert outer["momentum"] == spec.get("outer", {}).get("momentum", 0.9)


def test_dynamic_local_updates_scale_each_lease_with_its_island_speed(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """Joined with probes of 400 and 100 tokens/s, the slow island's first lease is a quarter as long (clamped
    to the bounds); once it has uploaded, its measured speed decides."""
    client = no_executors
    # 600 tokens: fast's second lease (H 6 from 256) fits whole, not cut to the shard's tail
    run = create_running_run(client, name="dlu", sync="async", inner_steps=4, num_rounds=6, min_inner_steps=2,
                             max_inner_steps=8, num_tokens=600)  # fmt: skip
    ids = []
    for name, speed in (("fast", 400.0), ("slow", 100.0)):
        r = client.post("/v1/islands", json={"name": name, "capabilities": {"tokens_per_s": speed}}, headers=J)
        assert r.status_code == 201, r.text
        ids.append((r.json()["island_id"], {"Authorization": f"Bearer {r.json()['token']}"}))
    (fast_id, fast_h), (slow_id, slow_h) = ids
    slow_lease = lease(client, slow_id, slow_h)
    fast_lease = lease(client, fast_id, fast_h)
    assert slow_lease is not None and fast_lease is not None
    assert slow_lease["inner_steps"] == 2  # 4 x 100/400 = 1, clamped to min_inner_steps
    assert fast_lease["inner_steps"] == 8  # 4 x 400/100 = 16, clamped to max_inner_steps
    batch, seq = run["config"]["inner"]["batch_size"], run["config"]["model"]["seq_len"]
    assert slow_lease["token_end"] - slow_lease["token_start"] == 2 * batch * seq + 1
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        held = session.scalars(select(Lease.inner_steps).order_by(Lease.id)).all()
    assert held == [2, 8]
    # both upload after the same wall time: measured, fast trained 4x the tokens per second; against the median
    # of the two (2.5x slow's), fast's next lease is 4 x 1.6 = 6 steps (its probe said 16, clamped to 8)
    clock.advance(10)
    assert _train_and_upload(client, slow_lease, slow_h).status_code == 200
    assert _train_and_upload(client, fast_lease, fast_h).status_code == 200
    assert app_executor(client, clock).work() == 1  # the routed module paths 0 and 1 share
    slow_again, fast_again = lease(client, slow_id, slow_h), lease(client, fast_id, fast_h)
    assert slow_again is not None and fast_again is not None
    assert (slow_again["path_index"], slow_again["inner_steps"], slow_again["first_step"]) == (0, 2, 2)
    assert (fast_again["path_index"], fast_again["inner_steps"], fast_again["first_step"]) == (1, 6, 8)


def _join_probed(client: TestClient, name: str, speed: float) -> tuple[int, dict[str, str]]:
    r = client.post("/v1/islands", json={"name": name, "capabilities": {"tokens_per_s": speed}}, headers=J)
    assert r.status_code == 201, r.text
    return r.json()["island_id"], {"Authorization": f"Bearer {r.json()['token']}"}


def test_a_first_lease_is_scaled_against_the_run_s_islands_not_another_run_s(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """Two runs on one coordinator: four fast islands (probe 1600) hold every path of the older run, slow ones
    (probes 100, 200) train the newer async run with dynamic H. The fast islands never lease in it, so their
    probes do not set its median (they did: every slow island's first lease was cut to min_inner_steps)."""
    client = no_executors
    older = create_running_run(client, name="older")  # round levels, 4 paths
    fast = [_join_probed(client, f"gpu-{i}", 1600.0) for i in range(4)]
    assert [body["run_id"] for body in (lease(client, *f) for f in fast) if body] == [older["id"]] * 4
    run = create_running_run(client, name="dlu", sync="async", inner_steps=4, num_rounds=6, min_inner_steps=2,
                             max_inner_steps=8)  # fmt: skip
    slow = _join_probed(client, "cpu-slow", 100.0)
    first = lease(client, *slow)
    assert first is not None and first["run_id"] == run["id"]
    assert first["inner_steps"] == 4  # the only island of the run: the run's H (it was 2: 4 x 100/1600, clamped)
    faster = _join_probed(client, "cpu-fast", 200.0)
    second = lease(client, *faster)
    assert second is not None and second["run_id"] == run["id"]
    assert second["inner_steps"] == 8  # 4 x 200/100 against the run's other island (it was 2: 4 x 200/1600)
    # an island that has leased nowhere yet counts too (this run's work may be its first): the median of 100,
    # 200 and its 1000 is 200
    _join_probed(client, "cpu-new", 1000.0)
    third = lease(client, *_join_probed(client, "cpu-last", 300.0))
    assert third is not None and third["run_id"] == run["id"]
    assert third["inner_steps"] == 6  # 4 x 300/200 (it was 2: 4 x 300/1600, clamped)


def test_an_island_s_speed_is_measured_on_its_lease_not_the_tokens_it_reports(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """Two islands alike (same probe, same wall time); one says it trained 100x the tokens of its lease. Its next
    H is the same as the other's: the coordinator counts the tokens it leased (it used to give it max_inner_steps
    and the honest island min_inner_steps)."""
    client = no_executors
    create_running_run(client, name="dlu", sync="async", inner_steps=4, num_rounds=6, min_inner_steps=2,
                       max_inner_steps=8)  # fmt: skip
    (honest, honest_h), (liar, liar_h) = _join_probed(client, "honest", 100.0), _join_probed(client, "liar", 100.0)
    first = {
        name: lease(client, island, h) for name, island, h in (("honest", honest, honest_h), ("liar", liar, liar_h))
    }
    assert all(body is not None and body["inner_steps"] == 4 for body in first.values())
    clock.advance(10)
    for name, h, factor in (("honest", honest_h, 1), ("liar", liar_h, 100)):
        body = first[name]
        assert body is not None
        tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"] * factor
        assert upload(client, body, h, train_lease(client, body, h), tokens=tokens).status_code == 200
    assert app_executor(client, clock).work() == 1  # the routed module paths 0 and 1 share
    again = [lease(client, honest, honest_h), lease(client, liar, liar_h)]
    assert [body["inner_steps"] for body in again if body] == [4, 4]


@pytest.mark.parametrize(
    ("spec", "ranges"),
    [
        # async, fixed H 4: the 88 tokens after 512 hold 2 steps (64 + 1), taken by a lease of 2 steps
        ({"sync": "async"}, [(0, 0, 4), (0, 128, 4), (0, 256, 4), (0, 384, 4), (0, 512, 2), (1, 0, 4), (1, 128, 2)]),
        # async, min_inner_steps 3: 2 steps are too few, the lease starts the next epoch
        (
            {"sync": "async", "min_inner_steps": 3, "max_inner_steps": 8},
            [(0, 0, 4), (0, 128, 4), (0, 256, 4), (0, 384, 4), (1, 0, 4), (1, 128, 4)],
        ),
        # round: H is the round's, the lease starts the next epoch
        ({"sync": "round"}, [(0, 0, 4), (0, 128, 4), (0, 256, 4), (0, 384, 4), (1, 0, 4), (1, 128, 4)]),
    ],
    ids=["async", "async-min-steps", "round"],
)
def test_an_async_lease_takes_the_shard_tail_in_fewer_steps(
    no_executors: TestClient, clock: FakeClock, spec: dict[str, Any], ranges: list[tuple[int, int, int]]
) -> None:
    """A 600-token shard, leases of H 4 (129 tokens): after 4 leases 88 tokens are left. An async lease takes them
    with as many whole steps as fit (2) when that is at least min_inner_steps (1 when unset); a round lease
    starts the next epoch."""
    client = no_executors
    run = create_running_run(client, name="tail", num_tokens=600, layout="embed:shared, b0-1:shared, head:shared",
                             inner_steps=4, num_rounds=6, **spec)  # fmt: skip
    island_id, h = join(client)
    got = []
    while (body := lease(client, island_id, h)) is not None:
        got.append((body["epoch"], body["token_start"], body["inner_steps"]))
        assert body["token_end"] == body["token_start"] + body["inner_steps"] * 2 * 16 + 1
        assert _train_and_upload(client, body, h).status_code == 200
        while app_executor(client, clock).work():
            pass
    assert got == ranges
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished"


def test_an_async_island_keeps_its_path_across_a_module_step(no_executors: TestClient, clock: FakeClock) -> None:
    """Its AdamW state and error-feedback residual live with its path: while a module of that path waits for an
    executor the island waits too (it used to take another path cold), and another island does not take the
    path between two of its leases (an island without a path of its own shares a held one instead)."""
    client = no_executors
    create_running_run(client, name="sticky", **(ASYNC | {"num_rounds": 4}))
    a, b = join(client, "a"), join(client, "b")
    first_a, first_b = lease(client, *a), lease(client, *b)
    assert first_a is not None and first_b is not None
    assert (first_a["path_index"], first_b["path_index"]) == (0, 1)
    assert _train_and_upload(client, first_a, a[1]).status_code == 200
    assert _train_and_upload(client, first_b, b[1]).status_code == 200
    # b0 module 0 (paths 0 and 1) has a full period: its step is due; paths 2 and 3 are free, and cold for both
    assert len(_steps(client)) == 1
    assert lease(client, *a) is None and lease(client, *b) is None
    assert app_executor(client, clock).work() == 1
    again_a, again_b = lease(client, *a), lease(client, *b)
    assert again_a is not None and again_b is not None
    assert (again_a["path_index"], again_b["path_index"]) == (0, 1)
    c, d = join(client, "c"), join(client, "d")
    assert [x["path_index"] for x in (lease(client, *c), lease(client, *d)) if x] == [2, 3]
    # b's upload fills b1 module 1's period (paths 1 and 3); once stepped, path 1 is free but stays b's
    assert _train_and_upload(client, again_b, b[1]).status_code == 200
    assert app_executor(client, clock).work() == 1
    e = join(client, "e")
    helper = lease(client, *e)  # no home path of its own: it shares the least-trained held path, not b's path 1
    assert helper is not None and helper["path_index"] == 2
    back = lease(client, *b)
    assert back is not None and back["path_index"] == 1


def test_only_steps_of_async_modules_change_the_work_signature(no_executors: TestClient, clock: FakeClock) -> None:
    """The sweeper wakes every waiting lease request when the signature changes: a closing round's module steps
    free no path (its successor opening does), so they must not wake the round's islands, each of which would
    then query the database at every step of the apply; an async module's step does free paths."""
    client = no_executors
    state = client.app.state.dipaco  # type: ignore[attr-defined]

    def steps_term() -> int:
        with state.sessions() as session:
            return work_signature(session, now=clock(), reserve_s=10)[4]

    create_running_run(client, name="round")
    islands = [join(client, f"island-{p}") for p in range(4)]
    for body, (_, h) in zip([lease(client, i, h) for i, h in islands], islands, strict=True):
        assert body is not None and upload(client, body, h, train_lease(client, body, h)).status_code == 200
    assert len([s for s in _steps(client) if s[2] != "done"]) > 0  # the round closed: its steps wait
    assert steps_term() == 0
    create_running_run(client, name="async", **ASYNC)
    a, b = join(client, "a"), join(client, "b")
    first_a, first_b = lease(client, *a), lease(client, *b)
    assert first_a is not None and first_b is not None
    assert _train_and_upload(client, first_a, a[1]).status_code == 200
    assert _train_and_upload(client, first_b, b[1]).status_code == 200  # fills a routed module's period
    assert steps_term() == 1


def _commits(client: TestClient) -> list[int]:
    """A counter of the database's commits from now on made on this thread (every session of the app's engine; not
    the app's own background work, such as its sweep, on its threads)."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    engine = state.sessions.kw["bind"]
    seen = [0]
    mine = threading.get_ident()

    def count(conn: Any) -> None:
        if threading.get_ident() == mine:
            seen[0] += 1

    event.listen(engine, "commit", count)
    return seen


def _all_paths_uploaded(client: TestClient, run: dict[str, Any]) -> dict[tuple[int, int], int]:
    """Every path of a fresh async 2x2 run trained and uploaded once: each of the 6 modules has a step due."""
    islands = [join(client, f"island-{p}") for p in range(4)]
    for (_, h), body in zip(islands, [lease(client, i, h) for i, h in islands], strict=True):
        assert body is not None
        assert _train_and_upload(client, body, h).status_code == 200
    modules = {(m["level"], m["index"]): m["id"] for m in _modules(client, run["id"])}
    assert sorted(m for m, _, _ in _steps(client)) == sorted(modules.values())
    return modules


def test_an_async_run_s_due_steps_are_claimed_together_and_committed_in_one_transaction(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """The steps due on a run's async modules are claimed by one executor at once and committed in one transaction
    (two commits for six steps: the claim's and the steps'), each module stepped once; a round's steps are
    claimed one at a time, so that executors split a round between them."""
    client = no_executors
    run = create_running_run(client, name="batch", **ASYNC)
    modules = _all_paths_uploaded(client, run)
    done: list[StepDone] = []
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    executor = ApplyExecutor(
        sessions=state.sessions, blobs=state.blobs, clock=clock, name="test-0", on_step=done.append
    )
    commits = _commits(client)
    assert executor.work() == 6
    assert commits[0] == 2
    assert sorted(d.module_id for d in done) == sorted(modules.values()) and all(d.async_step for d in done)
    assert all(m["version"] == 1 for m in _modules(client, run["id"]))
    assert executor.work() == 0
    round_run = closed_round(client, name="round")
    with state.sessions() as session:
        claims = claim_steps(session, "one-at-a-time", now=clock())
    assert len(claims) == 1 and claims[0].run_id == round_run["id"]


def test_a_batch_drops_only_the_step_whose_claim_was_taken_over(no_executors: TestClient, clock: FakeClock) -> None:
    """An executor claims the six due steps of an async run, stalls past `claim_s`; another executor takes one of
    them over and commits it. The stalled executor's commit then steps the other five and drops that one: every
    module is stepped exactly once."""
    client = no_executors
    run = create_running_run(client, name="taken", **ASYNC)
    _all_paths_uploaded(client, run)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    slow = ApplyExecutor(sessions=state.sessions, blobs=state.blobs, clock=clock, name="slow-1234-0", claim_s=60)
    with state.sessions() as session:
        claims = claim_steps(session, slow.name, now=clock(), claim_s=60)
        assert len(claims) == 6
        clock.advance(61)
        taken = claim_step(session, "fast-1234-0", now=clock(), claim_s=60)  # one: it takes no batch of stale ones
        assert taken is not None and taken.step_id == claims[0].step_id
        assert apply_step(session, state.blobs, taken, "fast-1234-0", clock=clock) is not None
        results = slow._apply(session, claims)
    assert [r is None for r in results] == [True] + [False] * 5
    versions = [(m["id"], m["version"]) for m in _modules(client, run["id"])]
    assert all(v == 1 for _, v in versions), versions
    with state.sessions() as session:
        rows = session.execute(select(ModuleStep.module_id, ModuleStep.status, ModuleStep.claimed_by)).all()
    assert sorted(str(s) for _, s, _ in rows) == ["done"] * 6
    assert sum(by == "fast-1234-0" for _, _, by in rows) == 1
