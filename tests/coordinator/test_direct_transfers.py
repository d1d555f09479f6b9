"""Direct transfers with an S3-compatible store (moto's server on loopback): leases carry pre-signed URLs, islands
PUT their outer gradients to the bucket and commit them, no tensor byte passes through the coordinator, and an
apply executor verifies each upload before any math."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, LeaseLost, RequestRejected, sha256_hex
from coordinator.schemas import IslandCapabilities, LeasePublic, UploadTicket
from coordinator.settings import Settings
from modules import decode, encode_grad
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import A, create_running_run, eventually, wait_applied

BUCKET = "dipaco-direct"


@pytest.fixture
def direct(tmp_path: Path, s3_env: str, clock: FakeClock) -> Iterator[TestClient]:
    import boto3

    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=BUCKET)
    settings = Settings(
        data_dir=tmp_path / "coordinator",
        database_url=f"sqlite:///{tmp_path / 'direct.db'}",
        blob_url=f"s3://{BUCKET}/{tmp_path.name}",
        s3_endpoint_url=s3_env,
        admin_token=ADMIN,  # type: ignore[arg-type]
        join_token=JOIN,  # type: ignore[arg-type]
    )
    with TestClient(create_app(settings, clock=clock)) as client:
        yield client


def _island(app: TestClient, name: str) -> CoordinatorClient:
    island = CoordinatorClient(str(app.base_url), JOIN, http=app)
    island.join(name, "site", IslandCapabilities())
    return island


def _grads(app: TestClient, island: CoordinatorClient, lease: LeasePublic) -> dict[str, torch.Tensor]:
    """Outer gradients shaped like the lease's modules, whose weights come straight from the bucket."""
    gen = torch.Generator().manual_seed(lease.lease_id)
    grads = {}
    for m in lease.modules:
        weights = decode(island.module_weights(m.module_id, m.version, m.weights_hash, url=m.url))
        grads.update({f"{m.level_name}/{k}": torch.randn(v.shape, generator=gen) * 1e-3 for k, v in weights.items()})
    return grads


def _bytes_through(app: TestClient, kind: str, direction: str) -> float:
    for line in app.get("/metrics").text.splitlines():
        if line.startswith(f'dipaco_bytes_{direction}_total{{kind="{kind}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_round_moves_every_tensor_byte_between_islands_and_the_bucket(direct: TestClient) -> None:
    run = create_running_run(direct, name="direct", codec="int8")
    uploads: list[Any] = []
    for p in range(run["num_paths"]):
        island = _island(direct, f"island-{p}")
        lease = island.lease()
        assert lease is not None and lease.direct_upload
        assert all(m.url and m.url.startswith("http://127.0.0.1") for m in lease.modules) and lease.shard.url
        # what the island does: weights (in _grads) and tokens from the bucket, verified against their hashes
        island.shard_tokens(lease.shard.shard_id, lease.shard.tokens_hash, url=lease.shard.url)
        payload = encode_grad(_grads(direct, island, lease), "int8")
        uploads.append(island.upload_direct(lease, payload, tokens=64, train_loss=4.0))
    assert uploads[-1].round_applied
    wait_applied(direct, run["id"])
    modules = direct.get(f"/v1/modules?run_id={run['id']}", headers=A).json()["data"]
    assert all(m["version"] == 1 for m in modules)
    contributions = direct.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    assert all(c["codec"] == "int8" and c["upload_bytes"] > 0 for c in contributions)
    assert all(part["norm"] is not None and part["scale"] == 1 for c in contributions for part in c["modules"])
    # nothing of it through the coordinator: no outer-gradient, weight or shard bytes counted there
    assert _bytes_through(direct, "outer_gradient", "in") == 0
    assert _bytes_through(direct, "weights", "out") == 0 and _bytes_through(direct, "shard", "out") == 0


def test_a_commit_without_a_put_a_foreign_key_and_a_replay(direct: TestClient) -> None:
    create_running_run(direct, name="commits")
    island = _island(direct, "committer")
    lease = island.lease()
    assert lease is not None
    payload = encode_grad(_grads(direct, island, lease), "fp32")
    # a commit before any PUT
    digest = sha256_hex(payload)
    ticket = island.call(
        "POST",
        f"/v1/leases/{lease.lease_id}/upload-url",
        UploadTicket,
        what="ticket",
        json={"size": len(payload), "sha256": digest},
    )
    commit = {"key": ticket.key, "size": len(payload), "sha256": digest, "round": 0, "tokens": 1, "train_loss": 1.0}
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=commit)
    assert r.status_code == 409 and r.json()["detail"] == (
        f"nothing was uploaded at {ticket.key}: PUT the body to the ticket's URL first"
    )
    # another lease's key
    foreign = {**commit, "key": ticket.key.replace(f"/{lease.lease_id}-", "/999-")}
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=foreign)
    assert r.status_code == 403 and "is not the upload ticket of lease" in r.json()["detail"]
    # the real thing, then the same commit again: the same contribution (idempotent)
    first = island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
    again = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=commit)
    assert again.status_code == 200 and again.json()["id"] == first.id


