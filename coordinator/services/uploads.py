"""Accepting outer gradients: validate everything first, then store the upload as one blob and commit.

An upload is checked against its lease (owned, issued for the run's current round, path not yet done, base
module versions current) and its payload (safetensors header, exact tensor names, the run codec's dtypes,
shapes, finite values) before anything is written, so a rejected upload changes nothing. A retry of an accepted
lease returns the same contribution (idempotent). The one check left for later is the hash of a large upload
that named its own sha256 (the island client's uploads of `upload_stream_check_bytes` or more, and direct uploads
to a bucket): it is staged, and the apply executor hashes it before any math (services/staging.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path as FilePath

from sqlalchemy import and_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from coordinator.blobstore import BlobStore, S3BlobStore
from coordinator.db import pinned_session
from coordinator.errors import Conflict, Forbidden, Invalid, LeaseSpent, NotFound, PayloadTooLarge, ServiceError
from coordinator.faults import NO_FAULTS, FaultInjector
from coordinator.metrics import Metrics
from coordinator.models import (
    Contribution,
    ContributionGrad,
    Lease,
    Level,
    Module,
    ModuleStep,
    Path,
    PathModule,
    Round,
    Run,
)
from coordinator.schemas import (
    H_CONTENT_HASH,
    H_REBASED_AT,
    ContributionPublic,
    LeasePublic,
    UploadCommit,
    UploadTicket,
    UploadTicketRequest,
)
from coordinator.services.closing import RoundCloser
from coordinator.services.direct import DirectLimits, Multipart, direct_ticket, staged_payload
from coordinator.services.events import record_refused_upload
from coordinator.services.leases import Affinity, grant_through
from coordinator.services.payloads import (
    Payload,
    PayloadStream,
    validated_payload,
)
from coordinator.services.periods import budget_spent, finish_if_done, flush_periods, make_due
from coordinator.services.runs import overlap, run_layout, run_model_config, run_schedule
from coordinator.services.sharing import advance_cursor, reissued
from coordinator.states import ContributionStatus, LeaseStatus, RoundStatus, RunStatus
from modules import Layout, ModelConfig, OuterConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Upload:
    """One outer-gradient upload as received: the lease it is for, the island that sent it (from its token),
    its headers and the spooled body with the sha256 computed while it streamed in."""

    lease_id: int
    island_id: int
    round: int | None
    """`X-Dipaco-Round`, when sent: must equal the lease's round."""
    tokens: int
    """`X-Dipaco-Tokens`: tokens trained for the lease (the weight under `outer.weighting = "tokens"`)."""
    train_loss: float
    body: FilePath | None
    """The spooled body; None for a direct upload, which is in the bucket at `staged_key`."""
    body_sha256: str
    """The body's sha256: computed while it was spooled (`hashed`), else as its island named it."""
    size: int
    staged_key: str | None = None
    """A direct upload: PUT by the island into the bucket's staging area (`DirectUploads`)."""
    hashed: bool = True
    """False: `body_sha256` is the island's word for it; an accepted body is staged, and the apply executor
    hashes it before any math (`staging.verify_staged`)."""
    claimed_sha256: str | None = None
    """The sha256 the island named (`X-Dipaco-Content-Sha256`); when the body was hashed too, they must agree."""
    heldout_loss: float | None = None
    """`X-Dipaco-Heldout-Loss`, when sent: the lease's start weights scored on the path's held-out slice."""
    rebased_at: int | None = None
    """`X-Dipaco-Rebased-At`, when sent (overlap leases): the inner steps trained from the island's own end weights
    of the path before it moved onto the lease's pending module versions."""
    stream: PayloadStream | None = None
    """The body's values, checked while it was spooled (`UploadDesk.payload_stream`); None: the file is read back."""
    multipart: Multipart | None = None
    """A direct upload PUT in parts: joined at its commit, before its header is read (`direct.staged_payload`)."""
    through: bool = False
    """The island asked for its next lease with the reply, one that may train through the module steps due on its
    path (`next_lease` and `overlap`): in a run with `overlap` it is granted in the upload's own transaction
    (`leases.grant_through`)."""


