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
