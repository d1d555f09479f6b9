"""Request dependencies, declared once as `Annotated` aliases."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.concurrency import run_in_threadpool
from fastapi.routing import APIRoute
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.auth import IslandTokenCache, Principal, ServiceTokens, authenticate, known_principal, token_digest
from coordinator.batching import GroupCommit
from coordinator.blobstore import BlobStore
from coordinator.db import reading
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.offer_book import OfferBook
from coordinator.schemas import DB_INT_MAX
from coordinator.services.closing import RoundCloser
from coordinator.services.dispatch import LeaseDispatcher
from coordinator.services.uploads import UploadDesk
from coordinator.settings import Settings
from coordinator.wakeups import WorkSignal


@dataclass(slots=True, kw_only=True)
class AppState:
    """What the lifespan builds once per process (`coordinator.app.build_state`) and requests share."""

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
    wakeups: WorkSignal
    """Wakes lease requests that wait for work (see coordinator/wakeups.py)."""
    offers: OfferBook
    """Offers made by this process's applies, ready to hand out (see coordinator/offer_book.py)."""
    closer: RoundCloser
    """Applies ready rounds (services/closing.py)."""
    dispatcher: LeaseDispatcher
    """Answers lease requests and runs the background sweep (services/dispatch.py)."""
    uploads: UploadDesk
    """Accepts outer-gradient uploads (services/uploads.py)."""
    heartbeats: GroupCommit[int, list[int]]
    """Heartbeats that arrive together, recorded in one transaction: island id -> its leases extended."""


async def get_state(request: Request) -> AppState:
    """On the event loop (a plain `def` dependency would take a worker-thread round trip on every request)."""
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
    with reading(), state.sessions() as session:
        principal = authenticate(session, state.tokens, authorization, state.island_tokens)
        session.rollback()
        return principal


async def principal_for(state: AppState, authorization: str | None) -> Principal:
    """Service tokens and recently seen island tokens on the event loop; others looked up on a worker thread."""
    known = known_principal(token_digest(authorization), state.tokens, state.island_tokens)
    if known is not None:
        return known
    return await run_in_threadpool(authenticate_with, state, authorization)


async def get_principal(
    request: Request, state: StateDep, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    """The principal `api.guard.RequestGuard` found before the body was read (every `/v1/` request)."""
    found = getattr(request.state, "principal", None)
    if isinstance(found, Principal):
        return found
    return await principal_for(state, authorization)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


# Request numbers that reach SQL are bounded by what the database stores (422 above, not an overflow inside it).
Id = Annotated[int, PathParam(ge=0, le=DB_INT_MAX, description="Registry id")]
"""A path parameter naming a row (`run_id`, `module_id`, ...)."""
IdFilter = Annotated[int | None, Query(ge=0, le=DB_INT_MAX)]
"""An optional query filter by id or number (`run_id`, `round`, `version`, `level`)."""
Offset = Annotated[int, Query(ge=0, le=DB_INT_MAX, description="Rows to skip")]
Limit = Annotated[int, Query(ge=1, le=1000, description="Rows to return (at most 1000)")]


class SessionRoute(APIRoute):
    """Routes whose sync endpoint takes the request `session` close it in the endpoint's own worker thread.

    FastAPI validates a sync endpoint's return value on another worker thread and tears dependencies down after
    that; a session left with an open read transaction would hold its connection through both waits. With as
    many connections as threads, requests holding connections while queueing for threads, and threads queueing
    for connections, stall until the pool times out (tests/coordinator/test_concurrency.py). Endpoints return
    pydantic models built inside them, so nothing needs the session afterwards.

    GET endpoints only read: their transactions are readers (`db.reading`; on SQLite they no longer take the
    write lock, so a registry poll or a weights download never holds up an upload or a module step's commit).
    """

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if not inspect.iscoroutinefunction(endpoint) and "session" in inspect.signature(endpoint).parameters:
            endpoint = _closing_session(endpoint, read_only=set(kwargs.get("methods") or ()) <= {"GET", "HEAD"})
        super().__init__(path, endpoint, **kwargs)


def _closing_session(endpoint: Callable[..., Any], *, read_only: bool) -> Callable[..., Any]:
    @functools.wraps(endpoint)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            if read_only:
                with reading():
                    return endpoint(*args, **kwargs)
            return endpoint(*args, **kwargs)
        finally:
            kwargs["session"].close()

    return run
