from __future__ import annotations

from collections.abc import Callable
from pathlib import Path as FilePath
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session

from coordinator.api.answers import V1_ERRORS, errors
from coordinator.api.deps import AppState, Id, IdFilter, Limit, Offset, PrincipalDep, SessionDep, SessionRoute, StateDep
from coordinator.api.spool import spool_body
from coordinator.auth import require
from coordinator.models import Shard
from coordinator.schemas import (
    DB_INT_MAX,
    H_CONTENT_HASH,
    ContributionSummary,
    ListOf,
    RoundPublic,
    RunCreate,
    RunPublic,
    ShardPublic,
)
from coordinator.services import registry, runs, shards
from coordinator.states import RunStatus

router = APIRouter(prefix="/v1", tags=["runs"], route_class=SessionRoute, responses=V1_ERRORS)


@router.get("/runs", response_model=ListOf[RunPublic])
def list_runs(
    session: SessionDep,
    _: PrincipalDep,
    status: RunStatus | None = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[RunPublic]:
    data, count = registry.list_runs(session, status=status, offset=offset, limit=limit)
    return ListOf[RunPublic](data=data, count=count)


@router.post("/runs", response_model=RunPublic, status_code=201, responses=errors(400, 403, 409))
def create_run(spec: RunCreate, session: SessionDep, state: StateDep, principal: PrincipalDep) -> RunPublic:
    require(principal, "admin")
    return registry.run_public(
        runs.create_run(session, state.blobs, spec, max_path_params=state.settings.max_path_params)
    )


@router.get("/runs/{run_id}", response_model=RunPublic, responses=errors(404))
def get_run(run_id: Id, session: SessionDep, _: PrincipalDep) -> RunPublic:
    return registry.run_public(runs.get_run(session, run_id))


@router.get("/runs/{run_id}/rounds", response_model=ListOf[RoundPublic], responses=errors(404))
def list_rounds(run_id: Id, session: SessionDep, _: PrincipalDep) -> ListOf[RoundPublic]:
    data = registry.list_rounds(session, run_id)
    return ListOf[RoundPublic](data=data, count=len(data))


@router.get("/contributions", response_model=ListOf[ContributionSummary])
def list_contributions(
    session: SessionDep,
    _: PrincipalDep,
    run_id: IdFilter = None,
    round: IdFilter = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[ContributionSummary]:
    """Accepted outer-gradient uploads: per path and round, with tokens and train loss."""
    data, count = registry.list_contributions(session, run_id=run_id, round_=round, offset=offset, limit=limit)
    return ListOf[ContributionSummary](data=data, count=count)


async def _register_tokens(
    request: Request, state: AppState, register: Callable[[Session, FilePath], Shard]
) -> ShardPublic:
    """Spool a raw uint16 token body, then `register` it (on a worker thread, in a session of its own)."""
    # not hashed while spooling: registering copies it into the blob store, which hashes it then
    spooled = await spool_body(request, limit=state.settings.max_shard_bytes, spool_dir=state.spool_dir, digest=False)
    state.metrics.bytes_in.labels(kind="shard").inc(spooled.size)

    def _register() -> ShardPublic:
        with state.sessions() as session:
            return _shard_public(register(session, spooled.path))

    try:
        return await run_in_threadpool(_register)
    finally:
        spooled.path.unlink(missing_ok=True)


def _stream_tokens(request: Request, session: Session, state: AppState, tokens_hash: str, num_tokens: int) -> Response:
    """A uint16 token blob streamed with its sha256 as ETag (304 on If-None-Match); the session is released first."""
    etag = f'"{tokens_hash}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    state.metrics.bytes_out.labels(kind="shard").inc(num_tokens * 2)
    session.rollback()  # the read is done: no database connection held while the tokens stream
    return StreamingResponse(
        state.blobs.iter_verified(tokens_hash),
        media_type="application/octet-stream",
        headers={"ETag": etag, H_CONTENT_HASH: tokens_hash, "Content-Length": str(num_tokens * 2)},
    )


def _shard_public(shard: Shard) -> ShardPublic:
    return ShardPublic(
        id=shard.id,
        run_id=shard.run_id,
        path_index=shard.path_index,
        tokens_hash=shard.tokens_hash,
        num_tokens=shard.num_tokens,
        num_documents=shard.num_documents,
        heldout_hash=shard.heldout_hash,
        heldout_tokens=shard.heldout_tokens,
        heldout_documents=shard.heldout_documents,
    )


TOKEN_STREAM: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}},
    304: {"description": "Not modified (If-None-Match)"},
    **errors(403, 404),
}
"""The answers of a token-file download."""


@router.post(
    "/runs/{run_id}/shards/{path_index}",
    response_model=ShardPublic,
    status_code=201,
    responses=errors(403, 404, 409),
)
async def register_shard(
    run_id: Id,
    path_index: Id,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
    num_documents: int = Query(ge=1, le=DB_INT_MAX),
) -> ShardPublic:
    """Body: the path's shard as raw little-endian uint16 token ids (streamed)."""
    require(principal, "admin")

    def register(session: Session, body: FilePath) -> Shard:
        return shards.register_shard(
            session,
            state.blobs,
            run_id=run_id,
            path_index=path_index,
            body=body,
            num_documents=num_documents,
            now=state.clock(),
            wakeups=state.wakeups,
        )

    return await _register_tokens(request, state, register)


@router.post(
    "/runs/{run_id}/shards/{path_index}/heldout",
    response_model=ShardPublic,
    status_code=201,
    responses=errors(403, 404, 409),
)
async def register_heldout(
    run_id: Id,
    path_index: Id,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
    num_documents: int = Query(ge=1, le=DB_INT_MAX),
) -> ShardPublic:
    """Body: the path's held-out slice as raw little-endian uint16 token ids (streamed), after its shard. Leases of
    the path carry it from then on, and their islands report their start weights' loss on it (the run's
    `heldout_tokens` of it) with each upload."""
    require(principal, "admin")

    def register(session: Session, body: FilePath) -> Shard:
        return shards.register_heldout(
            session, state.blobs, run_id=run_id, path_index=path_index, body=body, num_documents=num_documents
        )

    return await _register_tokens(request, state, register)


@router.get("/shards/{shard_id}/tokens", responses=TOKEN_STREAM)
def shard_tokens(
    shard_id: Id, request: Request, session: SessionDep, state: StateDep, principal: PrincipalDep
) -> Response:
    """A path's shard (raw little-endian uint16 tokens), streamed; for the admin and the islands of its run."""
    shard = shards.get_shard(session, shard_id, reader=principal)
    return _stream_tokens(request, session, state, shard.tokens_hash, shard.num_tokens)


@router.get("/shards/{shard_id}/heldout", responses=TOKEN_STREAM)
def heldout_tokens(
    shard_id: Id, request: Request, session: SessionDep, state: StateDep, principal: PrincipalDep
) -> Response:
    """A path's held-out slice (raw little-endian uint16 tokens), streamed; for the admin and the islands of its
    run."""
    tokens_hash, num_tokens = shards.get_heldout(session, shard_id, reader=principal)
    return _stream_tokens(request, session, state, tokens_hash, num_tokens)