@dataclass(frozen=True, slots=True)
class Submitted:
    contribution: Contribution
    created: bool
    """False for an idempotent retry of an accepted upload."""
    path_index: int
    steps: int = 0
    """Module steps this upload made due (async levels: it completed a period, or the run's last one)."""
    schedule: str = "round"
    """The run's schedule: with round levels (`round`, `hybrid`) its rounds close; with async ones (`async`,
    `hybrid`) its paths free up and its module steps fall due on uploads."""
    next_lease: LeasePublic | None = None
    """The island's next lease, granted in this upload's transaction (`Upload.through`)."""
    handed: tuple[ModuleStep, ...] = ()
    """Steps it made due that it claimed for this process's executor (`periods.make_due`), committed with it: the
    caller hands them over (`RoundCloser.hand`)."""


@dataclass(frozen=True, slots=True)
class Accepted:
    """`UploadDesk.accept`'s answer: the reply, and whether the island's next lease may be issued with it."""

    answer: ContributionPublic
    lease_ready: bool
    """The upload was new, did not close its round and made no module step due: its path (or another) may be
    leased at once. False for a retry (its first attempt's reply may have carried a lease), after a round
    closed (the next round's leases follow its apply) and after a step fell due (the path is held until the
    step commits)."""
    next_lease: LeasePublic | None = None
    """The island's next lease, committed with the upload (`Upload.through` in a run with `overlap`)."""


@dataclass(frozen=True, slots=True)
class _Checked:
    """What payload validation needs, read before the (lock-free) validation."""

    run_id: int
    cfg: ModelConfig
    layout: Layout
    levels: dict[int, tuple[int, str]]
    """level index -> (module id, level name) of the lease's path."""
    async_modules: frozenset[int]
    """The path's modules on async levels (`Module.period_size` set, fixed at run creation)."""
    outer: OuterConfig
    codec: str
    """The run's codec: uploads must come in it."""
    sparse_rows: bool = False
    """The run's sparse_rows: the embedding comes as rows (`modules.sparse_rows`), and only then."""
    overlap: bool = False
    """An all-async run with `overlap`: an upload that asks for a lease through its path (`Upload.through`) takes
    the run row as a lease grant does (FOR UPDATE), so that the grant can go in its transaction."""


