"""One clock for the coordinator (injectable in tests) and UTC normalisation of database timestamps."""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(value: datetime) -> datetime:
    """SQLite hands timestamps back without a zone; every timestamp we store is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
