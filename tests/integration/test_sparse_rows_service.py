"""Sparse embedding rows through the real service: two island processes train a tiny 2x2 with `sparse_rows` and
int8 uploads for 3 rounds; every path's embedding goes as the rows of its own alphabet only (smaller uploads),
every module version recomputes from the stored uploads (`checks.verify_run`), and the service equals the
in-process reference (`modules.simulate(..., sparse_rows=True)`) for the same seeds, bit for bit. On SQLite and
PostgreSQL, ~20 s each."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from modules import (
    InnerConfig,
    ModelConfig,
    OuterConfig,
    decode,
    grad_payload_nbytes,
    init_level_modules,
    level_param_shapes,
    parse_layout,
)
from modules.simulate import simulate
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster, create_run, wait_finished, wait_islands_joined
from tests.integration.test_service_matches_simulator import SPEC

pytestmark = pytest.mark.integration


def test_sparse_rows_service_equals_simulator(cluster: Cluster) -> None:
    cluster.start_coordinator()
    with cluster.admin() as client:
        islands = [cluster.start_island(f"island-{i}") for i in range(2)]
        wait_islands_joined(client, 2)
        spec = {**SPEC, "name": "sparse-rows", "codec": "int8", "sparse_rows": True}
        run_id = create_run(client, spec, num_tokens=600)
        run = wait_finished(cluster, client, run_id)
        paths = client.get("/v1/paths", params={"run_id": run_id}).json()["data"]
        tokens = [
            torch.from_numpy(
                np.frombuffer(client.get(f"/v1/shards/{p['shard_id']}/tokens").content, dtype="<u2").astype(np.int64)
            )
            for p in paths
        ]
        contributions = client.get("/v1/contributions", params={"run_id": run_id}).json()["data"]
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()["data"]
        weights = {
            (m["level"], m["index"]): decode(client.get(f"/v1/modules/{m['id']}/weights").content) for m in modules
        }
    assert all(proc.poll() in (None, 0) for proc in islands)
    verify_run(cluster.database_url, cluster.data_dir / "blobs", run_id)

    cfg = ModelConfig.from_dict(run["config"]["model"])  # type: ignore[index]
    layout = parse_layout(SPEC["layout"], n_layers=cfg.n_layers)
    # uploads: the embedding as the rows of the path's alphabet ([32 + 10p, 48 + 10p), conftest.create_run)
    dense_shapes = {
        f"{layout.levels[lv].name}/{name}": shape
        for lv in range(len(layout.levels))
        for name, shape in level_param_shapes(cfg, layout, lv).items()
    }
    dense_bytes = grad_payload_nbytes(dense_shapes, "int8")
    assert len(contributions) == 3 * 4
    for c in contributions:
        assert c["codec"] == "int8" and 0 < c["upload_bytes"] < dense_bytes, c
    rows = []
    for blob in sorted((cluster.data_dir / "blobs").rglob("*")):
        if blob.is_file() and blob.parent.name != "tmp":
            try:
                tensors = st_load(blob.read_bytes())
            except SafetensorError:  # a shard's tokens
                continue
            if "embed/tok_emb.weight::rows" in tensors:
                rows.append(tensors["embed/tok_emb.weight::rows"])
    assert len(rows) == len(contributions)
    for ids in rows:
        assert 1 <= ids.numel() <= 16 and bool((ids >= 32).all()) and bool((ids < 78).all())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the islands run (OMP_NUM_THREADS=1): the same kernels, so the same bits
    try:
        ref = simulate(
            cfg,
            layout,
            InnerConfig(**run["config"]["inner"]),  # type: ignore[index]
            OuterConfig(**run["config"]["outer"]),  # type: ignore[index]
            steps_per_round=SPEC["inner_steps"],
            rounds=SPEC["num_rounds"],
            seed=0,
            tokens=tokens,
            codec="int8",
            sparse_rows=True,
        )
    finally:
        torch.set_num_threads(threads)
    for c in contributions:
        assert c["train_loss"] == ref.losses[c["round"]][c["path_index"]]
    for (level, index), got in weights.items():
        want = ref.modules[level][index]
        for name in want:
            assert torch.equal(got[name], want[name]), (level, index, name)
    # rows no path's input reached keep the initial weights, bit for bit
    init = init_level_modules(cfg, layout, seed=0)[0]["tok_emb.weight"]
    emb = weights[(0, 0)]["tok_emb.weight"]
    assert torch.equal(emb[:32], init[:32]) and torch.equal(emb[78:], init[78:])
    assert not torch.equal(emb[32:78], init[32:78])
