"""The service equals the in-process reference simulator (modules.simulate) for the same seeds: two island
processes train a tiny 2x2 DiPaCo over HTTP for 3 rounds; the per-round train loss of every path and the final
weights of every module match the simulator's (the service does what Algorithm 1 does), with the default outer
optimizer for both block styles (gpt2, llama) and with a non-default one (token weighting, √n rescale, other lr
and momentum) for the default block, whose islands also upload int8 with error feedback (the simulator runs the
same codec). Three cases: each costs ~40 s."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from coordinator.schemas import OuterSpec
from modules import InnerConfig, ModelConfig, OuterConfig, decode, parse_layout
from modules.simulate import simulate
from tests.integration.conftest import Cluster, create_run, wait_finished, wait_islands_joined

pytestmark = pytest.mark.integration

SPEC: dict[str, Any] = {
    "name": "matches-simulator",
    "model": {"flavour": "debug", "d_model": 32, "seq_len": 16, "n_heads": 2},
    "layout": "embed:shared, b0-0:routed2, b1-1:routed2, head:shared",
    "inner": {"batch_size": 2, "warmup_steps": 2, "lr": 0.003},
    "inner_steps": 4,
    "num_rounds": 3,
    "lease_ttl_s": 60,
}


@pytest.fixture
def database_url(tmp_path: Any) -> str:
    """SQLite: the numbers do not depend on the database (the other integration tests cover PostgreSQL)."""
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.mark.parametrize(
    ("outer", "block", "codec"),
    [
        ({}, {"block": "gpt2"}, "fp32"),
        ({}, {"block": "llama"}, "fp32"),
        # the flavour's block; int8 uploads with the islands' error feedback, decoded by the apply executors
        ({"lr": 0.5, "momentum": 0.6, "weighting": "tokens", "sqrt_rescale": True}, {}, "int8"),
    ],
    ids=["default-outer-gpt2", "default-outer-llama", "tokens-sqrt-outer-int8"],
)
def test_service_equals_simulator(cluster: Cluster, outer: dict[str, Any], block: dict[str, str], codec: str) -> None:
    cluster.start_coordinator()
    with cluster.admin() as client:
        islands = [cluster.start_island(f"island-{i}") for i in range(2)]
        wait_islands_joined(client, 2)
        spec = {**SPEC, "model": {**SPEC["model"], **block}, "outer": outer, "codec": codec}
        run_id = create_run(client, spec, num_tokens=600)
        run = wait_finished(cluster, client, run_id)
        paths = client.get("/v1/paths", params={"run_id": run_id}).json()["data"]
        tokens = [
            torch.from_numpy(
                np.frombuffer(client.get(f"/v1/shards/{p['shard_id']}/tokens").content, dtype="<u2").astype(np.int64)
            )
            for p in paths
        ]
        losses: dict[tuple[int, int], float] = {
            (c["round"], c["path_index"]): c["train_loss"]
            for c in client.get("/v1/contributions", params={"run_id": run_id}).json()["data"]
        }
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()["data"]
        weights = {
            (m["level"], m["index"]): decode(client.get(f"/v1/modules/{m['id']}/weights").content) for m in modules
        }
    assert all(proc.poll() in (None, 0) for proc in islands)  # an island that got no work waits for the next run

    assert run["config"]["outer"] == {**OuterSpec().model_dump(), **outer}  # type: ignore[index]
    cfg = ModelConfig.from_dict(run["config"]["model"])  # type: ignore[index]
    assert cfg.block == block.get("block", ModelConfig().block)
    ref = simulate(
        cfg,
        parse_layout(SPEC["layout"], n_layers=cfg.n_layers),
        InnerConfig(**run["config"]["inner"]),  # type: ignore[index]
        OuterConfig(**run["config"]["outer"]),  # type: ignore[index]
        steps_per_round=SPEC["inner_steps"],
        rounds=SPEC["num_rounds"],
        seed=0,
        tokens=tokens,
        codec=run["config"]["codec"],  # type: ignore[index]
    )
    assert len(losses) == 3 * 4
    for (rnd, p), loss in losses.items():
        assert loss == pytest.approx(ref.losses[rnd][p], abs=1e-4), (rnd, p)
    for (level, index), got in weights.items():
        want = ref.modules[level][index]
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-4)
