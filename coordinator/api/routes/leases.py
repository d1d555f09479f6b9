"""Uploading outer gradients (streamed safetensors body) and releasing leases."""

from __future__ import annotations

import math

from fastapi import APIRouter, Header, Request
from fastapi.concurrency import run_in_threadpool

from coordinator.api.deps import AppState, PrincipalDep, SessionDep, SessionRoute, StateDep, principal_for
from coordinator.api.spool import spool_body
from coordinator.auth import require
from coordinator.errors import Invalid, ServiceError
from coordinator.schemas import ContributionPublic, LeaseStatus
from coordinator.services import leases, uploads

router = APIRouter(prefix="/v1", tags=["leases"], route_class=SessionRoute)


def _parse_float(name: str, value: str | None) -> float:
    if value is None:
        raise Invalid(f"header {name} is required")
    try:
        parsed = float(value)
    except ValueError as exc:
        raise Invalid(f"header {name} must be a number, got {value!r}") from exc
    if not math.isfinite(parsed):
        raise Invalid(f"header {name} must be finite, got {value!r}")
    return parsed


def _parse_int(name: str, value: str | None, *, required: bool) -> int | None:
    if value is None:
        if required:
            raise Invalid(f"header {name} is required")
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise Invalid(f"header {name} must be an integer, got {value!r}") from exc


@router.post("/leases/{lease_id}/outer-gradients", response_model=ContributionPublic)
async def upload_outer_gradients(
    lease_id: int,
    request: Request,
    state: StateDep,
    x_dipaco_round: str | None = Header(None),
    x_dipaco_tokens: str | None = Header(None),
    x_dipaco_train_loss: str | None = Header(None),
) -> ContributionPublic:
    """Body: safetensors, one F32 tensor per parameter of the path, named `<level>/<param>` (streamed)."""
    try:
        return await _upload(lease_id, request, state, x_dipaco_round, x_dipaco_tokens, x_dipaco_train_loss)
    except ServiceError as exc:
        state.metrics.contributions.labels(result=type(exc).__name__.lower()).inc()
        raise


async def _upload(
    lease_id: int,
    request: Request,
    state: AppState,
    round_text: str | None,
    tokens_text: str | None,
    loss_text: str | None,
) -> ContributionPublic:
    principal = await principal_for(state, request.headers.get("authorization"))
    require(principal, "island")
    island_id = principal.island_id
    assert island_id is not None
    round_header = _parse_int("X-Dipaco-Round", round_text, required=False)
    tokens = _parse_int("X-Dipaco-Tokens", tokens_text, required=True)
    assert tokens is not None
    loss = _parse_float("X-Dipaco-Train-Loss", loss_text)
    body = await spool_body(request, limit=state.settings.max_upload_bytes, spool_dir=state.spool_dir)
    state.metrics.bytes_in.inc(body.size)

    def _submit() -> ContributionPublic:
        now = state.clock()
        with state.sessions() as session:
            submitted = uploads.submit_outer_gradients(
                session,
                state.blobs,
                lease_id=lease_id,
                island_id=island_id,
                round_header=round_header,
                tokens=tokens,
                train_loss=loss,
                body=body.path,
                body_sha256=body.sha256,
                now=now,
                faults=state.faults,
            )
            contribution, created = submitted.contribution, submitted.created
            state.metrics.contributions.labels(result="accepted" if created else "duplicate").inc()
            public = ContributionPublic(
                id=contribution.id,
                lease_id=lease_id,
                run_id=contribution.run_id,
                round=contribution.round,
                path_index=submitted.path_index,
                tokens=contribution.tokens,
                train_loss=contribution.train_loss,
                status="accepted",
                round_applied=False,
            )
            if created and state.apply_rounds(session, [contribution.run_id], now=now):
                public.round_applied = True
            return public

    try:
        return await run_in_threadpool(_submit)
    finally:
        body.path.unlink(missing_ok=True)  # accepted uploads were moved into the blob store already


@router.post("/leases/{lease_id}/release", response_model=LeaseStatus)
def release(lease_id: int, session: SessionDep, state: StateDep, principal: PrincipalDep) -> LeaseStatus:
    """Give a lease back at once (e.g. on Ctrl-C) so its path goes back to the pool without waiting the TTL."""
    require(principal, "island")
    assert principal.island_id is not None
    lease = leases.release_lease(session, lease_id, principal.island_id)
    state.work.notify()  # its path is free again
    return LeaseStatus(lease_id=lease.id, status=lease.status)  # type: ignore[arg-type]
