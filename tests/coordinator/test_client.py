"""The typed client against the real app (Starlette's TestClient, the parametrised database, the fake clock):
every endpoint it covers, pagination, verified downloads and the error hierarchy with the server's own detail."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from typer.testing import CliRunner

from coordinator.client import (
    CoordinatorClient,
    IntegrityError,
    LeaseLost,
    RequestRejected,
    RetryPolicy,
)
from coordinator.client_errors import ClientError
from coordinator.registry_cli import app as registry_app
from coordinator.schemas import LeasePublic, RunCreate
from coordinator.states import ContributionStatus, IslandStatus, LeaseStatus, RoundStatus, RunStatus
from modules import decode, encode
from tests.conftest import ADMIN, JOIN
from tests.coordinator.helpers import TINY_RUN

NUM_TOKENS = 400


def typed(http: TestClient, token: str, *, page_size: int = 1000) -> CoordinatorClient:
    """A client on the app; no retries: the app answers at once or the test is wrong."""
    return CoordinatorClient("http://testserver", token, http=http, retry=RetryPolicy.once(), page_size=page_size)


@pytest.fixture
def admin(client: TestClient) -> Iterator[CoordinatorClient]:
    with typed(client, ADMIN) as c:
        yield c


def shard_body(path_index: int) -> bytes:
    return np.random.default_rng(path_index).integers(0, 256, NUM_TOKENS).astype("<u2").tobytes()


def running_run(admin: CoordinatorClient, tmp_path: Path, name: str = "tiny") -> int:
    """A 2x2 run with its shards registered: path 0 from memory, the others streamed from files."""
    run = admin.create_run({**TINY_RUN, "name": name})
    assert run.status == RunStatus.WAITING_FOR_SHARDS and run.num_paths == 4
    for p in range(run.num_paths):
        body = shard_body(p)
        if p == 0:
            shard = admin.register_shard(run.id, p, body, num_documents=2)
        else:
            (tmp_path / f"{name}-{p}.tokens").write_bytes(body)
            shard = admin.register_shard(run.id, p, tmp_path / f"{name}-{p}.tokens", num_documents=2)
        assert (shard.path_index, shard.num_tokens, shard.num_documents) == (p, NUM_TOKENS, 2)
    assert admin.run(run.id).status == RunStatus.RUNNING
    return run.id


def zero_gradients(island: CoordinatorClient, lease: LeasePublic) -> bytes:
    """A valid (all-zero) outer gradient for every module of the leased path, with weights fetched verified."""
    grads: dict[str, torch.Tensor] = {}
    for m in lease.modules:
        weights = decode(island.module_weights(m.module_id, m.version, m.weights_hash))
        grads.update({f"{m.level_name}/{k}": torch.zeros_like(v) for k, v in weights.items()})
    return encode(grads)


def test_runs_shards_and_reads(admin: CoordinatorClient, client: TestClient, tmp_path: Path) -> None:
    assert admin.health() == "ok"
    run_id = running_run(admin, tmp_path)
    # a RunCreate works as well as a mapping; a bad mapping is refused before anything is sent
    other = admin.create_run(RunCreate(name="other", layout="embed:shared, b0-1:shared, head:shared"))
    attempts = admin.attempts
    with pytest.raises(ValidationError, match="inner_steps"):
        admin.create_run({**TINY_RUN, "name": "bad", "inner_steps": 0})
    assert admin.attempts == attempts
    assert [r.id for r in admin.runs()] == [run_id, other.id]
    assert [r.id for r in admin.runs(status=RunStatus.RUNNING)] == [run_id]
    rounds = admin.rounds(run_id)
    assert [(r.number, r.status) for r in rounds] == [(0, RoundStatus.OPEN)]

    modules = admin.modules(run_id=run_id)
    assert [m.level_name for m in modules] == ["embed", "b0-0", "b0-0", "b1-1", "b1-1", "head"]
    assert admin.module(modules[1].id) == modules[1]
    assert [m.index for m in admin.modules(run_id=run_id, level=1)] == [0, 1]
    paths = admin.paths(run_id=run_id)
    assert [p.index for p in paths] == [0, 1, 2, 3]
    assert admin.path(paths[3].id).module_indices == [0, 1, 1, 0]
    assert paths[2].shard_id is not None
    assert admin.shard_tokens(paths[2].shard_id) == shard_body(2)  # checked against the server's hash
    assert "dipaco" in admin.metrics()


def test_lists_are_read_across_pages(client: TestClient, tmp_path: Path) -> None:
    with typed(client, ADMIN, page_size=4) as admin:
        run_id = running_run(admin, tmp_path)
        before = admin.attempts
        modules = admin.modules(run_id=run_id)
        assert len(modules) == 6 and len({m.id for m in modules}) == 6
        assert admin.attempts - before == math.ceil(6 / 4)
    with typed(client, ADMIN, page_size=1) as one_by_one:
        assert [m.id for m in one_by_one.modules(run_id=run_id)] == [m.id for m in modules]
        assert one_by_one.attempts == 6
    with pytest.raises(ValueError, match="page_size"):
        typed(client, ADMIN, page_size=1001)


def test_weights_are_verified_against_the_expected_hash(admin: CoordinatorClient, tmp_path: Path) -> None:
    running_run(admin, tmp_path)
    module = admin.modules()[0]
    data = admin.module_weights(module.id, module.version, module.weights_hash)
    assert decode(data)  # safetensors that decode
    assert admin.module_weights(module.id) == data  # current version, checked against the server's hash
    with pytest.raises(IntegrityError) as info:
        admin.module_weights(module.id, module.version, "0" * 64)
    assert info.value.expected == "0" * 64 and info.value.actual == module.weights_hash
    assert isinstance(info.value, ClientError)


def test_a_4xx_raises_request_rejected_with_the_servers_detail(admin: CoordinatorClient, client: TestClient) -> None:
    with pytest.raises(RequestRejected) as info:
        admin.run(999)
    assert (info.value.status, info.value.detail) == (404, "run 999 does not exist")
    assert str(info.value) == "read of run 999 rejected with HTTP 404: run 999 does not exist"
    assert admin.retries == 0
    with pytest.raises(RequestRejected) as info:
        typed(client, JOIN).create_run({**TINY_RUN, "name": "not-admin"})
    assert info.value.status == 403


def test_an_island_session(admin: CoordinatorClient, client: TestClient, tmp_path: Path) -> None:
    island = typed(client, JOIN)
    joined = island.join("isle", "lab")
    assert island.island_id == joined.island_id
    assert island.lease() is None  # no run yet
    assert island.idle is not None and island.idle.reason == "no-running-runs"

    run_id = running_run(admin, tmp_path)
    lease = island.lease()
    assert lease is not None and island.idle is None and lease.status == LeaseStatus.ACTIVE
    assert island.heartbeat().active_lease_ids == [lease.lease_id]
    tokens = island.shard_tokens(lease.shard.shard_id, lease.shard.tokens_hash)
    assert len(tokens) == 2 * lease.shard.num_tokens
    payload = zero_gradients(island, lease)
    contribution = island.upload(lease, payload, tokens=32, train_loss=4.5)
    assert (contribution.lease_id, contribution.status, contribution.round_applied) == (
        lease.lease_id,
        ContributionStatus.ACCEPTED,
        False,
    )
    summaries = admin.contributions(run_id=run_id, round=0)
    assert [(c.lease_id, c.island_id, c.train_loss) for c in summaries] == [(lease.lease_id, joined.island_id, 4.5)]

    # a released lease is lost: its upload is refused with 409
    second = island.lease()
    assert second is not None
    island.release(second.lease_id)
    island.release(second.lease_id)  # 409: nothing left to give back, not an error
    with pytest.raises(LeaseLost) as lost:
        island.upload(second, zero_gradients(island, second), tokens=32, train_loss=4.5)
    assert lost.value.lease_id == second.lease_id
    assert lost.value.reason == f"lease {second.lease_id} was released; ask for a new lease"

    assert [i.status for i in admin.islands()] == [IslandStatus.ACTIVE]
    island.leave()
    assert admin.islands(status=IslandStatus.LEFT)[0].id == joined.island_id


def test_an_admin_revokes_an_island(admin: CoordinatorClient, client: TestClient) -> None:
    island = typed(client, JOIN)
    island_id = island.join("doomed").island_id
    admin.revoke_island(island_id)
    assert admin.islands(status=IslandStatus.REVOKED)[0].id == island_id
    with pytest.raises(RequestRejected) as info:
        island.heartbeat()
    assert info.value.status == 401


def test_registry_command_reads_through_the_client(
    admin: CoordinatorClient, client: TestClient, tmp_path: Path
) -> None:
    run_id = running_run(admin, tmp_path)
    result = CliRunner().invoke(
        registry_app, ["modules", "--run-id", str(run_id), "--json", "--token", ADMIN], obj=client
    )
    assert result.exit_code == 0, result.output
    body = json.loads(result.output)
    assert body["count"] == 6 and [m["level_name"] for m in body["data"]][:2] == ["embed", "b0-0"]
    result = CliRunner().invoke(registry_app, ["runs", "--token", ADMIN], obj=client)
    assert result.exit_code == 0 and "running" in result.output
    result = CliRunner().invoke(registry_app, ["paths", "--token", "wrong"], obj=client)
    assert result.exit_code == 1 and "HTTP 401" in result.output
