"""`dipaco island join --nproc 2`, and the same under `torchrun --nproc-per-node 2`: a 2-process gloo island
(rank 0 talks to the coordinator, DDP inside) trains a run to the end against a real coordinator. Numerical
equality with one process: tests/island/test_island_ddp.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    ISLAND_DB_PARAMS,
    TORCHRUN_2,
    Cluster,
    create_run,
    island_database_url,
    wait_finished,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(params=ISLAND_DB_PARAMS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """SQLite only unless DIPACO_FULL_MATRIX=1 (see tests/integration/conftest.py)."""
    return island_database_url(request, tmp_path)


SPEC = {
    "name": "nproc",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-1:routed2, head:shared",
    "inner": {"batch_size": 4, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 3,
    "num_rounds": 2,
    "lease_ttl_s": 60,
}


def test_two_process_island_trains_a_run_to_the_end(cluster: Cluster) -> None:
    cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, SPEC)
        island = cluster.start_island("ddp", "--nproc", "2", "--no-probe")
        wait_finished(cluster, client, run_id, timeout_s=90)
        assert island.wait(timeout=60) == 0, cluster.log("ddp")
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()["data"]
        contributions = client.get("/v1/contributions", params={"run_id": run_id}).json()

    assert sorted(m["version"] for m in modules) == [2, 2, 2, 2]
    assert contributions["count"] == 4  # 2 paths x 2 rounds, all from the one (2-process) island
    assert len({c["island_id"] for c in contributions["data"]}) == 1
    assert "x 2 process(es)" in cluster.log("ddp")


def test_torchrun_launches_a_two_rank_island_that_trains_a_run_to_the_end(cluster: Cluster) -> None:
    """The launch the Kubernetes GPU overlay uses (`torchrun --nproc-per-node N -m dipaco island join`): torchrun's
    own rendezvous, RANK / WORLD_SIZE / MASTER_* from it, rank 1 a follower; here with gloo on the CPU."""
    cluster.start_coordinator()
    with cluster.admin() as client:
        run_id = create_run(client, SPEC)
        island = cluster.start_island("torchrun", "--no-probe", wrap=TORCHRUN_2)
        wait_finished(cluster, client, run_id, timeout_s=90)
        assert island.wait(timeout=60) == 0, cluster.log("torchrun")
        contributions = client.get("/v1/contributions", params={"run_id": run_id}).json()

    assert contributions["count"] == 4 and len({c["island_id"] for c in contributions["data"]}) == 1
    assert "x 2 process(es)" in cluster.log("torchrun")
