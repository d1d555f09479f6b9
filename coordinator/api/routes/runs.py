from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from coordinator.api.deps import PrincipalDep, SessionDep, SessionRoute, StateDep, principal_for
from coordinator.api.spool import spool_body
from coordinator.auth import require
from coordinator.schemas import (
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

router = APIRouter(prefix="/v1", tags=["runs"], route_class=SessionRoute)


@router.get("/runs", response_model=ListOf[RunPublic])
def list_runs(
    session: SessionDep,
    _: PrincipalDep,
    status: RunStatus | None = None,
    offset: int = Query(0, ge=0),
    limit: int = Query(100, ge=1, le=1000),
) -> ListOf[RunPublic]:
    data, count = registry.list_runs(session, status=status, offset=offset, limit=limit)
    return ListOf[RunPublic](data=data, count=count)


@router.post("/runs", response_model=RunPublic, status_code=201)
def create_run(spec: RunCreate, session: SessionDep, state: StateDep, principal: PrincipalDep) -> RunPublic:
    require(principal, "admin")
    return registry.run_public(runs.create_run(session, state.blobs, spec))


@router.get("/runs/{run_id}", response_model=RunPublic)
def get_run(run_id: int, session: SessionDep, _: PrincipalDep) -> RunPublic:
    return registry.run_public(runs.get_run(session, run_id))


@router.get("/runs/{run_id}/rounds", response_model=ListOf[RoundPublic])
def list_rounds(run_id: int, session: SessionDep, _: PrincipalDep) -> ListOf[RoundPublic]:
    data = registry.list_rounds(session, run_id)
    return ListOf[RoundPublic](data=data, count=len(data))


@router.get("/contributions", response_model=ListOf[ContributionSummary])
def list_contributions(
    session: SessionDep,
    _: PrincipalDep,
    run_id: int | None = None,
    round: int | None = Query(None, ge=0),
    offset: int = Query(0, ge=0),
    limit: int = Query(100, ge=1, le=1000),
) -> ListOf[ContributionSummary]:
    """Accepted outer-gradient uploads: per path and round, with tokens and train loss."""
    data, count = registry.list_contributions(session, run_id=run_id, round_=round, offset=offset, limit=limit)
    return ListOf[ContributionSummary](data=data, count=count)


@router.post("/runs/{run_id}/shards/{path_index}", response_model=ShardPublic, status_code=201)
async def register_shard(
    run_id: int,
    path_index: int,
    request: Request,
    state: StateDep,
    num_documents: int = Query(ge=1),
) -> ShardPublic:
    """Body: the path's shard as raw little-endian uint16 token ids (streamed)."""
    principal = await principal_for(state, request.headers.get("authorization"))
    require(principal, "admin")
    spooled = await spool_body(request, limit=state.settings.max_shard_bytes, spool_dir=state.spool_dir)
    body = spooled.path
    state.metrics.bytes_in.inc(spooled.size)

    def _register() -> ShardPublic:
        with state.sessions() as session:
            shard = shards.register_shard(
                session,
                state.blobs,
                run_id=run_id,
                path_index=path_index,
                body=body,
                num_documents=num_documents,
                now=state.clock(),
                wakeups=state.wakeups,
            )
            return ShardPublic(
                id=shard.id,
                run_id=shard.run_id,
                path_index=shard.path_index,
                tokens_hash=shard.tokens_hash,
                num_tokens=shard.num_tokens,
                num_documents=shard.num_documents,
            )

    try:
        return await run_in_threadpool(_register)
    finally:
        body.unlink(missing_ok=True)


@router.get("/shards/{shard_id}/tokens", responses={200: {"content": {"application/octet-stream": {}}}})
def shard_tokens(shard_id: int, request: Request, session: SessionDep, state: StateDep, _: PrincipalDep) -> Response:
    shard = shards.get_shard(session, shard_id)
    etag = f'"{shard.tokens_hash}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    state.metrics.bytes_out.inc(shard.num_tokens * 2)
    session.rollback()  # the read is done: no database connection held while the shard streams
    return StreamingResponse(
        state.blobs.iter_verified(shard.tokens_hash),
        media_type="application/octet-stream",
        headers={
            "ETag": etag,
            H_CONTENT_HASH: shard.tokens_hash,
            "Content-Length": str(shard.num_tokens * 2),
        },
    )
