"""Alembic environment: the URL comes from the Config (set by coordinator.db) or DIPACO_DATABASE_URL."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, text

from coordinator.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or os.environ.get("DIPACO_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: set DIPACO_DATABASE_URL or sqlalchemy.url")
    return url


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    url = _url()
    engine = create_engine(url)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=url.startswith("sqlite"),
            compare_type=True,
        )
        with context.begin_transaction():
            if connection.dialect.name == "postgresql":
                # Replicas starting together on one database: migrate one at a time.
                connection.execute(text("SELECT pg_advisory_xact_lock(72430001)"))
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
