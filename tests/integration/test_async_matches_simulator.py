"""An all-async run through the service equals the reference replaying the same arrival order
(`modules.asynchrony.simulate_async`): two island processes train a 2x2 whose levels are all async, each path
leasing again as soon as its upload is accepted, with int8 uploads and error feedback, with dense and with sparse
embedding rows. The order in which the coordinator accepted the uploads, and the module versions each lease
trained from, are read back from the registry (REST); the reference replays them and must give every upload's
train loss, every part's staleness and every module's final weights and version. Which uploads arrive stale
depends on the timing of the two processes; the replay does not, so the test holds for any timing. Island-1
stalls 1 s in each of its leases (island fault injection) while island-0's uploads step the shared modules under
it: some uploads are stale whatever the machine's load. ~20-40 s each."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from island.faults import STALL_ENV
from modules import InnerConfig, ModelConfig, OuterConfig, decode, parse_layout
from modules.asynchrony import AsyncSettings, Damping, Lease, Upload, simulate_async
from tests.integration.conftest import Cluster, create_run, wait_finished, wait_islands_joined

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = {
    "name": "async-matches-simulator",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "sync": "async",
    "max_staleness": 16,  # above the run's 12 uploads: none is refused, however the two islands interleave
    "dn_period": 2,
    "inner": {"batch_size": 2, "warmup_steps": 2, "lr": 0.003},
    "inner_steps": 4,
    "num_rounds": 3,
    "lease_ttl_s": 60,
}


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.mark.parametrize(
    ("sparse_rows", "damping", "path_leases"),
    [(False, "inverse", 1), (True, "inverse_square", 1), (False, "inverse", 2)],
    ids=["dense", "sparse-rows", "shared-paths"],
)
def test_async_service_equals_the_replayed_reference(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, sparse_rows: bool, damping: Damping, path_leases: int
) -> None:
    """With `sparse_rows`, each path's embedding travels as the rows of its own alphabet and the async apply
    averages each row over the contributions of its period that touched it (the reference does the same); that
    case also damps stale contributions by 1/(1+s)^2 instead of 1/(1+s). With `path_leases` 2, island-0 helps
    the path island-1's stalled leases hold back (path sharing): two leases train one path at once, on
    consecutive ranges, and may be accepted out of order."""
    cluster.start_coordinator()
    with cluster.admin() as client:
        islands = [cluster.start_island("island-0")]
        with monkeypatch.context() as env:
            env.setenv(STALL_ENV, "*:2:5.0")  # island-0 fills a period (2 uploads) during each of these leases
            islands.append(cluster.start_island("island-1"))
        wait_islands_joined(client, 2)
        spec = {**SPEC, "sparse_rows": sparse_rows, "staleness_damping": damping, "path_leases": path_leases}
        run_id = create_run(client, spec, num_tokens=600)
        run = wait_finished(cluster, client, run_id)
        paths = client.get("/v1/paths", params={"run_id": run_id}).json()["data"]
        tokens = [
            torch.from_numpy(
                np.frombuffer(client.get(f"/v1/shards/{p['shard_id']}/tokens").content, dtype="<u2").astype(np.int64)
            )
            for p in paths
        ]
        leases = {x["id"]: x for x in client.get("/v1/leases", params={"run_id": run_id, "limit": 500}).json()["data"]}
        contributions = client.get("/v1/contributions", params={"run_id": run_id, "limit": 500}).json()["data"]
        refused = client.get("/v1/events", params={"run_id": run_id, "kind": "upload_refused"}).json()["data"]
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()["data"]
        weights = {
            (m["level"], m["index"]): decode(client.get(f"/v1/modules/{m['id']}/weights").content) for m in modules
        }
    assert all(proc.poll() in (None, 0) for proc in islands)
    assert refused == []
    assert run["config"]["sparse_rows"] is sparse_rows
    assert run["schedule"] == "async" and len(contributions) == 4 * 3  # 3 leases of H=4 per path, no rounds
    # island-0 uploads while island-1's leases stall
    assert any(m["staleness"] > 0 for c in contributions for m in c["modules"])
    assert any(x["shared"] for x in leases.values()) is (path_leases > 1)

    # the arrival order: accepted uploads by id (the order their transactions took the modules' locks); each
    # lease just before its own upload, naming the versions it trained from, its range and its first step
    module_level = {m["id"]: m["level"] for m in modules}
    events: list[Lease | Upload] = []
    for c in sorted(contributions, key=lambda c: c["id"]):
        lease = leases[c["lease_id"]]
        versions = {module_level[m["module_id"]]: m["base_version"] for m in c["modules"]}
        steps = lease["inner_steps"] or SPEC["inner_steps"]
        base = tuple(versions[lv] for lv in range(4))
        events += [
            Lease(
                c["path_index"], steps, island=lease["island_id"], versions=base, start=lease["token_start"],
                first_step=lease["first_step"], key=lease["id"],
            ),
            Upload(c["path_index"], key=lease["id"]),
        ]  # fmt: skip
    cfg = ModelConfig.from_dict(run["config"]["model"])
    ref = simulate_async(
        cfg,
        parse_layout(SPEC["layout"], n_layers=cfg.n_layers),
        InnerConfig(**run["config"]["inner"]),
        OuterConfig(**run["config"]["outer"]),
        AsyncSettings(sync="async", max_staleness=16, dn_period=2, damping=damping),
        events=events,
        budget_steps=3 * 4,
        seed=0,
        tokens=tokens,
        codec=run["config"]["codec"],
        sparse_rows=run["config"]["sparse_rows"],
    )
    by_arrival = sorted(contributions, key=lambda c: c["id"])
    for got, want in zip(by_arrival, ref.uploads, strict=True):
        assert got["train_loss"] == pytest.approx(want.loss, abs=1e-4), got
        assert [m["staleness"] for m in got["modules"]] == want.staleness, got
    assert {(m["level"], m["index"]): m["version"] for m in modules} == {
        (lv, i): v for lv, level in enumerate(ref.versions) for i, v in enumerate(level)
    }
    for (level, index), got_weights in weights.items():
        for name, want_tensor in ref.modules[level][index].items():
            torch.testing.assert_close(got_weights[name], want_tensor, rtol=0, atol=1e-4)
