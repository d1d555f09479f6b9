"""Registry reads for modules and paths, and module weight downloads."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from coordinator.api.answers import V1_ERRORS, errors
from coordinator.api.deps import Id, IdFilter, Limit, Offset, PrincipalDep, SessionDep, SessionRoute, StateDep
from coordinator.metrics import counted
from coordinator.schemas import H_CONTENT_HASH, ListOf, ModulePublic, PathPublic
from coordinator.services import registry

router = APIRouter(prefix="/v1", tags=["registry"], route_class=SessionRoute, responses=V1_ERRORS)


@router.get("/modules", response_model=ListOf[ModulePublic])
def list_modules(
    session: SessionDep,
    _: PrincipalDep,
    run_id: IdFilter = None,
    level: IdFilter = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[ModulePublic]:
    data, count = registry.list_modules(session, run_id=run_id, level=level, offset=offset, limit=limit)
    return ListOf[ModulePublic](data=data, count=count)


@router.get("/modules/{module_id}", response_model=ModulePublic, responses=errors(404))
def get_module(module_id: Id, session: SessionDep, _: PrincipalDep) -> ModulePublic:
    return registry.module_public(registry.get_module(session, module_id))


@router.get(
    "/modules/{module_id}/weights",
    responses={
        200: {"content": {"application/octet-stream": {}}},
        304: {"description": "Not modified (If-None-Match)"},
        **errors(403, 404),
    },
)
def module_weights(
    module_id: Id,
    request: Request,
    session: SessionDep,
    state: StateDep,
    principal: PrincipalDep,
    version: IdFilter = None,
) -> Response:
    """The module's weights as safetensors, streamed; `ETag` is the content hash; `?version=` for history. For the
    admin and the islands of the module's run."""
    digest = registry.module_weights_hash(session, module_id, version=version, reader=principal)
    etag = f'"{digest}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    session.rollback()  # the read is done: no database connection held while the weights stream
    return StreamingResponse(
        counted(state.blobs.iter_verified(digest), state.metrics.bytes_out.labels(kind="weights")),
        media_type="application/octet-stream",
        headers={"ETag": etag, H_CONTENT_HASH: digest},
    )


@router.get("/paths", response_model=ListOf[PathPublic])
def list_paths(
    session: SessionDep,
    _: PrincipalDep,
    run_id: IdFilter = None,
    offset: Offset = 0,
    limit: Limit = 100,
) -> ListOf[PathPublic]:
    data, count = registry.list_paths(session, run_id=run_id, offset=offset, limit=limit)
    return ListOf[PathPublic](data=data, count=count)


@router.get("/paths/{path_id}", response_model=PathPublic, responses=errors(404))
def get_path(path_id: Id, session: SessionDep, _: PrincipalDep) -> PathPublic:
    return registry.get_path(session, path_id)