class UploadDesk:
    """Accepts uploads for this process: the transaction (`submit_outer_gradients`), the counts, and the round
    close when the upload completed its round."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        clock: Callable[[], datetime],
        closer: RoundCloser,
        metrics: Metrics,
        faults: FaultInjector,
        max_upload_bytes: int = 1 << 30,
        direct: DirectLimits | None = None,
        affinity: Affinity | None = None,
        max_leases: int = 1,
    ) -> None:
        self._sessions = sessions
        self._blobs = blobs
        self._clock = clock
        self._closer = closer
        self._metrics = metrics
        self._faults = faults
        self._max_upload_bytes = max_upload_bytes
        self._direct = direct if direct is not None else DirectLimits()
        self._affinity = affinity if affinity is not None else Affinity()
        self._max_leases = max_leases
        """As the dispatcher's: the leases granted with an upload follow the same rules (`leases.grant_through`)."""

    @property
    def direct(self) -> bool:
        """Whether islands move outer gradients to the bucket themselves (an s3:// blob store)."""
        return isinstance(self._blobs, S3BlobStore)

    def ticket(self, lease_id: int, island_id: int, request: UploadTicketRequest) -> UploadTicket:
        """Where the island may PUT the outer gradient of its lease: pre-signed URLs to a staging key named by the
        lease and the body's sha256 (so a retry gets the same key), one, or one per part of a large body
        (`direct.direct_ticket`); runs on a worker thread."""
        if not isinstance(self._blobs, S3BlobStore):
            raise Conflict("direct uploads need an s3:// blob store; upload to /outer-gradients instead")
        if request.size > self._max_upload_bytes:
            raise PayloadTooLarge(f"body of {request.size} bytes is over the {self._max_upload_bytes}-byte limit")
        with self._sessions() as session:
            found = _lease_state(session, lease_id)
            if found.lease.island_id != island_id:
                raise Forbidden(f"lease {lease_id} belongs to island {found.lease.island_id}, not island {island_id}")
            _check_lease(session, found, None, now=self._clock())
        key = self._blobs.staging_key(f"{lease_id}-{request.sha256}")
        return direct_ticket(self._blobs, key, request.size, limits=self._direct, now=self._clock())

    def payload_stream(self, lease_id: int, island_id: int) -> PayloadStream | None:
        """A checker of an upload's values while its body streams in, set up from the lease's path and run; None
        when the lease is not one this island holds (the upload's own checks answer then). Runs on a worker
        thread, before the body is read."""
        with self._sessions() as session:
            try:
                found = _lease_state(session, lease_id)
            except NotFound:
                return None
            if found.lease.island_id != island_id:
                return None
            run = found.run
            levels = _levels_of(_path_module_rows(session, found.lease))
            return PayloadStream(
                run_model_config(run),
                run_layout(run),
                levels,
                codec=run.config.get("codec", "fp32"),
                sparse_rows=run.config.get("sparse_rows", False),
            )

    def commit(self, lease_id: int, island_id: int, commit: UploadCommit, *, through: bool = False) -> Accepted:
        """Record an outer gradient the island PUT to the bucket (`ticket`); the same checks and answers as an
        upload through the coordinator, the values verified later by the apply executor. A multipart upload's
        parts are joined first; a refused multipart commit aborts its upload (its parts are dropped)."""
        if not isinstance(self._blobs, S3BlobStore):
            raise Conflict("direct uploads need an s3:// blob store; upload to /outer-gradients instead")
        if commit.key != self._blobs.staging_key(f"{lease_id}-{commit.sha256}"):
            raise Forbidden(f"key {commit.key!r} is not the upload ticket of lease {lease_id} for that sha256")
        upload = Upload(
            lease_id=lease_id,
            island_id=island_id,
            round=commit.round,
            tokens=commit.tokens,
            train_loss=commit.train_loss,
            heldout_loss=commit.heldout_loss,
            rebased_at=commit.rebased_at,
            body=None,
            body_sha256=commit.sha256,
            size=commit.size,
            staged_key=commit.key,
            multipart=None
            if commit.upload_id is None
            else Multipart(commit.upload_id, tuple((part.number, part.etag) for part in commit.parts or ())),
            through=through,
        )
        try:
            return self.accept(upload)
        except (Forbidden, NotFound):
            raise  # not this island's lease: its upload is not ours to abort
        except ServiceError:
            if upload.multipart is not None:
                self._blobs.abort_multipart(commit.key, upload.multipart.upload_id)
            raise

    def accept(self, upload: Upload) -> Accepted:
        """Accept (or refuse, with a `ServiceError`, recorded as an event) one upload; runs on a worker thread."""
        now = self._clock()
        with pinned_session(self._sessions) as session:
            try:
                submitted = submit_outer_gradients(
                    session,
                    self._blobs,
                    upload,
                    now=now,
                    faults=self._faults,
                    grant=self._grant,
                    claimer=self._closer.claimer,
                )
            except ServiceError as exc:
                session.rollback()
                record_refused_upload(
                    self._sessions, lease_id=upload.lease_id, island_id=upload.island_id, error=exc, now=now
                )
                if isinstance(exc, LeaseSpent) and retire_lease(session, upload.lease_id, upload.island_id):
                    self._closer.async_progress(0)  # its path may be free again
                raise
            self._closer.hand(submitted.handed)  # first: nothing below may leave them unhanded
            contribution = submitted.contribution
            self._metrics.contributions.labels(result="accepted" if submitted.created else "duplicate").inc()
            answer = ContributionPublic(  # read now: the close probe's rollback expires the row
                id=contribution.id,
                lease_id=upload.lease_id,
                run_id=contribution.run_id,
                round=contribution.round,
                path_index=submitted.path_index,
                tokens=contribution.tokens,
                train_loss=contribution.train_loss,
                heldout_loss=contribution.heldout_loss,
                status=contribution.status,
                round_applied=False,
            )
            # the round is complete with this upload, whoever closed it: this request, or a sweep or another
            # upload that ran between this commit and the close probe
            if submitted.created and submitted.schedule != "async":
                answer.round_applied = self._closer.closed_with(session, answer.run_id, answer.round, now=now)
            if submitted.created and submitted.schedule != "round":
                self._closer.async_progress(submitted.steps)
            ready = submitted.created and not answer.round_applied and submitted.steps == 0
            if submitted.next_lease is not None:
                self._metrics.leases_issued.inc()
            return Accepted(answer, lease_ready=ready, next_lease=submitted.next_lease)

    def _grant(self, session: Session, run: Run, island_id: int, path_id: int) -> LeasePublic | None:
        """The island's next lease in its upload's transaction (`leases.grant_through`), issued now (the clock
        read here, after the upload's checks); a failure only leaves it out (the upload stands, the island asks
        as usual): it runs in a savepoint."""
        try:
            with session.begin_nested():
                return grant_through(
                    session,
                    run,
                    island_id,
                    path_id,
                    now=self._clock(),
                    affinity=self._affinity,
                    max_leases=self._max_leases,
                )
        except Exception:  # noqa: BLE001 - the upload stands without it
            log.warning("no lease with the upload on path %d of run %d", path_id, run.id, exc_info=True)
            return None


