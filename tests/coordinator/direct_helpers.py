"""Helpers of the direct-transfer tests (an s3:// blob store, `direct` fixtures in conftest.py): islands through
the typed client, outer gradients shaped like a lease's modules, the coordinator's byte counters."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

from coordinator.blobstore import S3BlobStore
from coordinator.client import CoordinatorClient, sha256_hex
from coordinator.schemas import IslandCapabilities, LeasePublic, UploadTicket
from modules import decode, encode_grad
from tests.conftest import JOIN


def island_client(app: TestClient, name: str, **session: object) -> CoordinatorClient:
    """A joined island talking to the app in-process; `session`: more `CoordinatorClient` arguments (`external=`:
    the HTTP client for the bucket's pre-signed URLs)."""
    island = CoordinatorClient(str(app.base_url), JOIN, http=app, **session)  # type: ignore[arg-type]
    island.join(name, "site", IslandCapabilities())
    return island


def outer_grads(island: CoordinatorClient, lease: LeasePublic, *, scale: float = 1e-3) -> dict[str, torch.Tensor]:
    """Outer gradients shaped like the lease's modules, whose weights come from the bucket (seeded by the lease)."""
    gen = torch.Generator().manual_seed(lease.lease_id)
    grads = {}
    for m in lease.modules:
        weights = decode(island.module_weights(m.module_id, m.version, m.weights_hash, url=m.url))
        grads.update({f"{m.level_name}/{k}": torch.randn(v.shape, generator=gen) * scale for k, v in weights.items()})
    return grads


def leased_payload(app: TestClient, name: str, **session: object) -> tuple[CoordinatorClient, LeasePublic, bytes]:
    """A joined island (`island_client`), its first lease and an fp32 outer gradient for that lease."""
    island = island_client(app, name, **session)
    lease = island.lease()
    assert lease is not None
    return island, lease, encode_grad(outer_grads(island, lease), "fp32")


def request_ticket(island: CoordinatorClient, lease: LeasePublic, payload: bytes) -> UploadTicket:
    """The lease's direct-upload ticket for `payload` (its size and sha256), asked for by hand: the tests that
    PUT or commit otherwise than `CoordinatorClient.upload_direct` does."""
    return island.call(
        "POST",
        f"/v1/leases/{lease.lease_id}/upload-url",
        UploadTicket,
        what="ticket",
        json={"size": len(payload), "sha256": sha256_hex(payload)},
    )


def app_blobs(app: TestClient) -> S3BlobStore:
    blobs = app.app.state.dipaco.blobs  # type: ignore[attr-defined]
    assert isinstance(blobs, S3BlobStore)
    return blobs


def byte_counter(metrics: str, direction: str, kind: str) -> float | None:
    """`dipaco_bytes_<direction>_total{kind=...}` from a /metrics text; None when the line is not there."""
    for line in metrics.splitlines():
        if line.startswith(f'dipaco_bytes_{direction}_total{{kind="{kind}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None
