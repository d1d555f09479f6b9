"""The island's exceptions: `IslandError` for what the island itself raises on purpose, and, re-exported under
the names the island has always used, the coordinator client's errors (base `coordinator.client_errors.
ClientError`): low-level httpx errors become those at the client boundary. Catch both bases at the top."""

from __future__ import annotations

from coordinator.client_errors import (
    ClientError,
    CoordinatorUnavailable,
    IntegrityError,
    LeaseLost,
    RequestRejected,
)

__all__ = ["ClientError", "CoordinatorUnavailable", "IntegrityError", "IslandError", "LeaseLost", "RequestRejected"]


class IslandError(Exception):
    """Base class of every error the island raises on purpose (not the client's: see `ClientError`)."""
