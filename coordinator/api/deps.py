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
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.auth import IslandTokenCache, Principal, ServiceTokens, authenticate, known_principal, token_digest
from coordinator.blobstore import BlobStore
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.services.leases import Affinity, ReadyOffer
from coordinator.services.rounds import apply_ready_rounds
from coordinator.settings import Settings
from coordinator.work import OfferBook, WorkSignal


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
    island_tokens: IslandTokenCache
    """Island tokens found valid recently (settings.auth_cache_s): most requests authenticate without a query."""
    work: WorkSignal = field(default_factory=WorkSignal)
    """Wakes lease requests that wait for work (see coordinator/work.py)."""
    offers: OfferBook = field(default_factory=OfferBook)
    """Offers made by this process's applies, ready to hand out (see coordinator/work.py)."""
    lease_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(4))
    """Lease attempts in flight at once: they serialise on the run row anyway, and the threads they would hold
    are better left to heartbeats and uploads when a round opens and every island asks at once."""

    @property
    def affinity(self) -> Affinity:
        """Paths stay with the island that trained them (offers, reservations), from the settings."""
        return Affinity(reserve_s=self.settings.path_reservation_s, live_s=3 * self.settings.heartbeat_interval_s)

    def apply_rounds(self, session: Session, run_ids: list[int] | None, *, now: datetime) -> int:
        """Apply the ready rounds of `run_ids` (None: every running run); returns how many were applied.

        Their offers go to the offer book and held lease requests wake (the next rounds are open).
        """
        offered: list[ReadyOffer] = []
        applied = apply_ready_rounds(
            session,
            self.blobs,
            now=now,
            run_ids=run_ids,
            faults=self.faults,
            affinity=self.affinity,
            offered=offered,
        )
        if applied:
            self.metrics.rounds_applied.inc(applied)
            self.offers.put(offered, now=now)
            self.work.notify()
        return applied


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
    """Authenticate in a session of its own (a worker thread): one indexed lookup, read transaction ended."""
    with state.sessions() as session:
        principal = authenticate(session, state.tokens, authorization, state.island_tokens)
        session.rollback()
        return principal


async def principal_for(state: AppState, authorization: str | None) -> Principal:
    """Service tokens and recently seen island tokens on the event loop; others looked up on a worker thread."""
    known = known_principal(token_digest(authorization), state.tokens, state.island_tokens)
    if known is not None:
        return known
    return await run_in_threadpool(authenticate_with, state, authorization)


async def get_principal(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    return await principal_for(state, authorization)


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
