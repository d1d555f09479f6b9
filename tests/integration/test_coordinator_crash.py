"""The coordinator killed with SIGKILL in the middle of an upload and of a round apply, then restarted: the run
completes, every round is applied exactly once, and module versions match their recomputed outer steps. The same
for an all-async run (a period's step killed mid-commit, and mid-math while the executor works on the steps an
upload claimed for it; an upload killed after it filled a period): every contribution is in exactly one period,
every period applied once. And for a hybrid run (async embed and head, round blocks), its apply killed once in an
async level's period step and once in a round's block step."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import select

from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Module, ModuleStep
from coordinator.states import StepStatus
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster, create_run, wait_finished

pytestmark = pytest.mark.integration

SPEC = {
    "name": "crash",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 3,
    "num_rounds": 2,
    "lease_ttl_s": 30,
}


HYBRID = "embed:shared:async, b0-0:routed2, b1-1:routed2, head:shared:async"
SCHEDULES: dict[str, dict[str, object]] = {
    "round": {"sync": "round", "dn_period": 3},
    "async": {"sync": "async", "dn_period": 3},
    # the third upload of round 0 fills embed's and head's first period: the first apply is an async step
    "hybrid": {"layout": HYBRID, "dn_period": 3},
    # round 0 closes at its fourth upload, before any period of 5 fills: the first apply is a round's block step
    "hybrid-round-first": {"layout": HYBRID, "dn_period": 5},
}


@pytest.mark.parametrize(
    ("point", "schedule"),
    [
        ("upload.before_commit", "round"),
        ("apply.before_commit", "round"),
        ("upload.before_commit", "async"),
        ("apply.before_commit", "async"),
        # the steps an upload claimed for the executor (handed over): killed while it works on the first of them
        ("apply.mid_step", "async"),
        ("upload.before_commit", "hybrid"),
        ("apply.before_commit", "hybrid"),
        ("apply.before_commit", "hybrid-round-first"),
    ],
)
def test_sigkill_mid_transaction_then_restart(cluster: Cluster, point: str, schedule: str) -> None:
    coordinator = cluster.start_coordinator(env={"DIPACO_FAULT_PAUSE_AT": point})
    with cluster.admin() as client:
        run_id = create_run(client, {**SPEC, **SCHEDULES[schedule]})
    # --exit-when-idle: an island that joins only after the run finished leaves instead of waiting for a new run
    islands = [cluster.start_island(f"island-{i}", "--give-up-after", "120", "--exit-when-idle") for i in range(2)]
    marker = cluster.data_dir / f"fault-{point}.reached"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline, f"fault point {point} never reached\n{cluster.log('coordinator')}"
        time.sleep(0.1)
    coordinator.send_signal(signal.SIGKILL)
    assert coordinator.wait(timeout=10) == -signal.SIGKILL  # the fault fired: killed mid-transaction
    if point == "apply.before_commit" and schedule.startswith("hybrid"):
        # the steps killed mid-commit (one executor, one claim) are of the kind the case is for: embed's and head's
        # periods, claimed and committed together (`apply.ASYNC_BATCH`); a round's block step, alone
        assert _running_steps(cluster.database_url) == ([True, True] if schedule == "hybrid" else [False])
    marker.unlink()
    cluster.start_coordinator()
    with cluster.admin() as client:
        wait_finished(cluster, client, run_id)
        assert client.get(f"/v1/contributions?run_id={run_id}").json()["count"] == 8
    for i, proc in enumerate(islands):
        assert proc.wait(timeout=60) == 0, cluster.log(f"island-{i}")
    verify_run(cluster.database_url, cluster.data_dir / "blobs", run_id)


def _running_steps(database_url: str) -> list[bool]:
    """Whether each module step claimed and not committed is an async module's."""
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            running = session.scalars(
                select(Module.period_size.is_not(None))
                .join(ModuleStep, ModuleStep.module_id == Module.id)
                .where(ModuleStep.status == StepStatus.RUNNING)
            )
            return [bool(is_async) for is_async in running]
    finally:
        engine.dispose()
