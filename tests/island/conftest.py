"""Fixtures: the real coordinator app for island tests (see real_coordinator.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from coordinator.app import create_app
from coordinator.settings import Settings
from tests.conftest import FakeClock
from tests.island.real_coordinator import Coordinator


@pytest.fixture
def make_coordinator(settings: Settings, clock: FakeClock, tmp_path: Path) -> Iterator[Callable[..., Coordinator]]:
    """`make_coordinator(**settings_overrides)`: start the real app (at most once per test)."""
    started: list[Coordinator] = []

    def make(**overrides: Any) -> Coordinator:
        assert not started, "one coordinator per test"
        configured = settings.model_copy(update=overrides)
        app = TestClient(create_app(configured, clock=clock)).__enter__()
        started.append(Coordinator(app=app, clock=clock, settings=configured, tmp_path=tmp_path))
        return started[-1]

    yield make
    for coordinator in started:
        coordinator.close()


@pytest.fixture
def coordinator(make_coordinator: Callable[..., Coordinator]) -> Coordinator:
    return make_coordinator()
