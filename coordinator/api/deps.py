"""Request dependencies, declared once as `Annotated` aliases."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from coordinator.auth import Principal, ServiceTokens, authenticate
from coordinator.blobstore import BlobStore
from coordinator.errors import PayloadTooLarge
from coordinator.faults import FaultInjector
from coordinator.metrics import Metrics
from coordinator.settings import Settings


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


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.dipaco
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with state.sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


def authenticate_with(state: AppState, authorization: str | None) -> Principal:
    with state.sessions() as session:
        principal = authenticate(session, state.tokens, authorization)
        session.rollback()
        return principal


def get_principal(state: StateDep, authorization: Annotated[str | None, Header()] = None) -> Principal:
    return authenticate_with(state, authorization)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


@dataclass(frozen=True, slots=True)
class Spooled:
    """A request body on local disk, with its sha256 computed while it streamed in."""

    path: Path
    sha256: str
    size: int


async def spool_body(request: Request, *, limit: int, spool_dir: Path) -> Spooled:
    """Stream the request body to a temporary file, refusing more than `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {int(declared)} bytes is over the {limit}-byte limit")
    fd, name = tempfile.mkstemp(dir=spool_dir, suffix=".upload")
    size = 0
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body is over the {limit}-byte limit")
                digest.update(chunk)
                out.write(chunk)
    except BaseException:
        os.unlink(name)
        raise
    return Spooled(path=Path(name), sha256=digest.hexdigest(), size=size)
