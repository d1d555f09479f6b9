"""Uploading outer gradients (streamed safetensors body) and releasing leases."""

from __future__ import annotations

import functools
import logging
import math
import re

from fastapi import APIRouter, Header, Query, Request
from fastapi.concurrency import run_in_threadpool

from coordinator.api.answers import V1_ERRORS, errors
from coordinator.api.deps import AppState, Id, PrincipalDep, SessionDep, SessionRoute, StateDep
from coordinator.api.routes.islands import MAX_LEASE_WAIT_S
from coordinator.api.spool import spool_body
from coordinator.auth import require
from coordinator.errors import Invalid, ServiceError
from coordinator.schemas import (
    DB_INT_MAX,
    H_CONTENT_HASH,
    H_HELDOUT_LOSS,
    H_REBASED_AT,
    H_ROUND,
    H_TOKENS,
    H_TRAIN_LOSS,
    ContributionPublic,
    LeaseModules,
    LeaseReleased,
    UploadCommit,
    UploadTicket,
    UploadTicketRequest,
)
from coordinator.services import leases
from coordinator.services.uploads import Accepted, Upload

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["leases"], route_class=SessionRoute, responses=V1_ERRORS)

NextLease = Query(
    False,
    description="Issue the island's next lease with the reply (`next_lease`) when one is ready at once: no request "
    "of its own, and no gap between this upload and the next lease",
)


Overlap = Query(
    False,
    description="With next_lease, in a run with `overlap`: while module steps are due on this upload's path, the next "
    "lease may be on that path against the versions those steps will make (modules without weights: train on from "
    "your own end weights, fetch them from GET /v1/leases/{id}/modules)",
)