def test_a_put_refused_as_expired_gets_a_new_url(direct: TestClient) -> None:
    """moto does not expire pre-signed URLs, so the bucket's refusal of a late PUT (403, "Request has expired")
    comes from a transport in front of it; the island asks for a new URL once and the upload goes through."""
    create_running_run(direct, name="expiring")
    refused: list[str] = []
    real = httpx.Client()

    def bucket(request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and not refused:
            refused.append(str(request.url))
            return httpx.Response(403, text="<Error><Code>AccessDenied</Code><Message>Request has expired</Message>")
        forwarded = real.request(request.method, str(request.url), headers=request.headers, content=request.read())
        return httpx.Response(forwarded.status_code, headers=forwarded.headers, content=forwarded.content)

    island = CoordinatorClient(
        str(direct.base_url), JOIN, http=direct, external=httpx.Client(transport=httpx.MockTransport(bucket))
    )
    island.join("late", "site", IslandCapabilities())
    lease = island.lease()
    assert lease is not None and lease.modules[0].url is not None
    assert "Expires=" in lease.modules[0].url or "X-Amz-Expires=900" in lease.modules[0].url
    contribution = island.upload_direct(
        lease, encode_grad(_grads(direct, island, lease), "fp32"), tokens=1, train_loss=1.0
    )
    assert len(refused) == 1 and contribution.lease_id == lease.lease_id


def test_a_wrong_digest_is_refused_by_the_executor_and_changes_no_module(direct: TestClient) -> None:
    """The bucket stores whatever was PUT (moto does not check the checksum); the executor reads the upload,
    finds it does not hash to the committed sha256, and refuses it before any math."""
    run = create_running_run(direct, name="liar", num_rounds=1)
    liar_lease: LeasePublic | None = None
    for p in range(run["num_paths"]):
        island = _island(direct, f"liar-{p}")
        lease = island.lease()
        assert lease is not None
        payload = encode_grad(_grads(direct, island, lease), "fp32")
        if p == 0:
            liar_lease = lease
            honest = payload
            lying = bytearray(payload)
            lying[-1] ^= 0xFF  # same size, same header, other content
            ticket = island.call(
                "POST",
                f"/v1/leases/{lease.lease_id}/upload-url",
                UploadTicket,
                what="ticket",
                json={"size": len(honest), "sha256": sha256_hex(honest)},
            )
            assert httpx.put(ticket.url, content=bytes(lying)).status_code == 200
            commit = {
                "key": ticket.key,
                "size": len(honest),
                "sha256": sha256_hex(honest),
                "round": 0,
                "tokens": 1,
                "train_loss": 1.0,
            }
            r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=commit)
            assert r.status_code == 200, r.text  # the header is fine: the lie shows only in the values
        else:
            island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
    wait_applied(direct, run["id"])
    assert liar_lease is not None
    contributions = direct.get(f"/v1/contributions?run_id={run['id']}", headers=A).json()["data"]
    liar = next(c for c in contributions if c["lease_id"] == liar_lease.lease_id)
    assert all(part["scale"] == 0 for part in liar["modules"])
    assert all("refused at verification: the upload hashes to" in part["note"] for part in liar["modules"])
    honest_parts = [part for c in contributions if c["lease_id"] != liar_lease.lease_id for part in c["modules"]]
    assert all(part["scale"] == 1 for part in honest_parts)
    refused = eventually(lambda: direct.get("/metrics").text, lambda t: "refused" in t)
    assert 'dipaco_outer_gradient_outliers_total{action="refused"}' in refused


