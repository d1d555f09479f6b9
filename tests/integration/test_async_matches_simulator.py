"""An all-async run, and a hybrid one, through the service equal the reference replaying the same arrival order
(`modules.asynchrony.simulate_async`): two island processes train a 2x2 whose levels are all async, each path
leasing again as soon as its upload is accepted, with int8 uploads and error feedback, with dense and with sparse
embedding rows, with one and two leases per path, with overlap leases (the default) and without; and a 2x2 whose
shared embedding and head are async while the routed blocks step per round. The order in which the coordinator
accepted the uploads, the module versions each lease trained from, and for an overlap lease the levels that
started from the island's end weights and the step they moved onto those versions at, are read back from the
registry (REST);
the reference replays them and must give every upload's train loss, every part's staleness and every module's
final weights and version. Which uploads arrive stale depends on the timing of the two processes; the replay does
not, so the test holds for any timing. Island-1 stalls 5 s in each of its leases (island fault injection) while
island-0's uploads step the shared modules under it: some uploads are stale whatever the machine's load. SQLite,
and PostgreSQL for the shared-paths and hybrid cases (the busiest on the database: two leases on one path, round
closes next to async steps). ~15-30 s each on either database."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
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


SQLITE = "sqlite"
POSTGRES = pytest.param("postgres", marks=pytest.mark.postgres)


@pytest.mark.parametrize(
    ("database_url", "sparse_rows", "damping", "path_leases", "overlap_wait"),
    [
        (SQLITE, False, "inverse", 1, "0"),
        (SQLITE, True, "inverse_square", 1, None),
        (SQLITE, False, "inverse", 2, "0.1"),
        (POSTGRES, False, "inverse", 2, "0.1"),
    ],
    ids=["dense", "sparse-rows-no-overlap", "shared-paths", "shared-paths-postgres"],
    indirect=["database_url"],
)
def test_async_service_equals_the_replayed_reference(
    cluster: Cluster,
    monkeypatch: pytest.MonkeyPatch,
    sparse_rows: bool,
    damping: Damping,
    path_leases: int,
    overlap_wait: str | None,
) -> None:
    """With `sparse_rows`, each path's embedding travels as the rows of its own alphabet and the async apply
    averages each row over the contributions of its period that touched it (the reference does the same); that
    case also damps stale contributions by 1/(1+s)^2 instead of 1/(1+s). With `path_leases` 2, island-0 helps
    the path island-1's stalled leases hold back (path sharing): two leases train one path at once, on
    consecutive ranges, and may be accepted out of order. With `overlap` (the default of all-async runs) an
    upload's reply may lease its path through the module steps it made due: that lease starts from the island's
    own end weights and moves onto the landed versions at a step the island reports (`rebased_at`), which the
    replay follows: at once in the dense case (`--overlap-wait 0`, so it trains through the steps), after waiting
    up to 0.1 of the lease for them before its first step (the default) in the shared-paths cases. None: overlap
    off."""
    overlap = overlap_wait is not None
    spec = {**SPEC, "sparse_rows": sparse_rows, "staleness_damping": damping, "path_leases": path_leases}
    if not overlap:
        spec["overlap"] = False
    got = _run(cluster, monkeypatch, spec, island_args=("--overlap-wait", overlap_wait) if overlap_wait else ())
    assert got.run["config"]["sparse_rows"] is sparse_rows
    assert got.run["schedule"] == "async" and len(got.contributions) == 4 * 3  # 3 leases of H=4 per path, no rounds
    assert any(x["shared"] for x in got.leases.values()) is (path_leases > 1)
    rebased = [m["rebased_at"] for c in got.contributions for m in c["modules"] if m["rebased_at"] is not None]
    assert bool(rebased) is overlap, rebased
    assert all(0 <= r <= SPEC["inner_steps"] for r in rebased)
    _equals_reference(got, spec, AsyncSettings(sync="async", max_staleness=16, dn_period=2, damping=damping))


HYBRID = {
    **SPEC,
    "name": "hybrid-matches-simulator",
    "layout": "embed:shared:async, b0-0:routed2, b1-1:routed2, head:shared:async",
    "sync": "round",
    "dn_period": 5,  # 12 parts a module: two periods straddle rounds, the last 2 are flushed by the last round
}


@pytest.mark.parametrize("database_url", [SQLITE, POSTGRES], indirect=True)
def test_hybrid_service_equals_the_replayed_reference(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Persia's split: the shared embedding and head async (a step every 5 parts, whoever sends them), the routed
    blocks per round (every path each round, applied at its close). Island-1 stalls in each of its leases while
    island-0 trains the round's other paths, so its parts on the async levels arrive stale; the replay of the
    arrival order (rounds and periods together) gives every loss, staleness, version and final weight."""
    got = _run(cluster, monkeypatch, HYBRID)
    assert got.run["schedule"] == "hybrid" and got.run["current_round"] == 3
    assert len(got.contributions) == 4 * 3  # every path once a round
    assert sorted(c["round"] for c in got.contributions) == [r for r in range(3) for _ in range(4)]
    _equals_reference(got, HYBRID, AsyncSettings(sync="round", max_staleness=16, dn_period=5))