async def _answer(state: AppState, island_id: int, accepted: Accepted, *, next_lease: bool) -> ContributionPublic:
    """The upload's reply, with the island's next lease when it asked for one and one is ready at once (with
    `overlap`, in a run with `overlap`, also one that trains through module steps due on the uploaded path: that
    one was granted in the upload's transaction, `Accepted.next_lease`). The upload is committed by now: a
    failure to find the lease only leaves it out (the island then asks as usual)."""
    answer = accepted.answer
    if accepted.next_lease is not None:
        answer.next_lease = state.dispatcher.with_urls(accepted.next_lease)
        return answer
    if not next_lease or not accepted.lease_ready:
        return answer
    try:
        found = await state.dispatcher.next_lease(island_id, wait_s=0)
    except ServiceError:  # e.g. 409: the island holds as many leases as it may; its own request says so
        return answer
    except Exception:  # noqa: BLE001 - the upload stands; the island's own lease request will meet the error
        log.warning("no next lease with the upload of lease %d", answer.lease_id, exc_info=True)
        return answer
    answer.next_lease = found.lease
    return answer


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
        parsed = int(value)
    except ValueError as exc:
        raise Invalid(f"header {name} must be an integer, got {value!r}") from exc
    if not 0 <= parsed <= DB_INT_MAX:
        raise Invalid(f"header {name} must be in [0, {DB_INT_MAX}], got {value!r}")
    return parsed


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _parse_sha256(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    if not _SHA256.fullmatch(value):
        raise Invalid(f"header {name} must be a lowercase hex sha256 (64 characters), got {value[:80]!r}")
    return value


@router.post("/leases/{lease_id}/outer-gradients", response_model=ContributionPublic, responses=errors(403, 404, 409))
async def upload_outer_gradients(
    lease_id: Id,
    request: Request,
    state: StateDep,
    principal: PrincipalDep,
    x_dipaco_round: str | None = Header(None),
    x_dipaco_tokens: str | None = Header(None),
    x_dipaco_train_loss: str | None = Header(None),
    x_dipaco_heldout_loss: str | None = Header(None),
    x_dipaco_rebased_at: str | None = Header(None),
    x_dipaco_content_sha256: str | None = Header(None),
    next_lease: bool = NextLease,
    overlap: bool = Overlap,
) -> ContributionPublic:
    """Body: safetensors in the run's codec, the path's outer gradient named `<level>/<param>` (streamed).

    The coordinator hashes the body while it streams in, except a large one (`upload_stream_check_bytes`) that
    names its sha256 in `X-Dipaco-Content-Sha256`, as the island client does: its header and values are checked
    now, its hash by the apply executor before any math, and an upload that does not hash to what it named is
    refused there (services/staging.py). A smaller body that names one is refused at once when it differs."""
    with state.metrics.counting_refused_uploads():
        require(principal, "island")
        assert principal.island_id is not None  # island scope
        round_header = _parse_int(H_ROUND, x_dipaco_round, required=False)
        tokens = _parse_int(H_TOKENS, x_dipaco_tokens, required=True)
        assert tokens is not None  # required
        loss = _parse_float(H_TRAIN_LOSS, x_dipaco_train_loss)
        heldout = None if x_dipaco_heldout_loss is None else _parse_float(H_HELDOUT_LOSS, x_dipaco_heldout_loss)
        rebased_at = _parse_int(H_REBASED_AT, x_dipaco_rebased_at, required=False)
        claimed = _parse_sha256(H_CONTENT_HASH, x_dipaco_content_sha256)
        declared = request.headers.get("content-length", "")
        # a large body's values are checked as it arrives, so that its file is not read back, and the hash it
        # names is checked by the executor; a small one's file is read back (cheap, and it spares the request a
        # database read before the body) and it is hashed now (cheap too, and it spares the executor that first
        # steps with it the verification: async steps are on the islands' critical path)
        large = declared.isdigit() and int(declared) >= state.settings.upload_stream_check_bytes
        stream = None
        if large:
            stream = await run_in_threadpool(state.uploads.payload_stream, lease_id, principal.island_id)
        body = await spool_body(
            request,
            limit=state.settings.max_upload_bytes,
            spool_dir=state.spool_dir,
            digest=claimed is None or not large,
            check=None if stream is None else stream.update,
            direct=state.settings.spool_direct,
            defer_sync=True,
        )
        try:
            state.metrics.bytes_in.labels(kind="outer_gradient").inc(body.size)
            digest = body.sha256 if body.sha256 is not None else claimed
            assert digest is not None  # spooled with digest=True when none was named
            upload = Upload(
                lease_id=lease_id,
                island_id=principal.island_id,
                round=round_header,
                tokens=tokens,
                train_loss=loss,
                heldout_loss=heldout,
                rebased_at=rebased_at,
                body=body.path,
                body_sha256=digest,
                size=body.size,
                hashed=body.sha256 is not None,
                claimed_sha256=claimed,
                stream=stream,
                through=next_lease and overlap,
            )

            def accept() -> Accepted:
                body.sync()  # durable before `accept` takes its locks, on the thread that runs it (one hop, not two)
                return state.uploads.accept(upload)

            accepted = await run_in_threadpool(accept)
        finally:
            body.close()  # after the thread: a cancelled request still waits for it (anyio does not abandon it)
            body.path.unlink(missing_ok=True)  # accepted uploads were moved into the blob store already
    return await _answer(state, principal.island_id, accepted, next_lease=next_lease)


@router.post("/leases/{lease_id}/release", response_model=LeaseReleased, responses=errors(403, 404, 409))
def release(lease_id: Id, session: SessionDep, state: StateDep, principal: PrincipalDep) -> LeaseReleased:
    """Give a lease back at once (e.g. on Ctrl-C) so its path goes back to the pool without waiting the TTL."""
    require(principal, "island")
    assert principal.island_id is not None  # island scope
    lease = leases.release_lease(session, lease_id, principal.island_id, wakeups=state.wakeups)
    return LeaseReleased(lease_id=lease.id, status=lease.status)


@router.post("/leases/{lease_id}/upload-url", response_model=UploadTicket, responses=errors(400, 403, 404, 409))
async def upload_url(
    lease_id: Id, request: UploadTicketRequest, state: StateDep, principal: PrincipalDep
) -> UploadTicket:
    """Direct transfers (an s3:// blob store): a pre-signed URL to PUT the lease's outer gradient to, for its size
    and sha256; then `POST .../commit`. 409 when the store is a local directory (upload to /outer-gradients)."""
    require(principal, "island")
    assert principal.island_id is not None  # island scope
    with state.metrics.counting_refused_uploads():
        return await run_in_threadpool(state.uploads.ticket, lease_id, principal.island_id, request)


@router.post("/leases/{lease_id}/commit", response_model=ContributionPublic, responses=errors(400, 403, 404, 409))
async def commit_upload(
    lease_id: Id,
    commit: UploadCommit,
    state: StateDep,
    principal: PrincipalDep,
    next_lease: bool = NextLease,
    overlap: bool = Overlap,
) -> ContributionPublic:
    """Direct transfers: the body is in the bucket at the ticket's key; record it with the same checks and answers
    as `POST .../outer-gradients` (its header is read from the bucket; its values are verified by the apply
    executor before any math, and a part that fails is refused there, with a note on the contribution)."""
    require(principal, "island")
    assert principal.island_id is not None  # island scope
    with state.metrics.counting_refused_uploads():
        accepted = await run_in_threadpool(
            functools.partial(state.uploads.commit, through=next_lease and overlap),
            lease_id,
            principal.island_id,
            commit,
        )
    return await _answer(state, principal.island_id, accepted, next_lease=next_lease)


@router.get("/leases/{lease_id}/modules", response_model=LeaseModules, responses=errors(403, 404, 409))
async def lease_modules(
    lease_id: Id,
    state: StateDep,
    principal: PrincipalDep,
    wait: float = Query(
        0,
        ge=0,
        le=MAX_LEASE_WAIT_S,
        description="Seconds to hold the request while a module's version is not stepped yet; 0 answers at once",
    ),
) -> LeaseModules:
    """The modules of the island's pending lease at its base versions: `ready` with every one's weights hash once
    all are stepped (an overlap lease's versions land with the module steps it trains through)."""
    require(principal, "island")
    assert principal.island_id is not None  # island scope
    return await state.dispatcher.lease_modules(lease_id, principal.island_id, wait_s=wait)
