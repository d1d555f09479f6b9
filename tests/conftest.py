"""Shared fixtures: a database per test (SQLite file, or a fresh PostgreSQL database when one answers on
127.0.0.1:5432), coordinator settings with fixed tokens, and a controllable clock."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from coordinator.settings import Settings

ADMIN = "admin-token-for-tests-0000"
JOIN = "join-token-for-tests-00000"
PG_SERVER = os.environ.get("DIPACO_TEST_PG_SERVER", "postgresql+psycopg://postgres@127.0.0.1:5432")

# pytest-xdist workers inherit COLUMNS=80 from it; the CLIs' output width is asserted as a user without a terminal
# (and without $COLUMNS) sees it, so the suite runs the same on workers and in one process
os.environ.pop("COLUMNS", None)

_pg_state: dict[str, str | None] = {}


def _pg_unavailable_reason() -> str | None:
    """None when PostgreSQL answers, else why not (checked once per session)."""
    if "reason" not in _pg_state:
        try:
            import psycopg

            with psycopg.connect(
                PG_SERVER.replace("postgresql+psycopg", "postgresql") + "/postgres", connect_timeout=3
            ):
                pass
            _pg_state["reason"] = None
        except Exception as exc:  # any failure to connect means: skip PostgreSQL tests, saying why
            _pg_state["reason"] = f"PostgreSQL not answering at {PG_SERVER}: {exc.__class__.__name__}: {exc}"
    return _pg_state["reason"]


def _pg_admin(sql: str) -> None:
    import psycopg

    with psycopg.connect(PG_SERVER.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as c:
        c.execute(sql)  # type: ignore[arg-type]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test; dropped afterwards."""
    reason = _pg_unavailable_reason()
    if reason:
        if os.environ.get("DIPACO_REQUIRE_PG") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    name = f"dipaco_test_{uuid.uuid4().hex[:12]}"
    _pg_admin(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_SERVER}/{name}"
    finally:
        _pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'registry.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def settings(tmp_path: Path, database_url: str) -> Settings:
    return Settings(
        data_dir=tmp_path / "coordinator",
        database_url=database_url,
        admin_token=ADMIN,
        join_token=JOIN,  # type: ignore[arg-type]
    )


class FakeClock:
    """The coordinator's one clock, moved by hand in tests."""

    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's S3-compatible server on loopback (the `moto[server]` dev dependency), for the whole session."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is not installed")
    from island.distributed import free_port

    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str) -> str:
    """Credentials for the moto server in the environment boto3 reads; its endpoint URL."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(key, value)
    return s3_endpoint
