"""The states of registry rows, one enum per table. Imports only the standard library.

Shared by the database models (stored as their string values, with a CHECK constraint), the wire schemas and
the REST client, so a state is spelled in one place. Values are lowercase words and never change: they are in
the database and on the wire.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ContributionStatus", "IslandStatus", "LeaseStatus", "RoundStatus", "RunStatus"]


class RunStatus(StrEnum):
    WAITING_FOR_SHARDS = "waiting_for_shards"
    """Created; starts when every path has a shard."""
    RUNNING = "running"
    FINISHED = "finished"
    """Every round applied."""


class RoundStatus(StrEnum):
    OPEN = "open"
    """Leasing and accepting uploads."""
    APPLIED = "applied"
    """Closed: every module through a contributing path took its outer step (exactly once)."""


class LeaseStatus(StrEnum):
    OFFERED = "offered"
    """Held for the island that trained the path last round; becomes active when that island asks for work."""
    ACTIVE = "active"
    """Being trained; heartbeats keep it alive until `expires_at`."""
    SUBMITTED = "submitted"
    """Its outer gradients were accepted."""
    EXPIRED = "expired"
    """Ran out (no heartbeat, offer not taken up, or its round closed without it)."""
    RELEASED = "released"
    """Given back by its island."""


PENDING_LEASES = (LeaseStatus.ACTIVE, LeaseStatus.OFFERED)
"""Lease states that hold a path until they expire."""


class ContributionStatus(StrEnum):
    ACCEPTED = "accepted"
    """Validated and stored; folded into its round's outer step."""


class IslandStatus(StrEnum):
    ACTIVE = "active"
    LEFT = "left"
    """Left with its own token."""
    REVOKED = "revoked"
    """Removed by an admin; its token no longer authenticates."""
