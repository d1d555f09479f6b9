"""Two coordinator processes on one PostgreSQL database (and one blob store) serve islands at once: every
round is applied exactly once."""

from __future__ import annotations

import pytest

from island.distributed import free_port
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster, create_run, typed, wait_finished, wait_islands_joined

pytestmark = pytest.mark.integration

SPEC = {
    "name": "replicas",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 0, "lr": 0.01},
    "inner_steps": 2,
    "num_rounds": 3,
    "lease_ttl_s": 60,
}


@pytest.mark.postgres
def test_two_coordinators_apply_each_round_once(tmp_path: object, postgres_url: str) -> None:
    from pathlib import Path

    cluster = Cluster(tmp=Path(str(tmp_path)), database_url=postgres_url)
    try:
        cluster.start_coordinator()
        second = free_port()
        cluster.start_coordinator(port=second)
        with cluster.admin() as client:
            # 12 leases in all; --max-rounds 6 makes each island (so each replica) take exactly half of them
            a = cluster.start_island("island-a", "--max-rounds", "6")
            b = cluster.start_island("island-b", "--max-rounds", "6", url=f"http://127.0.0.1:{second}")
            wait_islands_joined(client, 2)  # islands wait for a run; start it once both are in
            run_id = create_run(client, SPEC)
            wait_finished(cluster, client, run_id)
            contributions = typed(client).contributions(run_id=run_id)
        assert a.wait(timeout=60) == 0 and b.wait(timeout=60) == 0
        assert len(contributions) == 12
        assert len({c.island_id for c in contributions}) == 2  # both replicas served uploads
        verify_run(cluster.database_url, cluster.data_dir / "blobs", run_id)
    finally:
        cluster.stop()