Grant = Callable[[Session, Run, int, int], LeasePublic | None]
"""Grants the island (third argument) its next lease through the path (fourth) in the upload's transaction."""


def submit_outer_gradients(
    session: Session,
    blobs: BlobStore,
    upload: Upload,
    *,
    now: datetime,
    faults: FaultInjector = NO_FAULTS,
    grant: Grant | None = None,
    claimer: str | None = None,
) -> Submitted:
    """Accept (or refuse) one upload and commit.

    An accepted body is moved into the blob store as is (one blob per upload, no re-encoding); each module's
    part is found by its tensor-name prefix.

    Two phases: the checks and the payload validation run without holding any lock (validation is the slow
    part); then, under a shared lock on the run row (uploads side by side, a round apply excluded), the lease
    is checked again and the contribution written. Module versions only change when a round is applied, which
    takes the run row exclusively and moves the run to the next round, so "the lease's round is still current"
    under the lock means its base versions are too. A unique (path, round) constraint keeps a second upload for
    the same path out even if two race. An upload that asks for its island's next lease through its path
    (`Upload.through`, in a run with `overlap`) takes the run row exclusively instead and gets the lease in the
    same transaction (`grant`).
    """
    checked = _check_upload(session, upload, now=now)
    if isinstance(checked, Submitted):
        return checked
    session.rollback()  # no transaction (and, on SQLite, no write lock) while the payload is validated
    if upload.body is not None:
        stream = upload.stream
        if stream is not None and stream.usable and stream.checks(checked.levels, checked.codec, checked.sparse_rows):
            payload = stream.finish(upload.size)
        else:
            payload = validated_payload(
                upload.body,
                checked.cfg,
                checked.layout,
                checked.levels,
                codec=checked.codec,
                sparse_rows=checked.sparse_rows,
            )
        _check_norms(payload, checked)
    else:
        payload = staged_payload(
            blobs,
            upload.staged_key,
            upload.size,
            upload.multipart,
            cfg=checked.cfg,
            layout=checked.layout,
            levels=checked.levels,
            codec=checked.codec,
            sparse_rows=checked.sparse_rows,
        )
    return _record(session, blobs, upload, checked, payload, now=now, faults=faults, grant=grant, claimer=claimer)