def test_a_local_store_has_no_direct_uploads(client: TestClient) -> None:
    create_running_run(client, name="local")
    island = CoordinatorClient(str(client.base_url), JOIN, http=client)
    island.join("local-island", "site", IslandCapabilities())
    lease = island.lease()
    assert lease is not None and not lease.direct_upload and lease.modules[0].url is None
    with pytest.raises((RequestRejected, LeaseLost)) as info:
        island.upload_direct(lease, b"\x00" * 64, tokens=1, train_loss=1.0)
    assert "direct uploads need an s3:// blob store" in str(info.value)


@pytest.mark.parametrize("first_read", [16, 64 << 10])
def test_a_commit_reads_the_header_in_one_get_or_two(
    direct: TestClient, monkeypatch: pytest.MonkeyPatch, first_read: int
) -> None:
    """The commit reads size and header with one ranged GET; a header longer than that first read takes a second
    one, and the upload is accepted either way."""
    from coordinator.services import direct as direct_module

    monkeypatch.setattr(direct_module, "STAGED_HEAD_READ", first_read)
    create_running_run(direct, name=f"head-{first_read}")
    island = _island(direct, "reader")
    lease = island.lease()
    assert lease is not None
    payload = encode_grad(_grads(direct, island, lease), "fp32")
    assert int.from_bytes(payload[:8], "little") > 16  # the header is longer than the short first read
    contribution = island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
    assert contribution.status == "accepted"


def test_staged_head_of_a_missing_an_empty_and_a_short_object(direct: TestClient) -> None:
    from coordinator.blobstore import S3BlobStore

    blobs = direct.app.state.dipaco.blobs  # type: ignore[attr-defined]
    assert isinstance(blobs, S3BlobStore)
    key = blobs.staging_key("probe")
    assert blobs.staged_head(key, 64) is None
    blobs.client.put_object(Bucket=blobs.bucket, Key=key, Body=b"")
    assert blobs.staged_head(key, 64) == (0, b"")
    blobs.client.put_object(Bucket=blobs.bucket, Key=key, Body=b"0123456789")
    assert blobs.staged_head(key, 64) == (10, b"0123456789")
    assert blobs.staged_head(key, 4) == (10, b"0123")


def test_a_held_out_slice_comes_from_the_bucket_and_its_loss_goes_with_the_commit(direct: TestClient) -> None:
    run = create_running_run(direct, name="direct-heldout", layout="embed:shared, b0-1:routed1, head:shared")
    body = np.arange(100, dtype="<u2").tobytes()
    r = direct.post(f"/v1/runs/{run['id']}/shards/0/heldout?num_documents=1", content=body, headers=A)
    assert r.status_code == 201, r.text
    island = _island(direct, "held")
    lease = island.lease()
    assert lease is not None and lease.heldout is not None and lease.heldout.url is not None
    assert lease.heldout.url.startswith("http://127.0.0.1")  # the bucket, not the coordinator
    assert island.heldout_tokens(lease.heldout.shard_id, lease.heldout.tokens_hash, url=lease.heldout.url) == body
    payload = encode_grad(_grads(direct, island, lease), "fp32")
    contribution = island.upload_direct(lease, payload, tokens=1, train_loss=1.0, heldout_loss=3.5)
    assert contribution.heldout_loss == 3.5
    history = direct.get(f"/v1/runs/{run['id']}/history", headers=A).json()
    assert history["data"][0]["losses"][0]["heldout_loss"] == 3.5
