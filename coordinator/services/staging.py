"""Verifying staged uploads before any math. Two kinds of upload are recorded before their bytes are hashed:
an outer gradient an island PUT into the bucket's staging area (`uploads._staged_payload`, recorded on the
strength of its header), and a large one sent through the coordinator with the sha256 it claims
(`X-Dipaco-Content-Sha256`, at least `Settings.upload_stream_check_bytes`), whose values were checked on the
request but whose hash was not (hashing was the largest cost of accepting an upload: docs/LOG.md). The apply
executor that first needs such an upload hashes it, checks that it hashes to the sha256 its island named, checks
its values (finite; each module's norm measured, the same code as an upload through the coordinator:
`payloads.validated_payload`), and gives it its content-addressed name. An upload that fails is refused part by
part (scale 0, with the reason on the contribution), so nothing it carries reaches a module; it is removed from
the staging area either way. So is an upload that is no longer there (deleted from the bucket, or never written),
one whose size is not the size recorded at its commit (PUT again after it: refused before it is downloaded, see
`BlobStore.open_staged`), and one that still cannot be read at its step's `STAGED_READ_ATTEMPTS`th claim: a
round never waits forever for an object it cannot have.

Executors of different modules may verify the same upload at once: each does the work, the first commit wins
(`staged_key` is cleared only where it is still set), and promoting is idempotent.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from coordinator.blobstore import BlobError, BlobMissing, BlobStore, S3BlobStore, StagedChanged
from coordinator.db import reading
from coordinator.errors import Invalid
from coordinator.models import Contribution, ContributionGrad, Lease, Level, Module, Run
from coordinator.services.payloads import validated_payload
from coordinator.services.runs import run_layout, run_model_config
from coordinator.states import PENDING_LEASES
from coordinator.timeutil import as_utc

log = logging.getLogger(__name__)

REFUSED = "refused at verification: "
"""Start of the note of a part whose direct upload failed verification (its scale is 0 and stays 0)."""
NOTE_CHARS: int = getattr(ContributionGrad.__table__.c.note.type, "length", None) or 300
"""Longest note a part can keep (`contribution_grads.note`)."""
STAGED_READ_ATTEMPTS = 3
"""A staged upload that cannot be read (an error other than "not there") fails its step's claim, which another
claim retries after `claim_s`; the claim that is the step's this-many-th refuses it instead."""


def refusal_note(reason: str) -> str:
    """A part's note for a refusal at verification, cut to what the column holds (the reason names keys and
    store errors of any length)."""
    note = REFUSED + reason
    return note if len(note) <= NOTE_CHARS else note[: NOTE_CHARS - 3] + "..."


def verify_staged(
    session: Session, blobs: BlobStore, *, run_id: int, round_: int, module_id: int, give_up: bool = False
) -> int:
    """Verify every direct upload that has a part for `module_id` in its step `round_` (a round, or an async
    module's period) and is still staged; returns how many this call verified or refused. An upload that cannot
    be read raises BlobError (the step is retried), unless `give_up`: then it is refused. Leaves no transaction
    open."""
    with reading():
        staged = session.execute(
            select(Contribution.id, Contribution.staged_key, ContributionGrad.blob_hash)
            .join(ContributionGrad, ContributionGrad.contribution_id == Contribution.id)
            .where(
                ContributionGrad.module_id == module_id,
                Contribution.run_id == run_id,
                ContributionGrad.step == round_,
                Contribution.staged_key.is_not(None),
            )
        ).all()
        session.rollback()
    done = 0
    for contribution_id, key, digest in staged:
        assert key is not None  # selected so
        done += _verify_one(session, blobs, contribution_id, key, digest, give_up=give_up)
    return done


