"""Liveness and Prometheus metrics, open to scrapers and load balancers (/metrics takes a token when one is set)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from coordinator.api.answers import errors
from coordinator.api.deps import SessionDep, SessionRoute, StateDep
from coordinator.auth import hash_token, token_digest
from coordinator.db import ping
from coordinator.errors import Unauthorized
from coordinator.services.islands import count_active

router = APIRouter(tags=["health"], route_class=SessionRoute)


@router.get("/healthz")
def healthz(session: SessionDep) -> dict[str, str]:
    ping(session)
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses=errors(401))
def metrics(session: SessionDep, state: StateDep, authorization: Annotated[str | None, Header()] = None) -> Response:
    """Prometheus text format: rounds applied, contributions by result, bytes in/out, leases, active islands.
    Open to scrapers unless `DIPACO_METRICS_TOKEN` is set; then it takes that bearer token."""
    expected = state.settings.metrics_token
    if expected is not None and not hmac.compare_digest(
        token_digest(authorization), hash_token(expected.get_secret_value())
    ):
        raise Unauthorized("wrong metrics token: /metrics takes the DIPACO_METRICS_TOKEN bearer token")
    within = 3 * state.settings.heartbeat_interval_s
    state.metrics.active_islands.set(count_active(session, now=state.clock(), within_s=within))
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
