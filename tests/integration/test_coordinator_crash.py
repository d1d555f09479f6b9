"""The coordinator killed with SIGKILL in the middle of an upload and of a round apply, then restarted: the run
completes, every round is applied exactly once, and module versions match their recomputed outer steps. The same
for an all-async run (a period's step killed mid-commit, an upload killed after it filled a period): every
contribution is in exactly one period, every period applied once."""

from __future__ import annotations

import signal
import time

import pytest

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


@pytest.mark.parametrize(
    ("point", "sync"),
    [
        ("upload.before_commit", "round"),
        ("apply.before_commit", "round"),
        ("upload.before_commit", "async"),
        ("apply.before_commit", "async"),
    ],
)
def test_sigkill_mid_transaction_then_restart(cluster: Cluster, point: str, sync: str) -> None:
    coordinator = cluster.start_coordinator(env={"DIPACO_FAULT_PAUSE_AT": point})
    with cluster.admin() as client:
        run_id = create_run(client, {**SPEC, "sync": sync, "dn_period": 3})
    # --exit-when-idle: an island that joins only after the run finished leaves instead of waiting for a new run
    islands = [cluster.start_island(f"island-{i}", "--give-up-after", "120", "--exit-when-idle") for i in range(2)]
    marker = cluster.data_dir / f"fault-{point}.reached"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline, f"fault point {point} never reached\n{cluster.log('coordinator')}"
        time.sleep(0.1)
    coordinator.send_signal(signal.SIGKILL)
    assert coordinator.wait(timeout=10) == -signal.SIGKILL  # the fault fired: killed mid-transaction
    marker.unlink()
    cluster.start_coordinator()
    with cluster.admin() as client:
        wait_finished(cluster, client, run_id)
        assert client.get(f"/v1/contributions?run_id={run_id}").json()["count"] == 8
    for i, proc in enumerate(islands):
        assert proc.wait(timeout=60) == 0, cluster.log(f"island-{i}")
    verify_run(cluster.database_url, cluster.data_dir / "blobs", run_id)