@dataclass
class _Finished:
    run: dict[str, Any]
    tokens: list[torch.Tensor]
    leases: dict[int, dict[str, Any]]
    contributions: list[dict[str, Any]]
    modules: list[dict[str, Any]]
    weights: dict[tuple[int, int], dict[str, torch.Tensor]]


def _run(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any], *, island_args: tuple[str, ...] = ()
) -> _Finished:
    """Two islands (island-1 stalling 5 s in each lease) train the run `spec` to its end; what the registry
    says of it. Island-1 starts first and holds a lease before island-0 starts: had both started together,
    island-0 could train the whole run while island-1 slept between two polls for a run (the likely cause of a CI
    run in which no upload was stale)."""
    cluster.start_coordinator()
    with cluster.admin() as client:
        with monkeypatch.context() as env:
            env.setenv(STALL_ENV, "*:2:5.0")  # island-0 fills a period during each of these leases
            islands = [cluster.start_island("island-1", *island_args)]
        wait_islands_joined(client, 1)
        run_id = create_run(client, spec, num_tokens=600)
        _wait_active_lease(client, run_id)
        islands.append(cluster.start_island("island-0", *island_args))
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
    # island-0 uploads while island-1's leases stall
    assert any(m["staleness"] > 0 for c in contributions for m in c["modules"])
    return _Finished(run, tokens, leases, contributions, modules, weights)


def _wait_active_lease(client: httpx.Client, run_id: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not client.get("/v1/leases", params={"run_id": run_id, "status": "active"}).json()["data"]:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no island leased a path of run {run_id} within {timeout_s} s")
        time.sleep(0.1)


def _equals_reference(got: _Finished, spec: dict[str, Any], settings: AsyncSettings) -> None:
    """The reference replaying the arrival order gives every upload's loss and staleness, every module's
    version and final weights."""
    # the arrival order: accepted uploads by id (the order their transactions took the modules' locks); each
    # lease just before its own upload, naming the versions it trained from, its range and its first step
    module_level = {m["id"]: m["level"] for m in got.modules}
    events: list[Lease | Upload] = []
    by_arrival = sorted(got.contributions, key=lambda c: c["id"])
    for c in by_arrival:
        lease = got.leases[c["lease_id"]]
        versions = {module_level[m["module_id"]]: m["base_version"] for m in c["modules"]}
        steps = lease["inner_steps"] or spec["inner_steps"]
        base = tuple(versions[lv] for lv in range(4))
        # an overlap lease: the levels that started from the island's end weights, and the step they moved at
        moved = {module_level[m["module_id"]]: m["rebased_at"] for m in c["modules"] if m["rebased_at"] is not None}
        assert len(set(moved.values())) <= 1, c  # one move for all of a lease's pending modules
        pending = {module_level[i] for i in lease["pending_modules"] or ()}
        assert set(moved) <= pending, (c, lease)
        events += [
            Lease(
                c["path_index"], steps, island=lease["island_id"], versions=base, start=lease["token_start"],
                first_step=lease["first_step"], key=lease["id"], through=tuple(sorted(moved)),
                rebase_at=next(iter(moved.values()), None),
            ),
            Upload(c["path_index"], key=lease["id"]),
        ]  # fmt: skip
    config = got.run["config"]
    cfg = ModelConfig.from_dict(config["model"])
    ref = simulate_async(
        cfg,
        parse_layout(spec["layout"], n_layers=cfg.n_layers),
        InnerConfig(**config["inner"]),
        OuterConfig(**config["outer"]),
        settings,
        events=events,
        budget_steps=spec["num_rounds"] * spec["inner_steps"],
        seed=0,
        tokens=got.tokens,
        codec=config["codec"],
        sparse_rows=config["sparse_rows"],
    )
    for c, want in zip(by_arrival, ref.uploads, strict=True):
        assert c["train_loss"] == pytest.approx(want.loss, abs=1e-4), c
        assert [m["staleness"] for m in c["modules"]] == want.staleness, c
    assert {(m["level"], m["index"]): m["version"] for m in got.modules} == {
        (lv, i): v for lv, level in enumerate(ref.versions) for i, v in enumerate(level)
    }
    for (level, index), got_weights in got.weights.items():
        for name, want_tensor in ref.modules[level][index].items():
            torch.testing.assert_close(got_weights[name], want_tensor, rtol=0, atol=1e-4)
