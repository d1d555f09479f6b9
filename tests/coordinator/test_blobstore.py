"""Both blob stores hold to one contract; the S3 one is tested over real HTTP against moto's S3 server on
loopback (moto[server], an S3-speaking server in Python)."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.blobstore import (
    BlobError,
    BlobMissing,
    BlobStore,
    LocalBlobStore,
    S3BlobStore,
    StagedChanged,
    open_blob_store,
)
from coordinator.settings import Settings
from modules.codec import CodecError, encode
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import A, create_running_run, join, lease, train_lease, upload, wait_applied


def _bucket(endpoint: str, name: str) -> Any:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket=name)
    return client


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        return LocalBlobStore(tmp_path / "blobs")
    endpoint = request.getfixturevalue("s3_env")
    name = f"b{abs(hash(str(tmp_path))) % 10**8}"
    _bucket(endpoint, name)
    opened = open_blob_store(f"s3://{name}/run-blobs", s3_endpoint_url=endpoint)
    assert isinstance(opened, S3BlobStore)
    return opened


def _corrupt(store: BlobStore, digest: str) -> None:
    if isinstance(store, LocalBlobStore):
        store.path(digest).write_bytes(b"tampered")
    else:
        assert isinstance(store, S3BlobStore)
        store.client.put_object(Bucket=store.bucket, Key=store.key(digest), Body=b"tampered")


def test_contract(store: BlobStore) -> None:
    data = b"weights" * 1000
    digest = store.put_bytes(data)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.put_bytes(data) == digest  # idempotent
    assert store.exists(digest) and store.get_bytes(digest) == data
    assert b"".join(store.iter_verified(digest)) == data
    streamed, size = store.put_stream(io.BytesIO(b"x" * 3_000_000))
    assert size == 3_000_000 and store.get_bytes(streamed) == b"x" * 3_000_000
    missing = "0" * 64
    assert not store.exists(missing)
    with pytest.raises(BlobError, match="is missing"):
        store.get_bytes(missing)
    with pytest.raises(BlobError, match="not a sha256 hex digest"):
        store.get_bytes("../etc/passwd")
    _corrupt(store, digest)
    with pytest.raises(BlobError, match=f"blob {digest} is corrupted"):
        store.get_bytes(digest)
    with pytest.raises(BlobError, match="is corrupted"):
        b"".join(store.iter_verified(digest))


def test_put_tensors_names_and_stores_the_bytes_encode_gives(store: BlobStore) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(300, 257, generator=gen), "b": torch.randn(257, generator=gen)}
    digest = store.put_tensors(tensors)
    assert digest == hashlib.sha256(encode(tensors)).hexdigest()
    assert store.get_bytes(digest) == encode(tensors)
    assert store.put_tensors(tensors) == digest  # idempotent
    with pytest.raises(CodecError, match="float32 tensors only"):
        store.put_tensors({"w": torch.zeros(3, dtype=torch.bfloat16)})


def test_staging_contract(store: BlobStore, tmp_path: Path) -> None:
    """A staged upload is outside the content names until promoted; verifying it survives another executor
    removing the staged name meanwhile; promoting twice is a no-op."""
    data = b"outer gradient" * 10_000
    digest = hashlib.sha256(data).hexdigest()
    body = tmp_path / "spooled"
    body.write_bytes(data)
    key = store.staging_key(f"7-{digest}")
    store.stage_file(body, key)
    assert not body.exists()  # consumed
    assert not store.exists(digest)
    with pytest.raises(StagedChanged, match=f"the object at {key} has {len(data)} bytes, {len(data) + 1} were"):
        with store.open_staged(key, size=len(data) + 1):
            pass
    with store.open_staged(key, size=len(data)) as (path, actual):
        assert actual == digest
        store.delete_staged(key)  # another executor finished first
        assert path.read_bytes() == data
    with pytest.raises(BlobMissing, match="nothing is staged"):
        with store.open_staged(key, size=len(data)):
            pass
    body.write_bytes(data)
    store.stage_file(body, key)
    store.promote_staged(key, digest)
    store.promote_staged(key, digest)
    assert store.get_bytes(digest) == data
    store.delete_staged(key)
    assert store.get_bytes(digest) == data
    for bad in ("", "a/b", "..", ".hidden"):
        with pytest.raises(BlobError, match="bad staging name"):
            store.staging_key(bad)


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(BlobError, match="use a directory, file:///path or s3://bucket/prefix"):
        open_blob_store("gs://bucket")


def test_a_round_on_s3(tmp_path: Path, s3_env: str, clock: FakeClock) -> None:
    client_s3 = _bucket(s3_env, "dipaco-round")
    settings = Settings(
        data_dir=tmp_path / "coordinator",
        database_url=f"sqlite:///{tmp_path / 'r.db'}",
        blob_url="s3://dipaco-round/registry",
        s3_endpoint_url=s3_env,
        admin_token=ADMIN,  # type: ignore[arg-type]
        join_token=JOIN,  # type: ignore[arg-type]
    )
    with TestClient(create_app(settings, clock=clock)) as client:
        create_running_run(client)
        island_id, h = join(client)
        for _ in range(4):
            lb = lease(client, island_id, h)
            assert lb is not None
            assert upload(client, lb, h, train_lease(client, lb, h)).status_code == 200
        wait_applied(client, lb["run_id"])
        modules = client.get("/v1/modules", headers=A).json()["data"]
        assert all(m["version"] == 1 for m in modules)
        weights = client.get(f"/v1/modules/{modules[0]['id']}/weights", headers=A)
        assert hashlib.sha256(weights.content).hexdigest() == modules[0]["weights_hash"]
    keys = [o["Key"] for o in client_s3.list_objects_v2(Bucket="dipaco-round")["Contents"]]
    assert f"registry/{modules[0]['weights_hash'][:2]}/{modules[0]['weights_hash']}" in keys
    assert not (tmp_path / "coordinator" / "blobs").exists()  # nothing went to a local directory
