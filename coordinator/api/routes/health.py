"""Liveness and Prometheus metrics (both without auth, as scrapers and load balancers expect)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.api.deps import SessionDep, SessionRoute, StateDep
from coordinator.db import ping
from coordinator.services.islands import count_active

router = APIRouter(tags=["health"], route_class=SessionRoute)


@router.get("/healthz")
def healthz(session: SessionDep) -> dict[str, str]:
    ping(session)
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
def metrics(session: SessionDep, state: StateDep) -> Response:
    """Prometheus text format: rounds applied, contributions by result, bytes in/out, leases, active islands."""
    within = 3 * state.settings.heartbeat_interval_s
    state.metrics.active_islands.set(count_active(session, now=state.clock(), within_s=within))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
