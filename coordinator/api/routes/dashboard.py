"""Reads for watching a run (the web dashboard at /ui/ polls these): a run's history of losses per path per
round, per-run totals, leases, and events. Any valid token reads, as for the other reads."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query

from coordinator.api.answers import V1_ERRORS, errors
from coordinator.api.deps import Id, IdFilter, Limit, Offset, PrincipalDep, SessionDep, SessionRoute, StateDep
from coordinator.schemas import DB_INT_MAX, EventPublic, LeaseSummary, ListOf, RunHistory, RunStats
from coordinator.services import activity, events, history
from coordinator.states import EventKind, LeaseStatus, RunStatus

router = APIRouter(prefix="/v1", tags=["dashboard"], route_class=SessionRoute, responses=V1_ERRORS)

LIVE_HEARTBEATS = 3
"""An island counts as live while its last heartbeat is within this many heartbeat intervals (as /metrics)."""


@router.get("/runs/{run_id}/history", response_model=RunHistory, responses=errors(404))
def run_history(
    session: SessionDep,
    _: PrincipalDep,
    run_id: Id,
    offset: Offset = 0,
    limit: Limit = 100,
) -> RunHistory:
    """The run's rounds, oldest first, each with the train loss of every path that contributed, its quorum,
    and its counts of refused uploads and lease expiries. Poll with `offset` = the first round not yet applied."""
    return history.run_history(session, run_id, offset=offset, limit=limit)


@router.get("/run-stats", response_model=ListOf[RunStats])
def run_stats(
    session: SessionDep,
    state: StateDep,
    _: PrincipalDep,
    status: RunStatus | None = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[RunStats]:
    """Totals per run (rounds applied, tokens, islands at work, latest loss, time per round), in the order and
    with the filter of `GET /v1/runs`, so the same `offset`/`limit` give the same runs."""
    live_s = LIVE_HEARTBEATS * state.settings.heartbeat_interval_s
    data, count = history.run_stats(
        session, status=status, offset=offset, limit=limit, now=state.clock(), live_s=live_s
    )
    return ListOf[RunStats](data=data, count=count)


@router.get("/leases", response_model=ListOf[LeaseSummary], responses=errors(404))
def list_leases(
    session: SessionDep,
    _: PrincipalDep,
    run_id: IdFilter = None,
    island_id: IdFilter = None,
    status: LeaseStatus | None = None,
    round: IdFilter = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[LeaseSummary]:
    """Leases, newest first; e.g. `?status=active` says which island trains which path of which round now."""
    data, count = activity.list_leases(
        session, run_id=run_id, island_id=island_id, status=status, round_=round, offset=offset, limit=limit
    )
    return ListOf[LeaseSummary](data=data, count=count)


@router.get("/events", response_model=ListOf[EventPublic], responses=errors(404))
def list_events(
    session: SessionDep,
    _: PrincipalDep,
    run_id: IdFilter = None,
    kind: EventKind | None = None,
    after: int = Query(0, ge=0, le=DB_INT_MAX, description="Only events with a larger id (the largest one seen)"),
    order: Literal["asc", "desc"] = Query("asc", description="By id: oldest first, or newest first"),
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[EventPublic]:
    """Lease expiries, refused uploads (with the reason the island was sent) and revocations. `count` is the
    number of events matching, all pages; a watcher polls with `after` = the largest id it has."""
    data, count = events.list_events(
        session, run_id=run_id, kind=kind, after=after, newest_first=order == "desc", offset=offset, limit=limit
    )
    return ListOf[EventPublic](data=data, count=count)