def _check_upload(session: Session, upload: Upload, *, now: datetime) -> _Checked | Submitted:
    """Everything that can be refused before reading the payload; a retry of an accepted upload is returned as
    it was (idempotent)."""
    found = _lease_state(session, upload.lease_id)
    lease, run, prior = found.lease, found.run, found.prior
    if lease.island_id != upload.island_id:
        raise Forbidden(f"lease {upload.lease_id} belongs to island {lease.island_id}, not island {upload.island_id}")
    claimed = upload.claimed_sha256
    if upload.hashed and claimed is not None and claimed != upload.body_sha256:
        raise Invalid(f"the body hashes to {upload.body_sha256}, its {H_CONTENT_HASH} header says {claimed}")
    if prior is not None and prior.lease_id == upload.lease_id:
        return Submitted(prior, False, _path_index(session, lease))
    if upload.tokens < 0:
        raise Invalid(f"tokens must be >= 0, got {upload.tokens}")
    if not math.isfinite(upload.train_loss):
        raise Invalid(f"train loss must be finite, got {upload.train_loss}")
    if upload.heldout_loss is not None and not (math.isfinite(upload.heldout_loss) and upload.heldout_loss >= 0):
        raise Invalid(f"held-out loss must be finite and >= 0, got {upload.heldout_loss}")
    _check_lease(session, found, upload.round, now=now)
    _check_rebase(lease, run, upload.rebased_at)
    levels, async_modules = _path_levels(session, lease, max_staleness=run_schedule(run).max_staleness)
    return _Checked(
        run_id=lease.run_id,
        cfg=run_model_config(run),
        layout=run_layout(run),
        levels=levels,
        async_modules=async_modules,
        outer=OuterConfig(**run.config["outer"]),
        codec=run.config.get("codec", "fp32"),
        sparse_rows=run.config.get("sparse_rows", False),
        overlap=run.schedule == "async" and overlap(run),
    )


def _check_rebase(lease: Lease, run: Run, rebased_at: int | None) -> None:
    """`X-Dipaco-Rebased-At` names an inner step of an overlap lease: one issued with pending module versions."""
    if rebased_at is None:
        return
    if not lease.pending_modules:
        raise Invalid(
            f"lease {lease.id} was issued with every module's weights: {H_REBASED_AT} is for overlap leases whose "
            "module versions had not landed"
        )
    steps = lease.inner_steps or run.inner_steps
    if not 0 <= rebased_at <= steps:
        raise Invalid(f"{H_REBASED_AT} must be an inner step of lease {lease.id}, in [0, {steps}], got {rebased_at}")


def _check_norms(payload: Payload, checked: _Checked) -> None:
    """With `outer.outliers = "refuse"`, a module's outer gradient over the absolute bound is refused now (the
    island hears why); clipping, and the bound relative to the round's median, happen at the apply."""
    bound = checked.outer.max_norm
    if checked.outer.outliers != "refuse" or bound is None:
        return
    for level_index, norm in payload.norms.items():
        if norm is not None and norm > bound:
            name = checked.levels[level_index][1]
            raise Invalid(
                f"outer gradient of level {name!r} has L2 norm {norm:.4g}, over the run's bound "
                f"outer.max_norm = {bound:.4g} (outer.outliers = refuse)"
            )


