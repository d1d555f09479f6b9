"""Apply executors: a closed round's module steps are claimed, stepped and committed exactly once, whatever
executor dies or stalls, and the round is applied with its last step."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from coordinator.faults import FaultInjector
from coordinator.models import Lease, Module, ModuleStep
from coordinator.services import leases
from coordinator.services.apply import (
    ApplyExecutor,
    StepDone,
    apply_step,
    claim_step,
    release_dead_claims,
    retry_delay_s,
)
from coordinator.states import StepStatus
from tests.conftest import FakeClock
from tests.coordinator.helpers import (
    A,
    closed_round,
    create_running_run,
    join,
    lease,
    module_versions,
    train_lease,
    upload,
)


def _executor(client: TestClient, name: str, clock: FakeClock, **kwargs: Any) -> ApplyExecutor:
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    return ApplyExecutor(sessions=state.sessions, blobs=state.blobs, clock=clock, name=name, **kwargs)


def test_a_closed_round_waits_for_an_executor_and_is_applied_with_its_last_step(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = closed_round(client)
    island_id, h = join(client, "waiting")
    assert lease(client, island_id, h) is None  # closing: no work until the round is applied
    executor = _executor(client, "test-executor-0", clock)
    assert executor.work() == 6  # embed, 2 + 2 routed, head
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}
    assert executor.work() == 0  # nothing left: each step once


def test_a_step_claimed_by_a_process_that_died_is_taken_over(no_executors: TestClient, clock: FakeClock) -> None:
    client = no_executors
    closed_round(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    ghost = f"{socket.gethostname()}-999999999-0"  # a process of this host that is gone
    with state.sessions() as session:
        claimed = claim_step(session, ghost, now=clock())
        assert claimed is not None
        assert release_dead_claims(session) == 1
        step = session.get_one(ModuleStep, claimed.step_id)
        assert (step.status, step.claimed_by, step.attempts) == (StepStatus.PENDING, None, 1)
    assert _executor(client, "test-executor-0", clock).work() == 6
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}


def test_a_stale_claim_from_another_host_is_taken_over_and_its_late_commit_refused(
    no_executors: TestClient, clock: FakeClock
) -> None:
    client = no_executors
    run = closed_round(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        slow = claim_step(session, "elsewhere-1234-0", now=clock())  # alive as far as we can tell
        assert slow is not None
        assert release_dead_claims(session) == 0  # another host: only time can tell
    fresh = _executor(client, "test-executor-0", clock, claim_s=60)
    assert fresh.work() == 5  # every step but the claimed one
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    clock.advance(61)
    assert fresh.work() == 1  # the stale claim taken over: the round is applied
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1
    with state.sessions() as session:
        late = apply_step(session, state.blobs, slow, "elsewhere-1234-0", clock=clock)
    assert late is None  # the slow executor's result is dropped
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}


@dataclass(frozen=True, slots=True)
class HeldAt(FaultInjector):
    """An executor that reaches `pause_at` waits there until `release` is set; `reached` says it got there."""

    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def point(self, name: str) -> None:
        if name == self.pause_at:
            self.reached.set()
            assert self.release.wait(30), f"held at {name} for 30 s"


@pytest.fixture
def held_at() -> Iterator[Callable[[str], HeldAt]]:
    """`held_at(point)`: a fault that holds its executor at `point`; every hold is released at teardown."""
    holds: list[HeldAt] = []

    def hold(point: str) -> HeldAt:
        holds.append(HeldAt(pause_at=point, marker_dir=Path(".")))
        return holds[-1]

    yield hold
    for h in holds:
        h.release.set()


def test_executors_working_at_once_each_commit_steps_and_none_twice(
    no_executors: TestClient, clock: FakeClock, held_at: Callable[[str], HeldAt]
) -> None:
    """Each executor is held in the middle of its first step (its claim taken, its result not committed) until
    the next one has claimed a step of its own: three steps are in flight at once, then all go on."""
    client = no_executors
    run = closed_round(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    holds = [held_at("apply.mid_step") for _ in range(3)]
    committed: list[StepDone] = []
    executors = [
        _executor(client, f"test-executor-{i}", clock, faults=hold, on_step=committed.append)
        for i, hold in enumerate(holds)
    ]
    threads = [threading.Thread(target=e.work) for e in executors]
    for thread, hold in zip(threads, holds, strict=True):
        thread.start()
        assert hold.reached.wait(30)  # the fault fired: this executor holds a step while the earlier ones do
    with state.sessions() as session:
        in_flight = session.execute(
            select(ModuleStep.claimed_by, ModuleStep.module_id).where(ModuleStep.status == StepStatus.RUNNING)
        ).all()
    assert sorted(name for name, _ in in_flight) == [e.name for e in executors]
    assert len({module for _, module in in_flight}) == 3  # three different modules
    for hold in holds:
        hold.release.set()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert all(e.steps >= 1 for e in executors) and sum(e.steps for e in executors) == 6
    assert sorted(done.module_id for done in committed) == list(range(1, 7))  # each module stepped once
    assert [done.round_applied for done in committed].count(True) == 1
    with state.sessions() as session:
        steps = session.execute(select(ModuleStep.status, ModuleStep.claimed_by, ModuleStep.attempts)).all()
    assert {(status, attempts) for status, _, attempts in steps} == {(StepStatus.DONE, 1)}  # each claimed once
    assert Counter(name for _, name, _ in steps) == {e.name: e.steps for e in executors}
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}


def test_a_stopped_executor_commits_the_step_in_hand_and_claims_no_other(
    no_executors: TestClient, clock: FakeClock, held_at: Callable[[str], HeldAt]
) -> None:
    """SIGTERM (`apply-worker`) or the app's shutdown sets `stop` while an executor is inside a step: it commits
    that step and claims no other, so a process about to exit leaves no claim behind it (on another host, only
    `claim_s` would free one)."""
    client = no_executors
    run = closed_round(client)
    hold = held_at("apply.mid_step")
    executor = _executor(client, "stopping", clock, faults=hold)
    stop, wake = threading.Event(), threading.Event()
    thread = threading.Thread(target=executor.serve, args=(stop, wake), kwargs={"poll_s": 0.05})
    thread.start()
    assert hold.reached.wait(30)  # the fault fired: inside its first step
    stop.set()
    wake.set()
    hold.release.set()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert executor.steps == 1
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        steps = session.execute(select(ModuleStep.status, ModuleStep.claimed_by)).all()
    assert Counter(map(tuple, steps)) == {(StepStatus.DONE, "stopping"): 1, (StepStatus.PENDING, None): 5}
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0
    assert _executor(client, "next", clock).work() == 5
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}


def test_offers_an_external_executor_made_are_adopted_by_the_sweep_and_taken_up_from_memory(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """Offers made by an apply in another process (an `apply-worker`) are not in this process's offer book; the
    sweep that sees the new round puts them there, so that the islands, all asking at once, take them up in
    batches instead of one database transaction each (`leases.take_offer`)."""
    client = no_executors
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    run = create_running_run(client, name="adopt")
    islands = [join(client, f"island-{p}") for p in range(run["num_paths"])]
    for island_id, h in islands:
        body = lease(client, island_id, h)
        assert body is not None
        assert upload(client, body, h, train_lease(client, body, h)).status_code == 200
    elsewhere = _executor(client, "elsewhere", clock, affinity=state.dispatcher.affinity)  # as `apply-worker` has
    assert elsewhere.work() == 6  # and offers each island its path of round 1
    assert len(state.offers) == 0  # made elsewhere: not in this process's book
    state.dispatcher.sweep()
    assert len(state.offers) == 4
    with state.sessions() as session:
        again = leases.pending_offers(session, now=clock())
    assert len(again) == 4 and state.offers.put(again, now=clock()) == 0  # held before: not adopted twice
    for p, (island_id, h) in enumerate(islands):
        got = lease(client, island_id, h)
        assert got is not None and (got["round"], got["path_index"]) == (1, p)
        assert got["modules"][0]["version"] == 1  # the view built from the database: versions after the apply
    assert len(state.offers) == 0  # each taken from the book
    with state.sessions() as session:
        statuses = session.scalars(select(Lease.status).where(Lease.round == 1)).all()
    assert statuses == ["active"] * 4


def test_a_failing_step_is_recorded_and_tried_again_later_while_the_others_go_on(
    no_executors: TestClient, clock: FakeClock
) -> None:
    """A step whose module weights cannot be read (the blob moved away) fails: the executor gives it up at once
    with an `apply_failed` event, steps the other modules, and the step is tried again after 5 s, then 10 s; once
    the blob is back it is applied, once, and the round with it."""
    client = no_executors
    run = closed_round(client)
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        module = session.get_one(Module, 1)
        failing = session.scalar(
            select(func.count()).select_from(Module).where(Module.weights_hash == module.weights_hash)
        )
    blob = state.blobs.path(module.weights_hash)
    aside = blob.with_name(blob.name + ".aside")
    blob.rename(aside)

    def failures() -> list[dict[str, Any]]:
        r = client.get(f"/v1/events?run_id={run['id']}&kind=apply_failed", headers=A)
        assert r.status_code == 200, r.text
        return r.json()["data"]

    executor = _executor(client, "test-executor-0", clock)
    assert executor.work() == 6 - failing  # the others are stepped
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 0  # the round waits
    [first] = failures()
    assert "attempt 1" in first["detail"] and "tried again in 5 s" in first["detail"], first
    with state.sessions() as session:
        step = session.scalars(select(ModuleStep).where(ModuleStep.status != StepStatus.DONE)).all()
        assert [(s.status, s.claimed_by, s.attempts) for s in step] == [(StepStatus.RUNNING, None, 1)] * failing
    assert executor.work() == 0  # not before its delay
    clock.advance(5.1)
    assert executor.work() == 0  # fails again: twice the delay
    assert len(failures()) == 2 * failing
    assert any("attempt 2" in e["detail"] and "tried again in 10 s" in e["detail"] for e in failures())
    aside.rename(blob)
    clock.advance(5.1)
    assert executor.work() == 0
    clock.advance(5.1)
    assert executor.work() == failing
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["current_round"] == 1
    assert module_versions(client) == {m: [0, 1] for m in range(1, 7)}
    assert executor.work() == 0 and len(failures()) == 2 * failing


def test_the_retry_delay_doubles_up_to_the_claim_time() -> None:
    assert [retry_delay_s(n, 60) for n in (1, 2, 3, 4, 5)] == [5, 10, 20, 40, 60]
