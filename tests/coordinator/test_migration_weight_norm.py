"""Migration 0010 on a database with rows, on SQLite and PostgreSQL: upgrading from 0009 keeps every module row,
its weight norm NULL (not measured), which the API serves as null; downgrading drops only the column."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import inspect, text

from coordinator.app import create_app
from coordinator.db import downgrade, make_engine, upgrade
from coordinator.settings import Settings
from tests.conftest import ADMIN, JOIN, FakeClock
from tests.coordinator.helpers import A

WHEN = datetime(2026, 1, 1, tzinfo=UTC)
MODULE_COLUMNS = 'id, run_id, level_id, level_index, "index", version, weights_hash, num_params, period_size'


def _seed_0009(url: str) -> None:
    """A finished run with one level of two modules, written with 0009's schema."""
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO runs (id, name, status, layout, config, num_paths, inner_steps, num_rounds, "
                    "current_round, seed, lease_ttl_s, quorum, created_at) VALUES (1, 'old', 'finished', "
                    "'embed:shared', '{}', 1, 2, 1, 1, 0, 120, 1, :at)"
                ),
                {"at": WHEN},
            )
            conn.execute(
                text(
                    'INSERT INTO levels (id, run_id, "index", name, sharing, num_modules) '
                    "VALUES (1, 1, 0, 'embed', 'routed', 2)"
                )
            )
            for index in range(2):
                conn.execute(
                    text(
                        'INSERT INTO modules (id, run_id, level_id, level_index, "index", version, weights_hash, '
                        "num_params, updated_at) VALUES (:id, 1, 1, 0, :index, 3, :digest, 64, :at)"
                    ),
                    {"id": 10 + index, "index": index, "digest": f"{index}" * 64, "at": WHEN},
                )
    finally:
        engine.dispose()


def _modules(url: str) -> list[tuple[object, ...]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(f"SELECT {MODULE_COLUMNS} FROM modules ORDER BY id"))]
    finally:
        engine.dispose()


def _columns(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("modules")}
    finally:
        engine.dispose()


def test_upgrade_from_0009_keeps_modules_with_no_weight_norm(database_url: str, tmp_path: Path) -> None:
    upgrade(database_url, "0009")
    _seed_0009(database_url)
    before = _modules(database_url)
    assert len(before) == 2 and "weight_norm" not in _columns(database_url)

    upgrade(database_url, "0010")
    assert _modules(database_url) == before
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT weight_norm FROM modules ORDER BY id")).scalars().all() == [None, None]
    finally:
        engine.dispose()

    settings = Settings(
        data_dir=tmp_path / "coordinator",
        database_url=database_url,
        admin_token=ADMIN,
        join_token=JOIN,  # type: ignore[arg-type]
    )
    with TestClient(create_app(settings, clock=FakeClock())) as client:
        r = client.get("/v1/modules?run_id=1", headers=A)
        assert r.status_code == 200, r.text
        assert [(m["id"], m["version"], m["weight_norm"]) for m in r.json()["data"]] == [(10, 3, None), (11, 3, None)]

    downgrade(database_url, "0009")
    assert "weight_norm" not in _columns(database_url)
    assert _modules(database_url) == before