def _record(
    session: Session,
    blobs: BlobStore,
    upload: Upload,
    checked: _Checked,
    payload: Payload,
    *,
    now: datetime,
    faults: FaultInjector,
    grant: Grant | None,
    claimer: str | None,
) -> Submitted:
    """Under a key-share lock on the run row: check the lease again, store the body, write the contribution, mark
    the lease submitted and advance the path's data cursor; with `grant`, when the upload asks for it, issue the
    island's next lease; with `claimer`, claim the steps it makes due for that executor where it may
    (`periods.make_due`); commit."""
    # the lock first, then the rows in a statement of their own: on PostgreSQL a statement that waited for the
    # lock would still see the other rows as they were when it started (a round closed meanwhile, say).
    # FOR KEY SHARE: uploads go side by side and past lease grants (FOR NO KEY UPDATE); a close or a step
    # commit (FOR UPDATE) waits for them, and they for it. An upload that grants a lease takes the row as a lease
    # grant does, from the start: two uploads that each held the shared lock and then asked for the exclusive one
    # would deadlock on PostgreSQL
    granting = grant is not None and upload.through and checked.overlap
    lock = select(Run.id).where(Run.id == checked.run_id)
    session.execute(lock.with_for_update() if granting else lock.with_for_update(read=True, key_share=True))
    found = _lease_state(session, upload.lease_id, fresh=True)
    lease, run, prior = found.lease, found.run, found.prior
    if prior is not None and prior.lease_id == upload.lease_id:
        session.rollback()
        return Submitted(prior, False, _path_index(session, lease))
    _check_lease(session, found, upload.round, now=now)
    staged_key = upload.staged_key
    if upload.body is not None and not upload.hashed:
        staged_key = blobs.staging_key(f"{lease.id}-{upload.body_sha256}")
    contribution = Contribution(
        lease_id=lease.id,
        run_id=run.id,
        round=lease.round,
        path_id=lease.path_id,
        tokens=upload.tokens,
        train_loss=upload.train_loss,
        heldout_loss=upload.heldout_loss,
        codec=payload.codec,
        upload_bytes=upload.size,
        staged_key=staged_key,
        status=ContributionStatus.ACCEPTED,
        created_at=now,
    )
    session.add(contribution)
    try:
        session.flush()
    except IntegrityError as exc:
        session.rollback()
        raise Conflict(f"path of lease {lease.id} already has a contribution for round {lease.round}") from exc
    if upload.body is not None and staged_key is not None:
        blobs.stage_file(upload.body, staged_key)
    elif upload.body is not None:
        blobs.put_file(upload.body, upload.body_sha256)
    slots, made = _assign_steps(session, run, lease, checked.levels, checked.async_modules, claimer=claimer, now=now)
    steps = len(made)
    session.add_all(
        ContributionGrad(
            contribution_id=contribution.id,
            module_id=checked.levels[level_index][0],
            blob_hash=upload.body_sha256,
            prefix=prefix,
            norm=payload.norms[level_index],
            scale=1.0,
            step=slots[level_index].step,
            base_version=slots[level_index].base_version,
            staleness=slots[level_index].staleness,
            rebased_at=upload.rebased_at if checked.levels[level_index][0] in (lease.pending_modules or ()) else None,
        )
        for level_index, prefix in payload.prefixes.items()
    )
    lease.status = LeaseStatus.SUBMITTED
    if run.schedule == "async":  # leases may share the path: the cursor moves over what came in order
        session.flush()
        epoch, offset = advance_cursor(session, lease.path_id, now=now)
    else:
        epoch, offset = lease.epoch, lease.token_end - 1  # the last target token is the next range's first input
    path_index = session.execute(
        update(Path)
        .where(Path.id == lease.path_id)
        .values(
            token_offset=offset,
            epoch=epoch,
            tokens_trained=Path.tokens_trained + upload.tokens,
            last_train_loss=upload.train_loss,
            last_island_id=upload.island_id,
            leases_done=Path.leases_done + 1,
            steps_done=Path.steps_done + (lease.inner_steps or run.inner_steps),
        )
        .returning(Path.index),
        execution_options={"synchronize_session": False},
    ).scalar_one()
    if run.schedule == "async" and budget_spent(session, run):
        steps += flush_periods(session, run)
        finish_if_done(session, run)
    granted = None
    if granting and grant is not None:  # `grant_through` checks the run again under the lock
        granted = grant(session, run, upload.island_id, lease.path_id)
    faults.point("upload.before_commit")
    session.commit()
    handed = tuple(step for step in made if step.claimed_by is not None)
    return Submitted(contribution, True, path_index, steps, run.schedule, granted, handed)


