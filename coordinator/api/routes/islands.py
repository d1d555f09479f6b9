"""Islands: join, heartbeat, leave/revoke, and asking for work."""

from __future__ import annotations

import asyncio
import functools
import time
from datetime import datetime

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from sqlalchemy.orm import Session

from coordinator.api.deps import AppState, PrincipalDep, SessionDep, SessionRoute, StateDep, principal_for
from coordinator.auth import require, require_island
from coordinator.schemas import (
    H_HELD,
    H_IDLE,
    HeartbeatReply,
    IslandJoin,
    IslandJoined,
    IslandPublic,
    LeasePublic,
    ListOf,
)
from coordinator.services import islands, leases, registry

router = APIRouter(prefix="/v1", tags=["islands"], route_class=SessionRoute)

IDLE_RETRY_AFTER_S = 2
MAX_LEASE_WAIT_S = 60.0
"""Longest `?wait=` a lease request may ask for (below the islands' 60 s read timeout plus a margin)."""


@router.get("/islands", response_model=ListOf[IslandPublic])
def list_islands(
    session: SessionDep,
    _: PrincipalDep,
    status: str | None = None,
    offset: int = Query(0, ge=0),
    limit: int = Query(100, ge=1, le=1000),
) -> ListOf[IslandPublic]:
    data, count = registry.list_islands(session, status=status, offset=offset, limit=limit)
    return ListOf[IslandPublic](data=data, count=count)


@router.post("/islands", response_model=IslandJoined, status_code=201)
def join(spec: IslandJoin, session: SessionDep, state: StateDep, principal: PrincipalDep) -> IslandJoined:
    require(principal, "join", "admin")
    island, token = islands.join(session, spec, now=state.clock())
    return IslandJoined(island_id=island.id, token=token, heartbeat_interval_s=state.settings.heartbeat_interval_s)


@router.post("/islands/{island_id}/heartbeat", response_model=HeartbeatReply)
def heartbeat(island_id: int, session: SessionDep, state: StateDep, principal: PrincipalDep) -> HeartbeatReply:
    require_island(principal, island_id)
    active = islands.heartbeat(session, island_id, now=state.clock())
    return HeartbeatReply(
        island_id=island_id, active_lease_ids=active, heartbeat_interval_s=state.settings.heartbeat_interval_s
    )


@router.delete("/islands/{island_id}", status_code=204)
def leave(island_id: int, session: SessionDep, state: StateDep, principal: PrincipalDep) -> Response:
    """An island leaves with its own token; an admin token revokes the island."""
    if principal.scope == "admin":
        islands.leave(session, island_id, status="revoked")
    else:
        require_island(principal, island_id)
        islands.leave(session, island_id, status="left")
    state.island_tokens.forget(island_id)
    state.work.notify()  # its paths are free now
    return Response(status_code=204)


@router.post(
    "/islands/{island_id}/lease",
    response_model=LeasePublic,
    responses={
        204: {"description": f"No work now; header {H_IDLE} says why, Retry-After when to ask again"},
    },
)
async def lease(
    island_id: int,
    request: Request,
    state: StateDep,
    wait: float = Query(
        0,
        ge=0,
        le=MAX_LEASE_WAIT_S,
        description="Seconds to hold the request while there is no work (long polling); 0 answers at once",
    ),
) -> Response:
    """Work for the island: an offer made to it when the last round closed, else a free path of a running run.

    With `wait`, an idle island's request is held until work appears (a round opens, a lease is given back) or
    the time is up; header `X-Dipaco-Held-Ms` says how long it was held with nothing to do. When no run is
    running the answer comes at once (an island may want to leave then).
    """
    arrived = time.monotonic()
    principal = await principal_for(state, request.headers.get("authorization"))
    require_island(principal, island_id)
    until = arrived + wait
    held = 0.0
    while True:
        ticket = state.work.ticket()  # a change while this attempt runs wakes the wait below at once
        issued, reason = await _attempt(state, island_id, ticket)
        left = until - time.monotonic()
        if issued is not None or left <= 0 or reason == "no-running-runs":  # nothing to wait for: say so now
            break
        started = time.monotonic()
        await state.work.wait(ticket, left)
        held += time.monotonic() - started
    # how long it was held with nothing to do, and how long the coordinator worked on it apart from that
    timing = {
        H_HELD: str(round(held * 1000)),
        "Server-Timing": f"app;dur={(time.monotonic() - arrived - held) * 1000:.1f}",
    }
    if issued is None:
        # a long poll that ran out may ask again at once
        retry = 0 if wait > 0 and reason == "waiting" else IDLE_RETRY_AFTER_S
        return Response(status_code=204, headers={H_IDLE: reason, "Retry-After": str(retry), **timing})
    # Encoded here rather than by FastAPI (which would validate the model again): when a round opens, every
    # island's request completes at once, and what each costs is the length of that burst.
    return Response(issued.model_dump_json(), media_type="application/json", headers=timing)


async def _attempt(state: AppState, island_id: int, ticket: asyncio.Event | None) -> tuple[LeasePublic | None, str]:
    """One look for work: an offer this process built (no read), else the database, unless nothing changed
    since the island last found nothing there."""
    offer = state.offers.pop(island_id, now=state.clock())
    if offer is not None:
        issued = await state.offers.take_up(offer, functools.partial(_take_up, state))
        if issued is not None:
            state.metrics.leases_issued.inc()
            return issued, "leased"
    elif state.work.nothing_new(island_id, state.clock()):
        return None, "waiting"
    async with state.lease_slots:
        issued, reason, until = await run_in_threadpool(_lease_once, state, island_id)
    if issued is None and reason == "waiting":
        state.work.remember_idle(island_id, ticket, until)
    return issued, reason


def _take_up(state: AppState, offers: list[leases.ReadyOffer]) -> list[LeasePublic | None]:
    with state.sessions() as session:
        return leases.take_up_offers(session, offers, now=state.clock())


def _lease_once(state: AppState, island_id: int) -> tuple[LeasePublic | None, str, datetime | None]:
    """One attempt: take an offer, else a free path; a round past its deadline may close on the way.

    With no work found, also says until when time alone frees nothing (`leases.next_change`)."""
    now = state.clock()
    with state.sessions() as session:
        issued, reason, until = leases.take_offer(session, island_id, now=now), "leased", None
        if issued is None:
            issued, reason, until = _free_path(state, session, island_id, now=now)
        session.rollback()
    if issued is not None:
        state.metrics.leases_issued.inc()
    return issued, reason, until


def _free_path(
    state: AppState, session: Session, island_id: int, *, now: datetime
) -> tuple[LeasePublic | None, str, datetime | None]:
    for attempt in range(2):
        open_rounds = leases.open_rounds(session)
        if not open_rounds:
            return None, "no-running-runs", None
        issued, expired = leases.acquire_lease(session, island_id, open_rounds, now=now, affinity=state.affinity)
        state.metrics.lease_expiries.inc(expired)
        if issued is not None:
            return issued, "leased", None
        # Nothing free: a round past its deadline may close now on quorum, and its successor has work.
        due = [r.run_id for r in open_rounds if r.deadline is not None and now >= r.deadline]
        if attempt or not due or not state.apply_rounds(session, due, now=now):
            return None, "waiting", leases.next_change(session, open_rounds, now=now, affinity=state.affinity)
    raise AssertionError("unreachable")
