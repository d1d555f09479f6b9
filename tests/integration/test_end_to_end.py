"""A real coordinator process and two island processes over HTTP train a tiny 2x2 DiPaCo for 2 rounds.

The test then recomputes every outer step from what the islands uploaded: for each module and round, the new
weights must equal one Nesterov step on the mean of the outer gradients of the paths through that module.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ADMIN
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster, create_run, wait_finished, wait_islands_joined

pytestmark = pytest.mark.integration

SPEC = {
    "name": "e2e",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 3,
    "num_rounds": 2,
    "lease_ttl_s": 60,
}


def test_two_islands_two_rounds_outer_steps_recomputed(cluster: Cluster) -> None:
    cluster.start_coordinator()
    with cluster.admin() as client:
        # 8 leases in all; --max-rounds 4 makes each island take exactly half of them
        a = cluster.start_island("island-a", "--max-rounds", "4")
        b = cluster.start_island("island-b", "--max-rounds", "4")
        wait_islands_joined(client, 2)  # islands wait for a run; start it once both are in
        run_id = create_run(client, SPEC)
        wait_finished(cluster, client, run_id)
        assert a.wait(timeout=60) == 0, cluster.log("island-a")
        assert b.wait(timeout=60) == 0, cluster.log("island-b")
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()
        paths = client.get("/v1/paths", params={"run_id": run_id}).json()
        islands = client.get("/v1/islands").json()
        contributions = client.get("/v1/contributions", params={"run_id": run_id}).json()

    assert modules["count"] == 6 and all(m["version"] == 2 for m in modules["data"])
    assert paths["count"] == 4 and all(p["tokens_trained"] > 0 for p in paths["data"])
    assert {i["status"] for i in islands["data"]} == {"left"}
    assert contributions["count"] == 8
    # both islands did real work
    assert len({c["island_id"] for c in contributions["data"]}) == 2

    verify_run(cluster.database_url, cluster.data_dir / "blobs", run_id)

    # the registry CLI shows the same registry: JSON on request, a table by default
    env = {**cluster.env(), "DIPACO_TOKEN": ADMIN}
    cli = [sys.executable, "-m", "dipaco", "registry"]
    out = subprocess.run(
        [*cli, "modules", "--coordinator", cluster.url, "--json", "--run-id", str(run_id)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    listed = json.loads(out)
    assert listed["count"] == 6 and {m["version"] for m in listed["data"]} == {2}
    table = subprocess.run(
        [*cli, "paths", "--coordinator", cluster.url], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert "paths (4)" in table and "[0, 1, 1, 0]" in table
    refused = subprocess.run(
        [*cli, "runs", "--coordinator", cluster.url, "--token", "wrong"], capture_output=True, text=True, env=env
    )
    assert refused.returncode != 0 and "unknown token" in refused.stderr
