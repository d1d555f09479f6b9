"""A real coordinator process on an s3:// blob store (moto's S3 server on loopback) and two island processes train
a tiny 2x2 DiPaCo to the end with direct transfers: weights and shards come from pre-signed GETs, outer gradients go
to pre-signed PUTs and are committed; the coordinator moves no tensor byte.

Then every outer step is recomputed from the stored uploads, read back from the bucket (`checks.verify_run` with
the S3 store: module loads by byte range, weights hashed whole)."""

from __future__ import annotations

import pytest

from coordinator.blobstore import S3BlobStore, open_blob_store
from tests.integration.checks import verify_run
from tests.integration.conftest import Cluster, create_run, wait_finished, wait_islands_joined
from tests.integration.test_end_to_end import SPEC

pytestmark = pytest.mark.integration

BUCKET = "dipaco-e2e"


def _counter(metrics: str, name: str) -> float | None:
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_two_islands_train_a_run_through_the_bucket(cluster: Cluster, s3_env: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=BUCKET)
    blob_url = f"s3://{BUCKET}/{cluster.tmp.name}"
    cluster.start_coordinator(env={"DIPACO_BLOB_URL": blob_url, "DIPACO_S3_ENDPOINT_URL": s3_env})
    with cluster.admin() as client:
        a = cluster.start_island("island-a", "--max-rounds", "4")
        b = cluster.start_island("island-b", "--max-rounds", "4")
        wait_islands_joined(client, 2)
        run_id = create_run(client, {**SPEC, "name": "e2e-s3"})
        wait_finished(cluster, client, run_id)
        assert a.wait(timeout=60) == 0, cluster.log("island-a")
        assert b.wait(timeout=60) == 0, cluster.log("island-b")
        modules = client.get("/v1/modules", params={"run_id": run_id}).json()
        contributions = client.get("/v1/contributions", params={"run_id": run_id}).json()
        metrics = client.get("/metrics").text

    assert modules["count"] == 6 and all(m["version"] == 2 for m in modules["data"])
    assert contributions["count"] == 8 and len({c["island_id"] for c in contributions["data"]}) == 2
    assert all(part["scale"] == 1 for c in contributions["data"] for part in c["modules"])
    # no tensor byte through the coordinator: outer gradients, weights and shards all went by the bucket
    # (shards were registered through it: that is the admin's upload, not the islands' traffic)
    assert _counter(metrics, 'dipaco_bytes_in_total{kind="outer_gradient"}') == 0.0
    assert _counter(metrics, 'dipaco_bytes_out_total{kind="weights"}') == 0.0
    assert _counter(metrics, 'dipaco_bytes_out_total{kind="shard"}') == 0.0
    assert not (cluster.data_dir / "blobs").exists()

    blobs = open_blob_store(blob_url, s3_endpoint_url=s3_env)
    assert isinstance(blobs, S3BlobStore)
    assert list(blobs.list_staged()) == []  # every staged upload was verified, named and removed
    verify_run(cluster.database_url, blobs, run_id)
