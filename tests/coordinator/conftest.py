"""The coordinator app through Starlette's TestClient, on the parametrised database and the fake clock."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.settings import Settings
from tests.conftest import FakeClock


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


@pytest.fixture(params=["file", "streamed"])
def value_checks(request: pytest.FixtureRequest, settings: Settings) -> str:
    """Where an upload's values are checked: read back from the spooled file (bodies under
    `upload_stream_check_bytes`, which the tests' are), or while it streams in (every body, here)."""
    if request.param == "streamed":
        settings.upload_stream_check_bytes = 0
    return str(request.param)