def _verify_one(
    session: Session, blobs: BlobStore, contribution_id: int, key: str, digest: str, *, give_up: bool
) -> int:
    contribution = session.get_one(Contribution, contribution_id)
    size = contribution.upload_bytes
    run = session.get_one(Run, contribution.run_id)
    cfg, layout, codec = run_model_config(run), run_layout(run), run.config.get("codec", "fp32")
    sparse_rows = run.config.get("sparse_rows", False)
    levels = {
        level_index: (module_id, name)
        for module_id, level_index, name in session.execute(
            select(ContributionGrad.module_id, Module.level_index, Level.name)
            .join(Module, Module.id == ContributionGrad.module_id)
            .join(Level, Level.id == Module.level_id)
            .where(ContributionGrad.contribution_id == contribution_id)
        )
    }
    session.rollback()
    norms: dict[int, float | None] | None = None
    reason = ""
    try:
        with blobs.open_staged(key, size=size) as (body, actual):
            if actual != digest:
                reason = f"the upload hashes to {actual}, its island said {digest}"
            else:
                try:
                    norms = validated_payload(body, cfg, layout, levels, codec=codec, sparse_rows=sparse_rows).norms
                except Invalid as exc:
                    reason = exc.detail
    except StagedChanged as exc:
        reason = f"{exc} (written again after its commit)"
    except BlobMissing:
        # another executor verified it and removed the staged copy after its commit (then the update below
        # finds `staged_key` cleared and changes nothing), or it is gone for good: deleted, or never written
        reason = f"nothing is staged at {key} (deleted from the store, or never written)"
    except BlobError as exc:  # unreadable: another executor finished it, or the step is tried again later
        if not give_up:
            return _already_verified(session, contribution_id, key, exc)
        reason = f"still unreadable after {STAGED_READ_ATTEMPTS} claims of its step: {exc}"
    if norms is not None:
        blobs.promote_staged(key, digest)  # named by its content before the database says so; staged copy kept
    cleared = session.execute(
        update(Contribution)
        .where(Contribution.id == contribution_id, Contribution.staged_key.is_not(None))
        .values(staged_key=None)
    )
    if cleared.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()  # another executor finished it first
        return 0
    for level_index, (module_id, _) in levels.items():
        values = {"norm": norms[level_index]} if norms is not None else {"scale": 0.0, "note": refusal_note(reason)}
        session.execute(
            update(ContributionGrad)
            .where(ContributionGrad.contribution_id == contribution_id, ContributionGrad.module_id == module_id)
            .values(**values),
            execution_options={"synchronize_session": False},
        )
    session.commit()
    blobs.delete_staged(key)  # last: until the commit, another executor may still be reading it
    if norms is None:
        log.warning("contribution %s refused at verification: %s", contribution_id, reason)
    return 1


def _already_verified(session: Session, contribution_id: int, key: str, exc: Exception) -> int:
    still = session.scalar(select(Contribution.staged_key).where(Contribution.id == contribution_id))
    session.rollback()
    if still is None:
        return 0
    raise BlobError(f"direct upload of contribution {contribution_id} at {key} cannot be read: {exc}") from exc


def sweep_staging(session: Session, blobs: BlobStore, *, now: datetime, grace_s: float) -> int:
    """Remove staged uploads that nothing will read, written more than `grace_s` ago; returns how many (unfinished
    multipart uploads aborted included).

    A staged upload is read by the executor that verifies its contribution, and removed by it. One that no
    contribution names (`staged_key`) and whose lease (named in the key, `<lease>-<sha256>`) is no longer pending
    will never be: a coordinator killed between staging a body and committing its contribution, a commit refused
    after the island's PUT, a PUT never committed. Keys of pending leases, and keys that do not name a lease,
    are left alone. On S3, a multipart upload begun more than `grace_s` ago and never completed, whose lease is no
    longer pending, is aborted (a ticket asked for twice, an island gone between its parts): the bucket keeps
    (and bills) an unfinished upload's parts until then. Leaves no transaction open."""
    cutoff = now - timedelta(seconds=grace_s)
    old = [key for key, written in blobs.list_staged() if written < cutoff]
    removed = 0
    for key in old:
        lease_id = _lease_of(key)
        if lease_id is None:
            continue
        named = session.scalar(select(Contribution.id).where(Contribution.staged_key == key).limit(1))
        pending = _pending(session, lease_id, now=now)
        session.rollback()
        if named is not None or pending:
            continue
        blobs.delete_staged(key)
        removed += 1
    aborted = 0
    if isinstance(blobs, S3BlobStore):
        unfinished = [(key, upload) for key, upload, begun in blobs.list_multipart() if begun < cutoff]
        for key, upload_id in unfinished:
            lease_id = _lease_of(key)
            if lease_id is None:
                continue
            pending = _pending(session, lease_id, now=now)
            session.rollback()
            if not pending:
                blobs.abort_multipart(key, upload_id)
                aborted += 1
    if removed or aborted:
        log.info("removed %d staged upload(s) no contribution names, aborted %d unfinished one(s)", removed, aborted)
    return removed + aborted


def _pending(session: Session, lease_id: int, *, now: datetime) -> bool:
    lease = session.get(Lease, lease_id)
    return lease is not None and lease.status in PENDING_LEASES and as_utc(lease.expires_at) >= now


def _lease_of(key: str) -> int | None:
    lease, sep, _ = key.rpartition("/")[2].partition("-")
    return int(lease) if sep and lease.isdigit() else None
