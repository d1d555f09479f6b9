"""Registry reads for modules and paths, and module weight downloads."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request, Response

from coordinator.api.deps import PrincipalDep, SessionDep, SessionRoute, StateDep
from coordinator.schemas import H_CONTENT_HASH, ListOf, ModulePublic, PathPublic
from coordinator.services import registry

router = APIRouter(prefix="/v1", tags=["registry"], route_class=SessionRoute)


@router.get("/modules", response_model=ListOf[ModulePublic])
def list_modules(
    session: SessionDep,
    _: PrincipalDep,
    run_id: int | None = None,
    level: int | None = None,
    offset: int = Query(0, ge=0),
    limit: int = Query(100, ge=1, le=1000),
) -> ListOf[ModulePublic]:
    data, count = registry.list_modules(session, run_id=run_id, level=level, offset=offset, limit=limit)
    return ListOf[ModulePublic](data=data, count=count)


@router.get("/modules/{module_id}", response_model=ModulePublic)
def get_module(module_id: int, session: SessionDep, _: PrincipalDep) -> ModulePublic:
    return registry.module_public(registry.get_module(session, module_id))


@router.get("/modules/{module_id}/weights", responses={200: {"content": {"application/octet-stream": {}}}})
def module_weights(
    module_id: int,
    request: Request,
    session: SessionDep,
    state: StateDep,
    _: PrincipalDep,
    version: int | None = Query(None, ge=0),
) -> Response:
    """The module's weights as safetensors; `ETag` is the content hash; `?version=` for history."""
    digest = registry.module_weights_hash(session, module_id, version=version)
    etag = f'"{digest}"'
    if request.headers.get("if-none-match") == etag:
        return Response(status_code=304, headers={"ETag": etag})
    data = state.blobs.get_bytes(digest)
    state.metrics.bytes_out.inc(len(data))
    return Response(content=data, media_type="application/octet-stream", headers={"ETag": etag, H_CONTENT_HASH: digest})


@router.get("/paths", response_model=ListOf[PathPublic])
def list_paths(
    session: SessionDep,
    _: PrincipalDep,
    run_id: int | None = None,
    offset: int = Query(0, ge=0),
    limit: int = Query(100, ge=1, le=1000),
) -> ListOf[PathPublic]:
    data, count = registry.list_paths(session, run_id=run_id, offset=offset, limit=limit)
    return ListOf[PathPublic](data=data, count=count)


@router.get("/paths/{path_id}", response_model=PathPublic)
def get_path(path_id: int, session: SessionDep, _: PrincipalDep) -> PathPublic:
    return registry.get_path(session, path_id)
