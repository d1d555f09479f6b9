"""Islands: join, heartbeat, leave/revoke, and asking for work."""

from __future__ import annotations

from fastapi import APIRouter, Query, Response

from coordinator.api.deps import PrincipalDep, SessionDep, StateDep
from coordinator.auth import require, require_island
from coordinator.schemas import (
    H_IDLE,
    HeartbeatReply,
    IslandJoin,
    IslandJoined,
    IslandPublic,
    LeasePublic,
    ListOf,
)
from coordinator.services import islands, leases, registry, rounds

router = APIRouter(prefix="/v1", tags=["islands"])

IDLE_RETRY_AFTER_S = 2


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
    now = state.clock()
    state.metrics.lease_expiries.inc(leases.expire_stale_leases(session, now=now))
    active = islands.heartbeat(session, island_id, now=now)
    return HeartbeatReply(
        island_id=island_id, active_lease_ids=active, heartbeat_interval_s=state.settings.heartbeat_interval_s
    )


@router.delete("/islands/{island_id}", status_code=204)
def leave(island_id: int, session: SessionDep, principal: PrincipalDep) -> Response:
    """An island leaves with its own token; an admin token revokes the island."""
    if principal.scope == "admin":
        islands.leave(session, island_id, status="revoked")
    else:
        require_island(principal, island_id)
        islands.leave(session, island_id, status="left")
    return Response(status_code=204)


@router.post(
    "/islands/{island_id}/lease",
    response_model=LeasePublic,
    responses={204: {"description": f"No work now; header {H_IDLE} says why, Retry-After when to ask again"}},
)
def lease(island_id: int, session: SessionDep, state: StateDep, principal: PrincipalDep) -> LeasePublic | Response:
    require_island(principal, island_id)
    now = state.clock()
    state.metrics.lease_expiries.inc(leases.expire_stale_leases(session, now=now))
    session.commit()
    state.metrics.rounds_applied.inc(rounds.apply_ready_rounds(session, state.blobs, now=now, faults=state.faults))
    affinity = leases.Affinity(
        reserve_s=state.settings.path_reservation_s, live_s=3 * state.settings.heartbeat_interval_s
    )
    issued, reason = leases.acquire_lease(session, island_id, now=now, affinity=affinity)
    if issued is None:
        return Response(status_code=204, headers={H_IDLE: reason, "Retry-After": str(IDLE_RETRY_AFTER_S)})
    state.metrics.leases_issued.inc()
    return leases.lease_public(session, issued)
