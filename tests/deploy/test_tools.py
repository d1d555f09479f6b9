"""The image's admin tools (deploy/tools/): creating the demo run through the typed client against the real
app, and creating the bucket against an S3-speaking server on loopback (moto)."""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.client import CoordinatorClient, RetryPolicy
from coordinator.settings import Settings
from island.distributed import free_port
from tests.conftest import ADMIN
from tests.deploy.helpers import DEPLOY


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_tools_{name}", DEPLOY / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def coordinator(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        yield client


def test_create_run_creates_the_demo_run_once(
    coordinator: TestClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    create_run = _tool("create_run")
    monkeypatch.setenv("DIPACO_ADMIN_TOKEN", ADMIN)
    argv = ["--coordinator", "http://testserver", "--spec", str(DEPLOY / "demo" / "run.json"), "--wait", "0"]
    assert create_run.main(argv, http=coordinator) == 0
    first = capsys.readouterr().out.split()
    assert create_run.main(argv, http=coordinator) == 0  # a later `docker compose up`: reported, not created
    assert capsys.readouterr().out.split() == first
    run_id, status = first
    assert status == "waiting_for_shards"
    with CoordinatorClient("http://testserver", ADMIN, http=coordinator, retry=RetryPolicy.once()) as client:
        (run,) = client.runs()
    spec = json.loads((DEPLOY / "demo" / "run.json").read_text())
    assert (run.id, run.name, run.num_paths, run.num_rounds) == (int(run_id), spec["name"], 4, spec["num_rounds"])


def test_create_run_refuses_a_bad_spec_before_sending_it(
    coordinator: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    create_run = _tool("create_run")
    monkeypatch.setenv("DIPACO_ADMIN_TOKEN", ADMIN)
    bad = tmp_path / "run.json"
    bad.write_text(json.dumps({"name": "r", "inner_step": 3}))
    assert create_run.main(["--spec", str(bad), "--coordinator", "http://testserver"], http=coordinator) == 1
    assert "inner_step" in caplog.text
    monkeypatch.delenv("DIPACO_ADMIN_TOKEN")
    assert create_run.main(["--spec", str(DEPLOY / "demo" / "run.json")], http=coordinator) == 1
    assert "no admin token" in caplog.text


@pytest.fixture
def store_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str) -> str:
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "DIPACO_BLOB_URL": "s3://dipaco-deploy-test/blobs",
        "DIPACO_S3_ENDPOINT_URL": s3_endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    return s3_endpoint


def test_create_bucket_creates_it_once(store_env: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="create_bucket")
    pytest.importorskip("boto3", reason="boto3 is not installed (the s3 extra)")
    create_bucket = _tool("create_bucket")
    assert create_bucket.main([]) == 0
    assert "created bucket dipaco-deploy-test" in caplog.text
    assert create_bucket.main([]) == 0
    assert "bucket dipaco-deploy-test exists" in caplog.text
    import boto3

    names = {b["Name"] for b in boto3.client("s3", endpoint_url=store_env).list_buckets()["Buckets"]}
    assert "dipaco-deploy-test" in names


def test_create_bucket_gives_up_on_an_absent_store(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("boto3", reason="boto3 is not installed (the s3 extra)")
    create_bucket = _tool("create_bucket")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("DIPACO_BLOB_URL", "s3://b/p")
    monkeypatch.setenv("DIPACO_S3_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    assert create_bucket.main(["--wait", "0.2"]) == 1
    assert "gave up on the store" in caplog.text
    monkeypatch.setenv("DIPACO_BLOB_URL", "/var/lib/blobs")
    assert create_bucket.main([]) == 1
    assert "must be s3://bucket" in caplog.text
