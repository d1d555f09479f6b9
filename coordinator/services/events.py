"""Events: what an operator wants to see after the fact (lease expiries, refused uploads, revocations, failed
module steps).

Each is recorded where it happens: a lease expiry and a revocation in the transaction that makes them (they are
rolled back together), a refused upload in a short transaction of its own, since the refusal rolls the upload's
transaction back (`record_refused_upload`). Reading is a cursor over increasing ids (`list_events`), so a page
that polls asks only for what is new.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from coordinator.errors import ServiceError
from coordinator.models import Event, Lease, Path
from coordinator.schemas import EventPublic
from coordinator.services.runs import get_run
from coordinator.states import EventKind
from coordinator.timeutil import as_utc

log = logging.getLogger(__name__)

DETAIL_CHARS = 2000
"""Longest detail kept (the column's size); longer reasons are cut with an ellipsis."""


@dataclass(frozen=True, slots=True)
class ExpiredLease:
    """A lease that the caller just marked expired (see `leases.expire_stale_leases`)."""

    lease_id: int
    run_id: int
    island_id: int
    round: int
    path_index: int
    offered: bool
    """It was an offer that its island did not take up in time (not a lease it was training)."""


def _cut(text: str) -> str:
    return text if len(text) <= DETAIL_CHARS else text[: DETAIL_CHARS - 1] + "…"


def add_lease_expiries(session: Session, expired: Iterable[ExpiredLease], *, now: datetime) -> None:
    """Add one event per expired lease to the caller's transaction."""
    session.add_all(
        Event(
            kind=EventKind.LEASE_EXPIRED,
            run_id=e.run_id,
            island_id=e.island_id,
            lease_id=e.lease_id,
            round=e.round,
            path_index=e.path_index,
            detail=(
                f"offer of path {e.path_index} (round {e.round}) to island {e.island_id} was not taken up in time"
                if e.offered
                else f"lease {e.lease_id} of island {e.island_id} on path {e.path_index} (round {e.round}) "
                "expired without an upload: no heartbeat within the run's lease TTL"
            ),
            created_at=now,
        )
        for e in expired
    )


def add_revocation(session: Session, *, island_id: int, island_name: str, released: int, now: datetime) -> None:
    """Add the event of an island's revocation to the caller's transaction."""
    session.add(
        Event(
            kind=EventKind.ISLAND_REVOKED,
            island_id=island_id,
            detail=f"island {island_id} ({island_name}) was revoked by an admin; "
            f"{released} pending lease(s) went back to the pool",
            created_at=now,
        )
    )


def add_apply_failure(
    session: Session,
    *,
    run_id: int,
    round_: int,
    module_id: int,
    executor: str,
    attempt: int,
    error: BaseException,
    retry_s: float,
    now: datetime,
) -> None:
    """Add the event of a module step that failed in an apply executor to the caller's transaction."""
    session.add(
        Event(
            kind=EventKind.APPLY_FAILED,
            run_id=run_id,
            round=round_,
            detail=_cut(
                f"the step of module {module_id} for round/period {round_} failed in apply executor {executor} "
                f"(attempt {attempt}): {type(error).__name__}: {error}; it is tried again in {retry_s:.0f} s, "
                "and its round waits for it"
            ),
            created_at=now,
        )
    )


def record_refused_upload(
    sessions: sessionmaker[Session], *, lease_id: int, island_id: int, error: ServiceError, now: datetime
) -> None:
    """Record a refused upload in a transaction of its own (the upload's was rolled back); the lease, when it
    exists, says which run, round and path. Never raises: the island's refusal matters more than the record."""
    try:
        with sessions() as session:
            where = session.execute(
                select(Lease.run_id, Lease.round, Path.index)
                .join(Path, Path.id == Lease.path_id)
                .where(Lease.id == lease_id)
            ).first()
            run_id, round_, path_index = where if where is not None else (None, None, None)
            session.add(
                Event(
                    kind=EventKind.UPLOAD_REFUSED,
                    run_id=run_id,
                    island_id=island_id,
                    lease_id=lease_id,
                    round=round_,
                    path_index=path_index,
                    detail=_cut(f"HTTP {error.status_code}: {error.detail}"),
                    created_at=now,
                )
            )
            session.commit()
    except Exception:  # the refusal is still sent; only the dashboard misses it
        log.exception("could not record the refused upload for lease %d", lease_id)


def event_public(e: Event) -> EventPublic:
    return EventPublic(
        id=e.id,
        kind=e.kind,
        run_id=e.run_id,
        island_id=e.island_id,
        lease_id=e.lease_id,
        round=e.round,
        path_index=e.path_index,
        detail=e.detail,
        created_at=as_utc(e.created_at),
    )


def list_events(
    session: Session,
    *,
    run_id: int | None,
    kind: EventKind | None,
    after: int,
    newest_first: bool,
    offset: int,
    limit: int,
) -> tuple[list[EventPublic], int]:
    """Events with id > `after` (and of the run / kind when given), oldest or newest first; the count is of
    all that match; 404 for a run that does not exist. A page that polls passes the largest id it has seen as
    `after`."""
    where = [Event.id > after]
    if run_id is not None:
        get_run(session, run_id)
        where.append(Event.run_id == run_id)
    if kind is not None:
        where.append(Event.kind == kind)
    count = session.scalar(select(func.count()).select_from(Event).where(*where)) or 0
    order = Event.id.desc() if newest_first else Event.id.asc()
    rows = session.scalars(select(Event).where(*where).order_by(order).offset(offset).limit(limit))
    return [event_public(e) for e in rows], count
