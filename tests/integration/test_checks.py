"""`checks.verify_run` catches a contribution part that joined no applied module step. A hybrid run (async embed
and head, round blocks) driven through the app by hand; before the apply, one part of an accepted upload is put
out of every step (as a bug in the upload's step assignment would), so the apply folds the others only and the
recomputed versions agree with the stored ones: only `check_parts_in_applied_steps` can tell."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from coordinator.app import create_app
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import ContributionGrad
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.coordinator.helpers import A, app_executor, create_running_run, join, lease, train_lease, upload
from tests.integration.checks import verify_run

HYBRID = "embed:shared:async, b0-0:routed2, b1-1:routed2, head:shared:async"


@pytest.fixture
def client(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    settings.apply_workers = 0  # steps wait for the test's executor, so a part can be changed before its apply
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


def _train_and_upload(client: TestClient, body: dict[str, Any], headers: dict[str, str]) -> None:
    tokens = body["inner_steps"] * body["inner"]["batch_size"] * body["model"]["seq_len"]
    r = upload(client, body, headers, train_lease(client, body, headers), tokens=tokens)
    assert r.status_code == 200, r.text


def _set_step(database_url: str, contribution_id: int, module_id: int, step: int | None) -> None:
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            changed = session.execute(
                update(ContributionGrad)
                .where(ContributionGrad.contribution_id == contribution_id, ContributionGrad.module_id == module_id)
                .values(step=step)
            )
            assert changed.rowcount == 1  # type: ignore[attr-defined]
            session.commit()
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("level", "step", "message"),
    [
        (None, None, None),  # untouched: the check passes
        (0, None, "the part joined no step"),  # embed (async)
        (1, None, "the part joined no step"),  # b0 (round)
        (0, 5, "the part joined step 5, never applied"),  # embed takes 2 steps: periods 0 and 1
    ],
    ids=["untouched", "async-part-no-step", "round-part-no-step", "async-part-unapplied-period"],
)
def test_verify_run_fails_on_a_part_outside_every_applied_step(
    client: TestClient, clock: FakeClock, settings: Settings, level: int | None, step: int | None, message: str | None
) -> None:
    run = create_running_run(client, name="hybrid", layout=HYBRID, dn_period=2, inner_steps=2, num_rounds=1)
    islands = [join(client, f"island-{p}") for p in range(4)]
    bodies = [lease(client, i, h) for i, h in islands]
    for p in (0, 1):
        _train_and_upload(client, bodies[p], islands[p][1])  # type: ignore[arg-type]
    if level is not None:
        (second,) = [
            c
            for c in client.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
            if c["path_index"] == 1
        ]
        _set_step(settings.resolved_database_url, second["id"], second["modules"][level]["module_id"], step)
    executor = app_executor(client, clock)
    assert executor.work() == 2  # embed's and head's first period
    for p in (2, 3):
        _train_and_upload(client, bodies[p], islands[p][1])  # type: ignore[arg-type]
    assert executor.work() == 2 + 4  # their second period, and the round's 4 block modules
    assert client.get(f"/v1/runs/{run['id']}", headers=A).json()["status"] == "finished"
    blobs = settings.data_dir / "blobs"
    if message is None:
        verify_run(settings.resolved_database_url, blobs, run["id"])
    else:
        with pytest.raises(AssertionError, match=message):
            verify_run(settings.resolved_database_url, blobs, run["id"])