@dataclass(frozen=True, slots=True)
class _LeaseState:
    """An upload's lease with what its checks read: its run, the contribution already accepted for its path and
    round (from this lease or another), and its round's status (None: the round has no row, as in an all-async
    run)."""

    lease: Lease
    run: Run
    prior: Contribution | None
    round_status: RoundStatus | None


def _lease_state(session: Session, lease_id: int, *, fresh: bool = False) -> _LeaseState:
    """One statement (the upload runs it twice: before validation and under the run lock, `fresh`)."""
    query = (
        select(Lease, Run, Contribution, Round.status)
        .join(Run, Run.id == Lease.run_id)
        .outerjoin(Contribution, and_(Contribution.path_id == Lease.path_id, Contribution.round == Lease.round))
        .outerjoin(Round, and_(Round.run_id == Lease.run_id, Round.number == Lease.round))
        .where(Lease.id == lease_id)
    )
    if fresh:
        query = query.execution_options(populate_existing=True)
    row = session.execute(query).first()
    if row is None:
        raise NotFound(f"lease {lease_id} does not exist")
    lease, run, prior, round_status = row
    return _LeaseState(lease, run, prior, round_status)


def _path_index(session: Session, lease: Lease) -> int:
    return session.get_one(Path, lease.path_id).index


def _check_lease(session: Session, found: _LeaseState, round_header: int | None, *, now: datetime) -> None:
    """The lease may still deliver: its round is the run's current one and still open (an all-async run: the
    run is running, and when the lease expired, its token range was not issued again), it was not released, its
    path has no contribution for the round yet (`prior`, from another lease)."""
    lease, run, prior, round_status = found.lease, found.run, found.prior, found.round_status
    if round_header is not None and round_header != lease.round:
        raise Conflict(f"upload is for round {round_header}, lease {lease.id} was issued for round {lease.round}")
    if run.schedule == "async":
        if run.status != RunStatus.RUNNING:
            raise LeaseSpent(f"lease {lease.id}: run {run.id} is {run.status}")
    elif run.status != RunStatus.RUNNING or run.current_round != lease.round:
        raise LeaseSpent(
            f"lease {lease.id} was issued for round {lease.round}, the run is at round {run.current_round}"
            + (" and finished" if run.status == RunStatus.FINISHED else "")
        )
    if run.schedule != "async" and round_status != RoundStatus.OPEN:
        raise LeaseSpent(
            f"lease {lease.id} was issued for round {lease.round}, which closed (enough paths contributed) and is "
            "being applied"
        )
    if lease.status == LeaseStatus.RELEASED:
        raise Conflict(f"lease {lease.id} was released; ask for a new lease")
    holder = reissued(session, lease, now=now) if run.schedule == "async" else None
    if holder is not None:
        raise Conflict(
            f"lease {lease.id} expired and its token range was issued again (lease {holder}); ask for a new lease"
        )
    if prior is not None:
        raise Conflict(
            f"path of lease {lease.id} already has a contribution for round {lease.round} (lease {prior.lease_id})"
        )


def _path_levels(
    session: Session, lease: Lease, *, max_staleness: int
) -> tuple[dict[int, tuple[int, str]], frozenset[int]]:
    """level index -> (module id, level name) of the lease's path, and its async modules; checks the lease's base
    versions: current on round levels, at most `max_staleness` steps old on async ones (checked again under the
    lock)."""
    rows = _path_module_rows(session, lease)
    for module_id, _, version, period, size, name in rows:
        base = int(lease.base_versions[str(module_id)])
        if size is not None:
            _check_staleness(lease, module_id, name, base, period, max_staleness)
        elif base != version:
            raise Conflict(f"lease {lease.id} trained module {module_id} version {base}, the module is at {version}")
    return _levels_of(rows), frozenset(module_id for module_id, _, _, _, size, _ in rows if size is not None)


