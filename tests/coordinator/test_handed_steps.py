"""Steps handed over: an upload that makes async module steps due claims them, in its own transaction, for its
process's apply executor (`periods.make_due`, `RoundCloser.hand`), where no earlier step of the module is left;
the executor takes them up without a claim transaction of its own. Through the real app, on SQLite and
PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from coordinator.app import create_app
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import ModuleStep
from coordinator.services.apply import executor_name
from coordinator.settings import Settings
from coordinator.states import StepStatus
from tests.conftest import FakeClock
from tests.coordinator.helpers import (
    A,
    app_executor,
    create_running_run,
    eventually,
    join,
    lease,
    train_lease,
    upload,
)
from tests.coordinator.test_overlap import OVERLAP, commits

ME = executor_name(0)
"""What this process's first executor is called, as the app names it."""


def _steps(client: TestClient, run_id: int) -> list[tuple[int, int, StepStatus, str | None, int]]:
    """(round, module id, status, claimed_by, attempts) of the run's module steps, oldest first."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    with state.sessions() as session:
        rows = session.execute(
            select(
                ModuleStep.round, ModuleStep.module_id, ModuleStep.status, ModuleStep.claimed_by, ModuleStep.attempts
            )
            .where(ModuleStep.run_id == run_id)
            .order_by(ModuleStep.id)
        ).all()
    return [tuple(r) for r in rows]  # type: ignore[misc]


def _upload(client: TestClient, body: dict[str, Any], h: dict[str, str], **kw: Any) -> Any:
    tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"]
    reply = upload(client, body, h, train_lease(client, body, h), tokens=tokens, **kw)
    assert reply.status_code == 200, reply.text
    return reply


def test_an_upload_claims_the_steps_it_makes_due_for_its_executor(quiet: TestClient, clock: FakeClock) -> None:
    client = quiet
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    state.closer.claimer = ME
    run = create_running_run(client, name="handed", **OVERLAP)
    (i0, h0), (i1, h1) = join(client, "one"), join(client, "other")
    first, second = lease(client, i0, h0), lease(client, i1, h1)
    assert first is not None and second is not None and first["path_id"] != second["path_id"]
    mine = {m["module_id"] for m in first["modules"]}
    shared = mine & {m["module_id"] for m in second["modules"]}
    assert shared and shared != mine  # the 2x2: embed and head shared, a routed block each of its own or not

    _upload(client, first, h0, next_lease=True, overlap=True)
    # dn_period 1: every module of the path steps; none had a step left, so all four are this executor's
    assert [(s[1], s[2], s[3], s[4]) for s in _steps(client, run["id"])] == [
        (m["module_id"], StepStatus.RUNNING, ME, 1) for m in first["modules"]
    ]
    with commits(client) as seen:
        _upload(client, second, h1)
    assert len(seen) == 1  # the claims ride on the upload's commit
    # the modules the first upload stepped have a step left: the second's wait, unclaimed, for any executor
    theirs = [s for s in _steps(client, run["id"]) if s[0] == 1 or s[1] not in mine]
    assert sorted((s[1], s[2], s[3]) for s in theirs) == sorted(
        (m["module_id"], StepStatus.PENDING, None)
        if m["module_id"] in shared
        else (m["module_id"], StepStatus.RUNNING, ME)
        for m in second["modules"]
    )
    # another executor finds nothing it may take: the pending steps wait for the handed ones of their modules
    assert app_executor(client, clock, name="test-1").work() == 0
    # the handed steps are taken up with one commit per upload's batch, no claim; then the pending ones
    with commits(client) as seen:
        assert app_executor(client, clock, name=ME, handed=True).work() == 8
    assert len(seen) == 2 + 2  # two handed batches; one claim and one commit for the shared modules' steps
    assert state.closer.take_handed() == []
    assert {s[2] for s in _steps(client, run["id"])} == {StepStatus.DONE}
    modules = {m["id"]: m["version"] for m in client.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]}
    assert {m: modules[m] for m in mine | {m["module_id"] for m in second["modules"]}} == {
        m: 2 if m in shared else 1 for m in mine | {m["module_id"] for m in second["modules"]}
    }


def test_without_an_executor_in_the_process_nothing_is_claimed(quiet: TestClient, clock: FakeClock) -> None:
    """`--apply-workers 0`: the steps wait for any executor, as before."""
    client = quiet
    run = create_running_run(client, name="unclaimed", **OVERLAP)
    island, h = join(client, "one")
    body = lease(client, island, h)
    assert body is not None
    _upload(client, body, h)
    assert {(s[2], s[3], s[4]) for s in _steps(client, run["id"])} == {(StepStatus.PENDING, None, 0)}
    assert client.app.state.dipaco.closer.take_handed() == []  # type: ignore[attr-defined]


def test_steps_handed_over_and_not_taken_up_go_back_at_shutdown(settings: Settings, clock: FakeClock) -> None:
    settings.apply_workers = 0
    settings.sweep_interval_s = 3600
    with TestClient(create_app(settings, clock=clock)) as client:
        client.app.state.dipaco.closer.claimer = ME  # type: ignore[attr-defined]
        run = create_running_run(client, name="shutdown", **OVERLAP)
        island, h = join(client, "one")
        body = lease(client, island, h)
        assert body is not None
        _upload(client, body, h)
        assert {s[3] for s in _steps(client, run["id"])} == {ME}
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            left = session.execute(select(ModuleStep.status, ModuleStep.claimed_by)).all()
    finally:
        engine.dispose()
    assert left and {tuple(r) for r in left} == {(StepStatus.PENDING, None)}


@pytest.mark.parametrize("overlap", [True, False])
def test_the_app_executor_takes_up_what_uploads_hand_it(client: TestClient, overlap: bool) -> None:
    """The app as served (one executor): an upload's steps land without anyone else claiming them."""
    state = client.app.state.dipaco  # type: ignore[attr-defined]
    assert state.closer.claimer == ME
    run = create_running_run(client, name="served", **{**OVERLAP, "overlap": overlap})
    island, h = join(client, "one")
    body = lease(client, island, h)
    assert body is not None
    _upload(client, body, h)
    steps = eventually(lambda: _steps(client, run["id"]), lambda s: {x[2] for x in s} == {StepStatus.DONE})
    assert [(s[2], s[3], s[4]) for s in steps] == [(StepStatus.DONE, ME, 1)] * 4
