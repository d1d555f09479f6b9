"""Islands: join, heartbeat, leave/revoke, and asking for work."""

from __future__ import annotations

import time

from fastapi import APIRouter, Query, Request, Response

from coordinator.api.answers import V1_ERRORS, errors
from coordinator.api.deps import Id, Limit, Offset, PrincipalDep, SessionDep, SessionRoute, StateDep
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
from coordinator.services import islands, registry
from coordinator.states import IslandStatus

router = APIRouter(prefix="/v1", tags=["islands"], route_class=SessionRoute, responses=V1_ERRORS)

IDLE_RETRY_AFTER_S = 2
MAX_LEASE_WAIT_S = 60.0
"""Longest `?wait=` a lease request (or a lease's modules request) may ask for (below the islands' 60 s read timeout
plus a margin)."""


@router.get("/islands", response_model=ListOf[IslandPublic])
def list_islands(
    session: SessionDep,
    _: PrincipalDep,
    status: IslandStatus | None = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[IslandPublic]:
    data, count = registry.list_islands(session, status=status, offset=offset, limit=limit)
    return ListOf[IslandPublic](data=data, count=count)


@router.post("/islands", response_model=IslandJoined, status_code=201, responses=errors(400, 403))
def join(spec: IslandJoin, session: SessionDep, state: StateDep, principal: PrincipalDep) -> IslandJoined:
    require(principal, "join", "admin")
    island, token = islands.join(session, spec, now=state.clock())
    return IslandJoined(island_id=island.id, token=token, heartbeat_interval_s=state.settings.heartbeat_interval_s)


@router.post("/islands/{island_id}/heartbeat", response_model=HeartbeatReply, responses=errors(403, 404))
async def heartbeat(island_id: Id, state: StateDep, principal: PrincipalDep) -> HeartbeatReply:
    """Liveness, and the island's active leases extended. Heartbeats that arrive together are recorded in one
    transaction (`AppState.heartbeats`)."""
    require_island(principal, island_id)
    active = await state.heartbeats.submit(island_id)
    return HeartbeatReply(
        island_id=island_id, active_lease_ids=active, heartbeat_interval_s=state.settings.heartbeat_interval_s
    )


@router.delete("/islands/{island_id}", status_code=204, responses=errors(403, 404))
def leave(island_id: Id, session: SessionDep, state: StateDep, principal: PrincipalDep) -> Response:
    """An island leaves with its own token; an admin token revokes the island."""
    if principal.scope == "admin":
        status = IslandStatus.REVOKED
    else:
        require_island(principal, island_id)
        status = IslandStatus.LEFT
    islands.leave(
        session, island_id, status=status, token_cache=state.island_tokens, wakeups=state.wakeups, now=state.clock()
    )
    return Response(status_code=204)


@router.post(
    "/islands/{island_id}/lease",
    response_model=LeasePublic,
    responses={
        204: {"description": f"No work now; header {H_IDLE} says why, Retry-After when to ask again"},
        **errors(403, 409),
    },
)
async def lease(
    island_id: Id,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
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
    require_island(principal, island_id)
    answer = await state.dispatcher.next_lease(island_id, wait_s=wait)
    # how long it was held with nothing to do, and how long the coordinator worked on it apart from that
    timing = {
        H_HELD: str(round(answer.held_s * 1000)),
        "Server-Timing": f"app;dur={(time.monotonic() - arrived - answer.held_s) * 1000:.1f}",
    }
    if answer.lease is None:
        # a long poll that ran out may ask again at once
        retry = 0 if wait > 0 and answer.idle == "waiting" else IDLE_RETRY_AFTER_S
        return Response(status_code=204, headers={H_IDLE: str(answer.idle), "Retry-After": str(retry), **timing})
    # Encoded here rather than by FastAPI (which would validate the model again): when a round opens, every
    # island's request completes at once, and what each costs is the length of that burst.
    return Response(answer.lease.model_dump_json(), media_type="application/json", headers=timing)
