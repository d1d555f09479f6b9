"""The coordinator app through Starlette's TestClient, on the parametrised database and the fake clock; `direct`:
the same on an s3:// blob store (moto's S3 server on loopback), where islands move tensors with pre-signed URLs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.settings import Settings
from tests.conftest import ADMIN, JOIN, FakeClock

BUCKET = "dipaco-direct"


@pytest.fixture
def client(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    with TestClient(create_app(settings, clock=clock)) as c:
        yield c


@pytest.fixture
def no_executors(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    """The app with no apply executor of its own (`--apply-workers 0`): closed rounds and due async steps wait for
    the test's (`helpers.app_executor`)."""
    settings.apply_workers = 0
    with TestClient(create_app(settings, clock=clock)) as client:
        yield client


@pytest.fixture
def quiet(settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    """The app with nothing of its own in the background during a test: no apply executor, and no sweep (its
    statements and commits would be counted with the request's)."""
    settings.apply_workers = 0
    settings.sweep_interval_s = 3600
    with TestClient(create_app(settings, clock=clock)) as client:
        yield client


@pytest.fixture(params=["file", "streamed"])
def value_checks(request: pytest.FixtureRequest, settings: Settings) -> str:
    """Where an upload's values are checked: read back from the spooled file (bodies under
    `upload_stream_check_bytes`, which the tests' are), or while it streams in (every body, here)."""
    if request.param == "streamed":
        settings.upload_stream_check_bytes = 0
    return str(request.param)


@pytest.fixture
def direct_settings(tmp_path: Path, s3_env: str, database_url: str) -> Settings:
    """Settings of a coordinator on an s3:// blob store (a prefix of its own in one moto bucket), on the
    parametrised database; change them before the app is made (`direct` makes it from them)."""
    import boto3

    boto3.client("s3", endpoint_url=s3_env).create_bucket(Bucket=BUCKET)
    return Settings(
        data_dir=tmp_path / "coordinator",
        database_url=database_url,
        blob_url=f"s3://{BUCKET}/{tmp_path.name}",
        s3_endpoint_url=s3_env,
        admin_token=ADMIN,  # type: ignore[arg-type]
        join_token=JOIN,  # type: ignore[arg-type]
    )


@pytest.fixture
def direct(direct_settings: Settings, clock: FakeClock) -> Iterator[TestClient]:
    with TestClient(create_app(direct_settings, clock=clock)) as client:
        yield client
