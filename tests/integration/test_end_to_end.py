"""A real coordinator process and two island processes over HTTP train a tiny 2x2 DiPaCo for 2 rounds.

The test then recomputes every outer step from what the islands uploaded: for each module and round, the new
weights must equal one Nesterov step on the mean of the outer gradients of the paths through that module.
"""

from __future__ import annotations

import pytest
import torch
from sqlalchemy import select

from coordinator.blobstore import LocalBlobStore
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion
from modules import OuterConfig, decode, nesterov_step
from tests.integration.conftest import Cluster, create_run, wait_finished

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
        run_id = create_run(client, SPEC)
        a = cluster.start_island("island-a")
        b = cluster.start_island("island-b")
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

    blobs = LocalBlobStore(cluster.data_dir / "blobs")
    engine = make_engine(cluster.database_url)
    outer = OuterConfig(**SPEC.get("outer", {}))  # type: ignore[arg-type]
    try:
        with make_sessionmaker(engine)() as session:
            for module in session.scalars(select(Module).where(Module.run_id == run_id)):
                history = session.scalars(
                    select(ModuleVersion).where(ModuleVersion.module_id == module.id).order_by(ModuleVersion.version)
                ).all()
                assert [h.version for h in history] == [0, 1, 2]  # applied once per round, never twice
                assert [h.round for h in history] == [None, 0, 1]
                assert history[-1].weights_hash == module.weights_hash
                for rnd in range(2):
                    grad_hashes = session.scalars(
                        select(ContributionGrad.blob_hash)
                        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
                        .where(ContributionGrad.module_id == module.id, Contribution.round == rnd)
                    ).all()
                    expected_paths = 4 if module.level_index in (0, 3) else 2
                    assert len(grad_hashes) == expected_paths
                    grads = [decode(blobs.get_bytes(h)) for h in grad_hashes]
                    mean = {k: torch.stack([g[k] for g in grads]).mean(0) for k in grads[0]}
                    base = decode(blobs.get_bytes(history[rnd].weights_hash))
                    momentum = decode(blobs.get_bytes(history[rnd].momentum_hash)) if rnd else None
                    want, want_m = nesterov_step(base, mean, momentum, outer)
                    got = decode(blobs.get_bytes(history[rnd + 1].weights_hash))
                    got_m = decode(blobs.get_bytes(history[rnd + 1].momentum_hash or ""))
                    for k in base:
                        assert not torch.equal(got[k], base[k]) or mean[k].abs().max() == 0
                        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
                        torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=1e-6)
    finally:
        engine.dispose()