_ModuleRow = tuple[int, int, int, int, int | None, str]


def _path_module_rows(session: Session, lease: Lease) -> Sequence[_ModuleRow]:
    """(module id, level index, version, period, period size, level name) of each module of the lease's path."""
    return session.execute(
        select(Module.id, Module.level_index, Module.version, Module.period, Module.period_size, Level.name)
        .join(PathModule, PathModule.module_id == Module.id)
        .join(Level, Level.id == Module.level_id)
        .where(PathModule.path_id == lease.path_id)
    ).all()


def _levels_of(rows: Sequence[_ModuleRow]) -> dict[int, tuple[int, str]]:
    return {level_index: (module_id, name) for module_id, level_index, _, _, _, name in rows}


def retire_lease(session: Session, lease_id: int, island_id: int) -> bool:
    """Mark an active lease that can never deliver as released (its island may lease again at once, its path is
    free); commits. Whether it was active."""
    retired = session.execute(
        update(Lease)
        .where(Lease.id == lease_id, Lease.island_id == island_id, Lease.status == LeaseStatus.ACTIVE)
        .values(status=LeaseStatus.RELEASED)
    )
    session.commit()
    return bool(retired.rowcount)  # type: ignore[attr-defined]


def _check_staleness(lease: Lease, module_id: int, name: str, base: int, period: int, max_staleness: int) -> None:
    if period - base > max_staleness:
        raise LeaseSpent(
            f"lease {lease.id} trained module {module_id} (level {name!r}) from version {base}; it has taken "
            f"{period - base} steps since, over the run's max_staleness of {max_staleness}: ask for a new lease"
        )


@dataclass(frozen=True, slots=True)
class _Slot:
    """Where one part of an upload goes: the module step that folds it, from which version, how stale."""

    step: int
    base_version: int
    staleness: int


def _assign_steps(
    session: Session,
    run: Run,
    lease: Lease,
    levels: dict[int, tuple[int, str]],
    async_modules: frozenset[int],
    *,
    claimer: str | None,
    now: datetime,
) -> tuple[dict[int, _Slot], list[ModuleStep]]:
    """Each part's module step (under the run's shared lock; the async modules' rows locked, in id order): a
    round level's part goes to the lease's round; an async level's to the module's filling period, which becomes
    a step for the executors when it is full (claimed for `claimer` where it may: `periods.make_due`). Refuses
    (409) a part staler than the run allows. Returns the slots and the steps made due."""
    async_ids = sorted(async_modules)
    locked = {
        module.id: module
        for module in session.scalars(
            select(Module)
            .where(Module.id.in_(async_ids))
            .order_by(Module.id)
            .with_for_update()
            .execution_options(populate_existing=True)
        )
    } if async_ids else {}  # fmt: skip
    max_staleness = run_schedule(run).max_staleness
    slots: dict[int, _Slot] = {}
    due: list[ModuleStep] = []
    for level_index, (module_id, name) in levels.items():
        base = int(lease.base_versions[str(module_id)])
        module = locked.get(module_id)
        if module is None:
            slots[level_index] = _Slot(step=lease.round, base_version=base, staleness=0)
            continue
        _check_staleness(lease, module_id, name, base, module.period, max_staleness)
        slots[level_index] = _Slot(step=module.period, base_version=base, staleness=module.period - base)
        module.period_count += 1
        assert module.period_size is not None
        if module.period_count >= module.period_size:
            due.append(make_due(session, module, claimer=claimer, now=now))
    return slots, due
