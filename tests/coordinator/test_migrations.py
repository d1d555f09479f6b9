"""Alembic is the only schema writer: upgrade, downgrade to base, upgrade again, and no drift from the models."""

from __future__ import annotations

from alembic import command
from sqlalchemy import inspect

from coordinator.db import alembic_config, downgrade, make_engine, upgrade

TABLES = {
    "runs",
    "levels",
    "modules",
    "module_versions",
    "paths",
    "path_modules",
    "shards",
    "islands",
    "leases",
    "contributions",
    "contribution_grads",
    "module_steps",
    "rounds",
    "events",
}


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_and_check(database_url: str) -> None:
    upgrade(database_url)
    assert _tables(database_url) == TABLES
    downgrade(database_url, "base")
    assert _tables(database_url) == set()
    upgrade(database_url)
    assert _tables(database_url) == TABLES
    command.check(alembic_config(database_url))  # raises if the models and the migrations disagree
