"""Staged uploads that nothing will read are removed (`staging.sweep_staging`), on a blob directory and on a
bucket (moto's S3 server), with SQLite and PostgreSQL: only old ones, never one a contribution names or one of a
lease still pending."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.blobstore import BlobStore
from coordinator.services.staging import sweep_staging
from coordinator.settings import Settings
from modules import encode
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import create_running_run, join, lease, train_lease, upload

BUCKET = "dipaco-sweep"
DAY = 86_400


@pytest.fixture(params=["local", "s3"])
def app(request: pytest.FixtureRequest, tmp_path: Path, database_url: str, clock: FakeClock) -> Iterator[TestClient]:
    extra: dict[str, Any] = {}
    if request.param == "s3":
        import boto3

        endpoint = request.getfixturevalue("s3_env")
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        extra = {"blob_url": f"s3://{BUCKET}/{tmp_path.name}", "s3_endpoint_url": endpoint}
    settings = Settings(
        data_dir=tmp_path / "coordinator",
        database_url=database_url,
        admin_token=ADMIN,  # type: ignore[arg-type]
        join_token=JOIN,  # type: ignore[arg-type]
        apply_workers=0,  # a named upload stays staged: no executor verifies it
        upload_stream_check_bytes=0,  # every upload large, so that a named one is staged
        staging_sweep_s=0,  # the test sweeps by hand
        **extra,
    )
    clock.now = datetime.now(UTC)  # leases expire on the clock the files' times are read against
    with TestClient(create_app(settings, clock=clock)) as client:
        yield client


def _blobs(client: TestClient) -> BlobStore:
    return client.app.state.dipaco.blobs  # type: ignore[attr-defined,no-any-return]


def _stage(blobs: BlobStore, tmp_path: Path, name: str) -> str:
    path = tmp_path / f"body-{name}"
    path.write_bytes(b"staged body " + name.encode())
    key = blobs.staging_key(name)
    blobs.stage_file(path, key)
    return key


def _staged(blobs: BlobStore) -> set[str]:
    return {key for key, _ in blobs.list_staged()}


def test_only_old_staged_uploads_of_leases_no_longer_pending_are_removed(app: TestClient, tmp_path: Path) -> None:
    client, blobs = app, _blobs(app)
    create_running_run(client, lease_ttl_s=DAY, max_lease_s=DAY)
    busy, released, named_island = join(client, "busy"), join(client, "released"), join(client, "named")
    held, gone, sent = lease(client, *busy), lease(client, *released), lease(client, *named_island)
    assert held is not None and gone is not None and sent is not None
    assert client.post(f"/v1/leases/{gone['lease_id']}/release", headers=released[1]).status_code == 200
    # a named upload, accepted and staged until an executor verifies it
    body = encode(train_lease(client, sent, named_island[1]))
    digest = hashlib.sha256(body).hexdigest()
    r = upload(client, sent, {**named_island[1], "X-Dipaco-Content-Sha256": digest}, body)
    assert r.status_code == 200, r.text
    (named_key,) = _staged(blobs)
    orphan = _stage(blobs, tmp_path, f"{gone['lease_id']}-{'a' * 64}")  # e.g. a PUT never committed
    pending = _stage(blobs, tmp_path, f"{held['lease_id']}-{'b' * 64}")  # its lease may still commit it
    unknown = _stage(blobs, tmp_path, "not-a-lease")
    session_factory = client.app.state.dipaco.sessions  # type: ignore[attr-defined]
    now = datetime.now(UTC)
    with session_factory() as session:
        assert sweep_staging(session, blobs, now=now, grace_s=3600) == 0  # all written just now
    assert _staged(blobs) == {named_key, orphan, pending, unknown}
    with session_factory() as session:
        assert sweep_staging(session, blobs, now=now + timedelta(hours=2), grace_s=3600) == 1
    assert _staged(blobs) == {named_key, pending, unknown}
    with session_factory() as session:  # a second pass finds nothing more to do
        assert sweep_staging(session, blobs, now=now + timedelta(hours=2), grace_s=3600) == 0
