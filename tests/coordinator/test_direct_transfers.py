"""Direct transfers with an S3-compatible store (moto's server on loopback): leases carry pre-signed URLs, islands
PUT their outer gradients to the bucket and commit them, no tensor byte passes through the coordinator, and an
apply executor verifies each upload before any math."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from coordinator.client import CoordinatorClient, LeaseLost, RequestRejected, sha256_hex
from coordinator.schemas import IslandCapabilities, LeasePublic
from modules import encode_grad
from tests.conftest import JOIN
from tests.coordinator.direct_helpers import byte_counter, island_client, leased_payload, outer_grads, request_ticket
from tests.coordinator.helpers import A, create_running_run, eventually, wait_applied


def _bytes_through(app: TestClient, kind: str, direction: str) -> float:
    return byte_counter(app.get("/metrics").text, direction, kind) or 0.0


def test_a_round_moves_every_tensor_byte_between_islands_and_the_bucket(direct: TestClient) -> None:
    run = create_running_run(direct, name="direct", codec="int8")
    uploads: list[Any] = []
    for p in range(run["num_paths"]):
        island = island_client(direct, f"island-{p}")
        lease = island.lease()
        assert lease is not None and lease.direct_upload
        assert all(m.url and m.url.startswith("http://127.0.0.1") for m in lease.modules) and lease.shard.url
        # what the island does: weights (in outer_grads) and tokens from the bucket, verified against their hashes
        island.shard_tokens(lease.shard.shard_id, lease.shard.tokens_hash, url=lease.shard.url)
        payload = encode_grad(outer_grads(island, lease), "int8")
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
    island, lease, payload = leased_payload(direct, "committer")
    # a commit before any PUT
    digest = sha256_hex(payload)
    ticket = request_ticket(island, lease, payload)
    commit = {"key": ticket.key, "size": len(payload), "sha256": digest, "round": 0, "tokens": 1, "train_loss": 1.0}
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=commit)
    assert r.status_code == 409 and r.json()["detail"] == (
        f"nothing was uploaded at {ticket.key}: PUT the body to the ticket's URL first"
    )
    # another lease's key
    foreign = {**commit, "key": ticket.key.replace(f"/{lease.lease_id}-", "/999-")}
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json=foreign)
    assert r.status_code == 403 and "is not the upload ticket of lease" in r.json()["detail"]
    # a rebase step is for overlap leases only (this one came with every module's weights), and never negative
    with pytest.raises(RequestRejected, match="X-Dipaco-Rebased-At is for overlap leases") as refused:
        island.upload_direct(lease, payload, tokens=1, train_loss=1.0, rebased_at=0)
    assert refused.value.status == 422
    r = island.request("POST", f"/v1/leases/{lease.lease_id}/commit", what="commit", json={**commit, "rebased_at": -1})
    assert r.status_code == 422 and "rebased_at" in r.text
    assert direct.get("/v1/contributions", headers=A).json()["data"] == []
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
        lease, encode_grad(outer_grads(island, lease), "fp32"), tokens=1, train_loss=1.0
    )
    assert len(refused) == 1 and contribution.lease_id == lease.lease_id


def test_a_wrong_digest_is_refused_by_the_executor_and_changes_no_module(direct: TestClient) -> None:
    """The bucket stores whatever was PUT (moto does not check the checksum); the executor reads the upload,
    finds it does not hash to the committed sha256, and refuses it before any math."""
    run = create_running_run(direct, name="liar", num_rounds=1)
    liar_lease: LeasePublic | None = None
    for p in range(run["num_paths"]):
        island, lease, payload = leased_payload(direct, f"liar-{p}")
        if p == 0:
            liar_lease = lease
            honest = payload
            lying = bytearray(payload)
            lying[-1] ^= 0xFF  # same size, same header, other content
            ticket = request_ticket(island, lease, honest)
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
    island, lease, payload = leased_payload(direct, "reader")
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
    island = island_client(direct, "held")
    lease = island.lease()
    assert lease is not None and lease.heldout is not None and lease.heldout.url is not None
    assert lease.heldout.url.startswith("http://127.0.0.1")  # the bucket, not the coordinator
    assert island.heldout_tokens(lease.heldout.shard_id, lease.heldout.tokens_hash, url=lease.heldout.url) == body
    payload = encode_grad(outer_grads(island, lease), "fp32")
    contribution = island.upload_direct(lease, payload, tokens=1, train_loss=1.0, heldout_loss=3.5)
    assert contribution.heldout_loss == 3.5
    history = direct.get(f"/v1/runs/{run['id']}/history", headers=A).json()
    assert history["data"][0]["losses"][0]["heldout_loss"] == 3.5


def test_an_accepted_direct_upload_passes_no_outer_gradient_byte_through_the_coordinator(direct: TestClient) -> None:
    """The byte counters show every kind from the start, and the outer-gradient one stays at 0 while a direct upload
    is accepted: its bytes went from the island to the bucket, and from the bucket to the executor."""
    run = create_running_run(direct, name="counted")
    before = direct.get("/metrics").text
    assert [byte_counter(before, "in", kind) for kind in ("outer_gradient", "shard")] == [0.0, 400 * 2 * 4]
    assert byte_counter(before, "out", "weights") == 0.0 and byte_counter(before, "out", "shard") == 0.0
    island, lease, payload = leased_payload(direct, "counted")
    assert lease.direct_upload
    contribution = island.upload_direct(lease, payload, tokens=1, train_loss=1.0)
    assert contribution.status == "accepted" and contribution.run_id == run["id"]
    after = direct.get("/metrics").text
    assert 'dipaco_contributions_total{result="accepted"} 1.0' in after
    assert byte_counter(after, "in", "outer_gradient") == 0.0
    assert byte_counter(after, "out", "weights") == 0.0  # the island read the weights from the bucket too


def test_a_get_the_bucket_refuses_falls_back_to_the_coordinator(
    direct: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A pre-signed GET that the bucket refuses (403: the URL expired; moto never expires URLs, so the refusal
    comes from a MockTransport in front of it) is fetched from the coordinator's own endpoint instead, with one
    log line each: weights, shard tokens and the held-out slice."""
    run = create_running_run(direct, name="refused-gets", layout="embed:shared, b0-1:routed1, head:shared")
    heldout = np.arange(100, dtype="<u2").tobytes()
    r = direct.post(f"/v1/runs/{run['id']}/shards/0/heldout?num_documents=1", content=heldout, headers=A)
    assert r.status_code == 201, r.text
    refused: list[str] = []

    def expired(request: httpx.Request) -> httpx.Response:
        refused.append(str(request.url))
        return httpx.Response(403, text="<Error><Code>AccessDenied</Code><Message>Request has expired</Message>")

    island = island_client(direct, "late-reader", external=httpx.Client(transport=httpx.MockTransport(expired)))
    lease = island.lease()
    assert lease is not None and lease.heldout is not None and lease.shard.url is not None
    caplog.set_level("WARNING", logger="coordinator.client")
    weights = [island.module_weights(m.module_id, m.version, m.weights_hash, url=m.url) for m in lease.modules]
    assert [sha256_hex(w) for w in weights] == [m.weights_hash for m in lease.modules]
    tokens = island.shard_tokens(lease.shard.shard_id, lease.shard.tokens_hash, url=lease.shard.url)
    assert sha256_hex(tokens) == lease.shard.tokens_hash
    assert island.heldout_tokens(lease.heldout.shard_id, lease.heldout.tokens_hash, url=lease.heldout.url) == heldout
    assert len(refused) == len(lease.modules) + 2  # each asked of the bucket once
    lines = [rec.getMessage() for rec in caplog.records if "refused the pre-signed GET" in rec.getMessage()]
    assert len(lines) == len(lease.modules) + 2
    assert all("(HTTP 403: " in line and "fetching it from the coordinator instead" in line for line in lines)
    # the bytes came through the coordinator this time
    metrics = direct.get("/metrics").text
    assert byte_counter(metrics, "out", "weights") == sum(len(w) for w in weights)
    assert byte_counter(metrics, "out", "shard") == len(tokens) + len(heldout)
