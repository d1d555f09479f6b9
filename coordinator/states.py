"""The states of registry rows, one enum per table. Imports only the standard library.

Shared by the database models (stored as their string values, with a CHECK constraint), the wire schemas and
the REST client, so a state is spelled in one place. Values are lowercase words and never change: they are in
the database and on the wire.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = ["ContributionStatus", "EventKind", "StepStatus", "IslandStatus", "LeaseStatus", "RoundStatus", "RunStatus"]


class RunStatus(StrEnum):
    WAITING_FOR_SHARDS = "waiting_for_shards"
    """Created; starts when every path has a shard."""
    RUNNING = "running"
    FINISHED = "finished"
    """Every round applied."""


class RoundStatus(StrEnum):
    OPEN = "open"
    """Leasing and accepting uploads."""
    CLOSING = "closing"
    """Enough paths contributed: no more leases or uploads; apply executors are stepping its modules."""
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


class StepStatus(StrEnum):
    """One module's outer step of a closing round, as apply executors see it."""

    PENDING = "pending"
    RUNNING = "running"
    """Claimed by an executor (`claimed_by`); another may take it over once the claim is stale or its process
    is gone."""
    DONE = "done"
    """Committed: the module's new version exists (exactly once)."""


class ContributionStatus(StrEnum):
    ACCEPTED = "accepted"
    """Validated and stored; folded into its round's outer step."""


class IslandStatus(StrEnum):
    ACTIVE = "active"
    LEFT = "left"
    """Left with its own token."""
    REVOKED = "revoked"
    """Removed by an admin; its token no longer authenticates."""


class EventKind(StrEnum):
    """What a row of the `events` table records (the dashboard's event list; CHECK constraint, migrations 0004 and
    0014: a new kind needs a migration of its own)."""

    LEASE_EXPIRED = "lease_expired"
    """An active lease ran out without an upload (no heartbeat in time), or an offer was not taken up."""
    UPLOAD_REFUSED = "upload_refused"
    """An island's outer-gradient upload was refused; the event's detail is the reason the island was sent."""
    ISLAND_REVOKED = "island_revoked"
    """An admin revoked an island; its pending leases went back to the pool."""
    APPLY_FAILED = "apply_failed"
    """A module step failed in an apply executor (the error, the attempt, when it is tried again): the step is
    retried with a growing delay, and its round (or async period) waits for it."""
