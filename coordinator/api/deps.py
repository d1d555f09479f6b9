"""Request dependencies, declared once as `Annotated` aliases."""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.auth import Principal, ServiceTokens, authenticate
from coordinator.blobstore import BlobStore
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.services.leases import Affinity
from coordinator.settings import Settings
from coordinator.work import WorkSignal


@dataclass(slots=True)
class AppState:
    settings: Settings
    engine: Engine
    sessions: sessionmaker[Session]
    blobs: BlobStore
    tokens: ServiceTokens
    clock: Callable[[], datetime]
    spool_dir: Path
    metrics: Metrics
    faults: FaultInjector
    work: WorkSignal = field(default_factory=WorkSignal)
    """Wakes lease requests that wait for work (see coordinator/work.py)."""
    lease_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    """Lease attempts in flight at once: they serialise on the run row anyway, and the threads they would hold
    are better left to heartbeats and uploads when a round opens and every island asks at once."""

    @property
    def affinity(self) -> Affinity:
        """Paths stay with the island that trained them (offers, reservations), from the settings."""
        return Affinity(reserve_s=self.settings.path_reservation_s, live_s=3 * self.settings.heartbeat_interval_s)


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.dipaco
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def get_session(state: StateDep) -> AsyncIterator[Session]:
    """One session per request, opened and closed on the event loop.

    Closing needs no worker thread, so a request never holds a database connection while it queues for a
    thread: with as many connections as threads, that wait could deadlock (every thread waiting for a
    connection, every connection held by a request waiting for a thread), as it did with 256 islands.
    """
    session = state.sessions()
    try:
        yield session
    finally:
        session.close()


SessionDep = Annotated[Session, Depends(get_session)]


def authenticate_with(state: AppState, authorization: str | None) -> Principal:
    with state.sessions() as session:
        principal = authenticate(session, state.tokens, authorization)
        session.rollback()
        return principal


def get_principal(
    state: StateDep, session: SessionDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """Authenticate in the request's own session (one indexed lookup); the read-only transaction ends here, so the
    connection goes back to the pool before the request moves on to another thread."""
    try:
        return authenticate(session, state.tokens, authorization)
    finally:
        session.rollback()


PrincipalDep = Annotated[Principal, Depends(get_principal)]


class SessionRoute(APIRoute):
    """Routes whose sync endpoint takes the request `session` close it in the endpoint's own worker thread.

    FastAPI validates a sync endpoint's return value on another worker thread and tears dependencies down after
    that; a session left with an open read transaction would hold its connection through both waits. With as
    many connections as threads, requests holding connections while queueing for threads, and threads queueing
    for connections, stall until the pool times out (tests/coordinator/test_concurrency.py). Endpoints return
    pydantic models built inside them, so nothing needs the session afterwards.
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint) and "session" in inspect.signature(endpoint).parameters:
            endpoint = _closing_session(endpoint)
        super().__init__(path, endpoint, **kwargs)


def _closing_session(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            kwargs["session"].close()

    return run
