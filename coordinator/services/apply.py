"""Outer-apply executors (DiPaCo §3's sharded outer optimisation): each takes one module step of a closing round
at a time, folds the outer gradients of the paths through that module into its new version, and commits it
exactly once; the executor that commits a round's last step applies the round (`rounds.finish_round`). The steps
due on one run's async modules are taken together (`ASYNC_BATCH`): one claim, each step's math, one commit.

Any number of executors work on one database: threads of `dipaco coordinator serve` (`--apply-workers N`) and
`dipaco coordinator apply-worker` processes on any machine that reaches the database and the blob store. They
split a round's modules between them by claiming steps (`claim_steps`).

Exactly once, whatever dies when:
  * a step is claimed (`running`, `claimed_by`, `claimed_at`) in a short transaction; its math runs outside any
    transaction (nothing is locked while it runs, and on SQLite no writer waits for it); its result is written to
    the blob store (content-addressed: a crash leaves at most unreferenced blobs) and then committed in one
    transaction that flips the step to `done` only if it is still this executor's claim;
  * a claim whose executor is gone is taken over: at once when that process ran on this host and has exited
    (`release_dead_claims`), else once the claim is older than `claim_s`. An executor that was only slow and
    lost its claim finds its commit refused and drops its result;
  * the module's version is checked against the one the step read, so a module is never stepped twice for one
    round, and the round is applied in the same transaction as its last step;
  * a step that fails (its blobs unreadable, the disk full, a database error in its commit) is given up by its
    executor at once: an `apply_failed` event says why, and the step is tried again, by any executor, after
    `retry_delay_s` (5 s, doubling with each failure up to `claim_s`). Its round waits for it, and the
    executor goes on with other steps.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Connection, Insert, Select, Update, bindparam, func, insert, select, update
from sqlalchemy.orm import Session, aliased, sessionmaker
from sqlalchemy.sql.dml import ReturningUpdate

from coordinator.blobstore import BlobStore
from coordinator.db import reading, start_writing, without_flush_wait
from coordinator.faults import NO_FAULTS, FaultInjector
from coordinator.models import Contribution, ContributionGrad, Module, ModuleStep, ModuleVersion, Run
from coordinator.services.events import add_apply_failure
from coordinator.services.leases import Affinity, ReadyOffer
from coordinator.services.periods import finish_if_done
from coordinator.services.rounds import finish_round
from coordinator.services.runs import schedule_from, weight_norm
from coordinator.services.staging import REFUSED, STAGED_READ_ATTEMPTS, verify_staged
from coordinator.states import ContributionStatus, StepStatus
from modules import (
    NonFiniteStep,
    OuterConfig,
    RoundAccumulator,
    contribution_weight,
    decode,
    expand_rows,
    outlier_bound,
    outlier_scales,
)
from modules.asynchrony import Damping, staleness_weight
from modules.outer import Tensors

log = logging.getLogger(__name__)

CLAIM_S = 300.0
"""A claim older than this is taken over by another executor (a process on another host that may be gone)."""


RETRY_FIRST_S = 5.0
"""A step that failed is tried again after this many seconds, twice as long after each further failure (at most
the executor's `claim_s`)."""


def retry_delay_s(attempts: int, claim_s: float = CLAIM_S) -> float:
    """Seconds before a step that failed at its `attempts`th claim may be claimed again."""
    return min(claim_s, RETRY_FIRST_S * 2.0 ** max(attempts - 1, 0))


def executor_name(index: int = 0) -> str:
    """`<host>-<pid>-<index>`: whose claim a step is, and whether its process still runs on this host."""
    return f"{socket.gethostname()}-{os.getpid()}-{index}"


@dataclass(frozen=True, slots=True)
class StepDone:
    """A module step this executor committed."""

    run_id: int
    round: int
    module_id: int
    clipped: int
    """Parts of uploads folded in scaled down to the round's bound (outliers)."""
    refused: int
    """Parts left out: over the bound with `outer.outliers = refuse`, or making the step non-finite."""
    round_applied: bool
    """This was the round's last step: the round is applied and the run at its next round (or finished)."""
    async_step: bool = False
    """An async module's period (paths held back for it may lease again)."""
    offers: list[ReadyOffer] = field(default_factory=list)
    """Offers of the next round's paths, made when the round was applied."""


@dataclass(frozen=True, slots=True)
class Claimed:
    """A module step claimed by an executor (`claim_steps`, or an upload for it: `periods.make_due`)."""

    step_id: int
    run_id: int
    round: int
    module_id: int
    attempts: int = 1
    """How many times the step has been claimed, this claim included."""


ASYNC_BATCH = 8
"""Steps of one run's async modules (each its module's next) that one claim may take together: they are stepped one
after the other and committed in one transaction, so an overlap lease waiting for two modules waits for one claim
and one commit, not two of each (docs/LOG.md 2026-12-06, session 5). A round's steps are claimed one at a time,
so that executors split a round's modules between them."""


_Candidates = Select[int, StepStatus, int, bool]
"""(step id, status, run id, whether its module is async)"""


@functools.cache
def _claim_statements() -> tuple[_Candidates, _Candidates, ReturningUpdate[int, int, int, int]]:
    """`claim_steps`' statements, built once (building them was a third of a claim's time, docs/LOG.md 2026-12-06,
    session 5): the probe and the candidates (a step pending, or running under a claim older than :stale, whose
    module has no earlier step left), and the claim of one of them."""
    earlier = aliased(ModuleStep)
    before_it = (
        select(earlier.id)
        .where(
            earlier.module_id == ModuleStep.module_id,
            earlier.round < ModuleStep.round,
            earlier.status != StepStatus.DONE,
        )
        .exists()
    )
    claimable = (
        select(ModuleStep.id, ModuleStep.status, ModuleStep.run_id, Module.period_size.is_not(None))
        .join(Module, Module.id == ModuleStep.module_id)
        .where(
            (ModuleStep.status == StepStatus.PENDING)
            | ((ModuleStep.status == StepStatus.RUNNING) & (ModuleStep.claimed_at < bindparam("stale"))),
            ~before_it,  # a module's steps apply in order (an async module's periods)
        )
    )
    candidates = (
        claimable.order_by(ModuleStep.id).limit(8 + ASYNC_BATCH).with_for_update(skip_locked=True, of=ModuleStep)
    )
    take = (
        update(ModuleStep)
        .where(ModuleStep.id == bindparam("claimed_step"), ModuleStep.status == bindparam("claimed_status"))
        .values(
            status=StepStatus.RUNNING,
            claimed_by=bindparam("claimer"),
            claimed_at=bindparam("claimed_now"),
            attempts=ModuleStep.attempts + 1,
        )
        .returning(ModuleStep.run_id, ModuleStep.round, ModuleStep.module_id, ModuleStep.attempts)
    )
    return claimable.limit(1), candidates, take


def claim_step(session: Session, name: str, *, now: datetime, claim_s: float = CLAIM_S) -> Claimed | None:
    """Claim one step (`claim_steps` with a limit of one); None when there is none to claim."""
    claimed = claim_steps(session, name, now=now, claim_s=claim_s, limit=1)
    return claimed[0] if claimed else None


def claim_steps(
    session: Session, name: str, *, now: datetime, claim_s: float = CLAIM_S, limit: int = ASYNC_BATCH
) -> list[Claimed]:
    """Claim the oldest step that is pending, or running under a claim older than `claim_s`, and whose module has
    no earlier step left; when it is an async module's, also up to `limit` - 1 more such steps of the same run's
    async modules (one per module: a module's later step waits for its earlier one); commit. Empty when there is
    nothing to claim. A reader looks first (`db.reading`): an executor that finds nothing, as after its last step
    and at every poll, takes no lock (on SQLite, the write lock the lease requests its step just woke are
    queueing for). The claim's commit does not wait for the disk (`db.without_flush_wait`): lost in a power cut,
    the steps are pending again, and the steps' own commit, which waits, makes the claim durable too."""
    probe, candidates, take = _claim_statements()
    stale = now - timedelta(seconds=claim_s)
    with reading():
        if session.connection().execute(probe, {"stale": stale}).first() is None:
            session.rollback()
            return []
        start_writing(session)
        with without_flush_wait(session):  # a claim lost in a power cut is pending again: the step is redone
            claimed: list[Claimed] = []
            batch: int | None = None  # the run of the async steps claimed so far
            connection = session.connection()  # Core rows: the claim loads no ORM objects
            for step_id, status, run_id, asynchronous in connection.execute(candidates, {"stale": stale}).all():
                if claimed and (not asynchronous or run_id != batch):
                    continue
                taken = connection.execute(
                    take, {"claimed_step": step_id, "claimed_status": status, "claimer": name, "claimed_now": now}
                ).first()
                if taken is None:
                    continue
                claimed.append(
                    Claimed(step_id=step_id, run_id=taken[0], round=taken[1], module_id=taken[2], attempts=taken[3])
                )
                if not asynchronous or len(claimed) >= limit:
                    break
                batch = run_id
            if claimed:
                session.commit()
            else:
                session.rollback()
            return claimed


def give_up_failed(
    session: Session, claimed: Claimed, name: str, error: BaseException, *, now: datetime, claim_s: float = CLAIM_S
) -> float | None:
    """Give up this executor's claim on a step that failed, and record why (an `apply_failed` event); commit.

    The step stays `running` with no owner and a claim dated so that it is stale (`claim_step` takes it again)
    after `retry_delay_s`; nothing else changes (its math left only unreferenced blobs). Returns that delay, or
    None when the claim was no longer this executor's (taken over meanwhile: nothing is written)."""
    delay = retry_delay_s(claimed.attempts, claim_s)
    session.rollback()
    start_writing(session)
    released = session.execute(
        update(ModuleStep)
        .where(ModuleStep.id == claimed.step_id, ModuleStep.status == StepStatus.RUNNING, ModuleStep.claimed_by == name)
        .values(claimed_by=None, claimed_at=now - timedelta(seconds=claim_s - delay))
    )
    if not released.rowcount:  # type: ignore[attr-defined]
        session.rollback()
        return None
    add_apply_failure(
        session,
        run_id=claimed.run_id,
        round_=claimed.round,
        module_id=claimed.module_id,
        executor=name,
        attempt=claimed.attempts,
        error=error,
        retry_s=delay,
        now=now,
    )
    session.commit()
    return delay


def release_claims(session: Session, claims: list[Claimed], name: str) -> int:
    """Put back to `pending` the steps of `claims` still claimed by executor `name` (handed to it and never
    taken up, as at shutdown); commit. Returns how many."""
    if not claims:
        return 0
    return _to_pending(session, ModuleStep.id.in_([c.step_id for c in claims]), ModuleStep.claimed_by == name)


def release_dead_claims(session: Session) -> int:
    """Put back to `pending` the steps claimed by executors of this host whose process has exited; commit."""
    host = socket.gethostname()
    dead = [
        claimed
        for claimed in session.scalars(
            select(ModuleStep.claimed_by).where(ModuleStep.status == StepStatus.RUNNING).distinct()
        )
        if claimed is not None and _on_this_host_and_gone(claimed, host)
    ]
    if not dead:
        session.rollback()
        return 0
    count = _to_pending(session, ModuleStep.claimed_by.in_(dead))
    log.warning("took back %d module step(s) claimed by executors that are gone: %s", count, ", ".join(dead))
    return count


def _to_pending(session: Session, *which: ColumnElement[bool]) -> int:
    """Put the running steps that match `which` back to `pending`, unclaimed; commit. Returns how many."""
    released = session.execute(
        update(ModuleStep)
        .where(ModuleStep.status == StepStatus.RUNNING, *which)
        .values(status=StepStatus.PENDING, claimed_by=None, claimed_at=None)
    )
    session.commit()
    return int(released.rowcount or 0)  # type: ignore[attr-defined]


def _on_this_host_and_gone(claimed_by: str, host: str) -> bool:
    owner, _, rest = claimed_by.rpartition("-")  # <host>-<pid>-<index>
    owner_host, _, pid = owner.rpartition("-")
    if owner_host != host or not pid.isdigit() or not rest.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return _zombie(int(pid))


def _zombie(pid: int) -> bool:
    """Whether the process has exited and waits only for its parent to reap it (it still answers signal 0)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc (not Linux), or it went away meanwhile
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]  # the state follows the command name in parentheses


@dataclass(slots=True)
class _Part:
    """One module's part of one accepted upload: tensors named `<prefix><param>` in blob `blob_hash`."""

    contribution_id: int
    blob_hash: str
    prefix: str
    tokens: int
    norm: float
    """As measured at upload; parts uploaded before norms were measured count as within every bound."""
    staleness: int = 0
    """Async levels: module steps since the version its lease trained from (`modules.asynchrony`)."""
    refused: bool = False
    """Refused before the round (a direct upload that failed verification): stays out."""
    scale: float = 1.0
    note: str | None = None
    stored: tuple[float, str | None] = (1.0, None)
    """(scale, note) as read: the step's commit writes only the parts whose outcome differs (clipped, refused)."""
    staged: bool = False
    """Its upload is still staged, its hash not checked yet (`staging.verify_staged`)."""


@dataclass(frozen=True, slots=True)
class _NewVersion:
    """A module step's result, in the blob store: the new weights and momentum, and the weights' L2 norm."""

    weights_hash: str
    momentum_hash: str | None
    weight_norm: float | None


@dataclass(slots=True)
class _Prepared:
    """A claimed step whose math is done and whose new version is in the blob store, to commit (`_commit`)."""

    claimed: Claimed
    base_version: int
    """The module's version the step read (the commit checks that it is still the module's)."""
    period_size: int | None
    """The module's (`Module.period_size`): set on async levels, whose every step makes a version."""
    parts: list[_Part]
    new_version: _NewVersion | None
    started: float


def apply_step(
    session: Session,
    blobs: BlobStore,
    claimed: Claimed,
    name: str,
    *,
    clock: Callable[[], datetime],
    faults: FaultInjector = NO_FAULTS,
    affinity: Affinity | None = None,
) -> StepDone | None:
    """Step one claimed module and commit; None when the claim was lost meanwhile (nothing is written then)."""
    prepared = _prepare_step(session, blobs, claimed, faults=faults)
    return _commit(session, [prepared], name, clock=clock, faults=faults, affinity=affinity)[0]


def _prepare_step(
    session: Session,
    blobs: BlobStore,
    claimed: Claimed,
    *,
    faults: FaultInjector,
    verified: set[str] | None = None,
) -> _Prepared:
    """A claimed step's math, its new version written to the blob store. Uploads the step needs that are still
    staged are verified first (`staging.verify_staged`; one that cannot be read is refused at the step's
    `STAGED_READ_ATTEMPTS`th claim, so a broken object cannot hold its round forever). `verified`: the upload
    blobs whose hash this executor checked already (the steps of one batch share their uploads)."""
    with reading():  # `_commit` checks again, under the run's lock, that the module is still at this version
        base_version, weights_hash, momentum_hash, period_size, config = (
            session.connection().execute(_module_statement(), {"module_id": claimed.module_id}).one()
        )
        outer, damping = OuterConfig(**config["outer"]), schedule_from(config).damping
        if period_size is not None:  # an async level's module
            outer = outer.for_async()
        parts = _parts(session, claimed)
        session.rollback()  # the math runs outside any transaction
    if any(part.staged for part in parts):  # most uploads were hashed as they came in: no read more for them
        verify_staged(
            session,
            blobs,
            run_id=claimed.run_id,
            round_=claimed.round,
            module_id=claimed.module_id,
            give_up=claimed.attempts >= STAGED_READ_ATTEMPTS,
        )
        with reading():  # as verification left them (refused parts, content names)
            parts = _parts(session, claimed)
            session.rollback()
    started = time.perf_counter()
    stepped = _step(blobs, claimed.module_id, weights_hash, momentum_hash, parts, outer, damping, verified=verified)
    new_version = None
    if stepped is not None:
        new_params, new_momentum = stepped
        # the momentum is written (and fsynced) on a thread of its own while this one writes the weights: a
        # step's two fsyncs were a third of its time beside training islands (docs/LOG.md 2026-12-06, session 5)
        momentum = None if new_momentum is None else _blob_writer().submit(blobs.put_tensors, new_momentum)
        weights_hash = blobs.put_tensors(new_params)
        new_version = _NewVersion(
            weights_hash=weights_hash,
            momentum_hash=None if momentum is None else momentum.result(),
            weight_norm=weight_norm(new_params),  # the tensors in hand: nothing more is read
        )
    faults.point("apply.mid_step")
    return _Prepared(claimed, base_version, period_size, parts, new_version, started)


@functools.cache
def _module_statement() -> Select[int, str, str | None, int | None, dict[str, Any]]:
    """What a step reads of its module and run, in one statement built once (two ORM loads were a seventh of a
    step's time, docs/LOG.md 2026-12-07)."""
    return (
        select(Module.version, Module.weights_hash, Module.momentum_hash, Module.period_size, Run.config)
        .join(Run, Run.id == Module.run_id)
        .where(Module.id == bindparam("module_id"))
    )


@functools.cache
def _blob_writer() -> ThreadPoolExecutor:
    """The process's threads for writing a step's momentum beside its weights (made on first use, shared by the
    process's executors: each hands it one blob per step and waits for it)."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="dipaco-blob-write")


def _parts(session: Session, claimed: Claimed) -> list[_Part]:
    """The accepted uploads' parts for the module's step (the round, or the async period), in path order, then
    arrival (the simulator's order)."""
    rows = session.connection().execute(
        _parts_statement(), {"module_id": claimed.module_id, "step": claimed.round, "run_id": claimed.run_id}
    )
    return [
        _Part(
            contribution_id=contribution_id,
            blob_hash=blob_hash,
            prefix=prefix,
            tokens=tokens,
            norm=0.0 if norm is None else norm,
            staleness=staleness,
            refused=scale == 0 and (note or "").startswith(REFUSED),
            note=note,
            stored=(scale, note),
            staged=staged,
        )
        for contribution_id, blob_hash, prefix, norm, staleness, scale, note, tokens, staged in rows
    ]


@functools.cache
def _parts_statement() -> Select[int, str, str, float | None, int, float, str | None, int, bool]:
    """`_parts`' query, built once and run on the connection (Core rows, no ORM objects)."""
    return (
        select(
            ContributionGrad.contribution_id,
            ContributionGrad.blob_hash,
            ContributionGrad.prefix,
            ContributionGrad.norm,
            ContributionGrad.staleness,
            ContributionGrad.scale,
            ContributionGrad.note,
            Contribution.tokens,
            Contribution.staged_key.is_not(None),
        )
        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
        .where(
            ContributionGrad.module_id == bindparam("module_id"),
            ContributionGrad.step == bindparam("step"),
            Contribution.run_id == bindparam("run_id"),
            Contribution.status == ContributionStatus.ACCEPTED,
        )
        .order_by(Contribution.path_id, Contribution.id)
    )


def _step(
    blobs: BlobStore,
    module_id: int,
    weights_hash: str,
    momentum_hash: str | None,
    parts: list[_Part],
    outer: OuterConfig,
    damping: Damping = "inverse",
    *,
    verified: set[str] | None = None,
) -> tuple[Tensors, Tensors | None] | None:
    """The module's outer round (`modules.RoundAccumulator`, one contribution at a time from the memory-mapped
    upload blobs), each part with its outlier factor (`modules.outlier_scales`), recorded on the part.

    Should the step come out non-finite anyway (`NonFiniteStep`), the part with the largest norm is refused and
    the round folded again, until it is finite; None when no part is left (the module stays as it is).
    """
    kept = [p for p in parts if not p.refused]
    norms = [p.norm for p in kept]
    bound = outlier_bound(norms, outer)
    for part, scale in zip(kept, outlier_scales(norms, outer), strict=True):
        part.scale = scale
        part.note = None if scale == 1 else _outlier_note(part.norm, scale, bound, outer)
    for part in parts:
        if part.refused:
            part.scale = 0.0  # its note, from verification, stays
    params = decode(blobs.get_bytes(weights_hash))
    momentum = decode(blobs.get_bytes(momentum_hash)) if momentum_hash else None
    verified = set() if verified is None else verified
    while True:
        acc = RoundAccumulator()
        for part in parts:
            if part.scale > 0:
                # sparse rows (`modules.sparse_rows`) come as sent: scattered to the module's shapes here
                grad = expand_rows(blobs.load_tensors(part.blob_hash, part.prefix, verified=verified), params)
                damped = part.scale * staleness_weight(part.staleness, damping)
                acc.add(grad, contribution_weight(outer, part.tokens), scale=damped)
        if acc.count == 0:
            return None
        try:
            return acc.finish(params, momentum, outer)
        except NonFiniteStep as exc:
            worst = max((p for p in parts if p.scale > 0), key=lambda p: p.norm)
            worst.scale = 0.0
            worst.note = f"refused: {exc} (L2 norm {worst.norm:.4g}, the largest of the round)"
            log.warning("module %s: %s", module_id, worst.note)


def _outlier_note(norm: float, scale: float, bound: float, outer: OuterConfig) -> str:
    action = "refused" if scale == 0 else f"clipped by {scale:.4g}"
    return (
        f"{action}: L2 norm {norm:.4g} over the round's bound {bound:.4g} (outer.max_norm {outer.max_norm}, "
        f"outer.max_norm_ratio {outer.max_norm_ratio} x the median)"
    )


def _commit(
    session: Session,
    steps: list[_Prepared],
    name: str,
    *,
    clock: Callable[[], datetime],
    faults: FaultInjector,
    affinity: Affinity | None,
) -> list[StepDone | None]:
    """One transaction, the run row locked (steps of a round commit one after the other, and the last one
    applies the round): each step flips to `done` only under this executor's claim and while its module is still
    at the version the step read (else its result is dropped: None in its place), the module takes its new
    version, the parts record their outlier factors; a round's last step also applies the round. Several steps
    come only from one run's async modules (`claim_steps`)."""
    now = clock()
    run_id = steps[0].claimed.run_id
    assert all(p.claimed.run_id == run_id for p in steps)
    run = session.scalar(
        select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
    )
    assert run is not None  # runs are never deleted
    connection = session.connection()
    flip = _commit_statements().flip
    done: list[_Prepared | None] = []
    for prepared in steps:
        claimed = prepared.claimed
        mine = connection.execute(  # under this executor's claim, the module still at the version the step read
            flip,
            {
                "b_step": claimed.step_id,
                "b_name": name,
                "b_now": now,
                "b_module": claimed.module_id,
                "b_base": prepared.base_version,
            },
        )
        if mine.rowcount != 1:
            log.warning("module %s of run %s round %s: claim lost, result dropped", claimed.module_id, run_id,
                        claimed.round)  # fmt: skip
            done.append(None)
            continue
        _record_step(connection, prepared, now=now)
        done.append(prepared)
    if all(d is None for d in done):
        session.rollback()
        return [None] * len(steps)
    asynchronous = any(d is not None and d.period_size is not None for d in done)
    remaining: int | None = 1  # an async step applies no round
    offers: list[ReadyOffer] = []
    if asynchronous:
        finish_if_done(session, run)
    else:
        [round_step] = [d for d in done if d is not None]
        remaining = session.scalar(
            select(func.count())
            .select_from(ModuleStep)
            .join(Module, Module.id == ModuleStep.module_id)
            .where(
                ModuleStep.run_id == run.id,
                ModuleStep.round == round_step.claimed.round,
                ModuleStep.status != StepStatus.DONE,
                Module.period_size.is_(None),
            )
        )
        offers = (
            finish_round(session, run, round_step.claimed.round, now=now, affinity=affinity) if not remaining else []
        )
    faults.point("apply.before_commit")
    session.commit()
    results: list[StepDone | None] = []
    for step in done:
        if step is None:
            results.append(None)
            continue
        parts = step.parts
        log.info(
            "run %s round %s: module %s stepped in %.2f s%s",
            run.id,
            step.claimed.round,
            step.claimed.module_id,
            time.perf_counter() - step.started,
            "; round applied" if not remaining else "",
        )
        results.append(
            StepDone(
                run_id=run.id,
                round=step.claimed.round,
                module_id=step.claimed.module_id,
                clipped=sum(0 < p.scale < 1 for p in parts),
                refused=sum(p.scale == 0 for p in parts),
                round_applied=not remaining,
                offers=offers,
                async_step=step.period_size is not None,
            )
        )
    return results


def _record_step(connection: Connection, prepared: _Prepared, *, now: datetime) -> None:
    """Inside `_commit`'s transaction: the module's new version (an async step always makes one: staleness counts
    steps), and the outlier factors of the parts whose outcome differs from what their rows say."""
    statements = _commit_statements()
    module_id, new_version = prepared.claimed.module_id, prepared.new_version
    if new_version is not None or prepared.period_size is not None:
        if new_version is None:  # an async period with nothing left to fold: the same weights, a new version
            stepped = connection.execute(statements.advance, {"b_module": module_id, "b_now": now})
        else:
            stepped = connection.execute(
                statements.replace,
                {
                    "b_module": module_id,
                    "b_now": now,
                    "b_weights_hash": new_version.weights_hash,
                    "b_momentum_hash": new_version.momentum_hash,
                    "b_weight_norm": new_version.weight_norm,
                },
            )
        version, weights_hash, momentum_hash = stepped.one()
        connection.execute(
            statements.history,
            {
                "module_id": module_id,
                "version": version,
                "weights_hash": weights_hash,
                "momentum_hash": momentum_hash,
                "round": prepared.claimed.round,
                "created_at": now,
            },
        )
    changed = [
        {"b_contribution": part.contribution_id, "b_module": module_id, "b_scale": part.scale, "b_note": part.note}
        for part in prepared.parts
        if (part.scale, part.note) != part.stored  # most parts are as sent, or refused at verification already
    ]
    if changed:
        connection.execute(statements.factor, changed)


class _CommitStatements(NamedTuple):
    flip: Update
    replace: ReturningUpdate[int, str, str | None]
    advance: ReturningUpdate[int, str, str | None]
    history: Insert
    factor: Update


@functools.cache
def _commit_statements() -> _CommitStatements:
    """`_commit`'s statements, built once and run on the connection (an ORM load and flush of the module and its
    new version were most of a commit's time, docs/LOG.md 2026-12-07 session 7): the flip of a step to `done`
    under its claim while its module is at the version the step read; the module's new version, with new
    weights (`replace`) or without (`advance`); its history row; a part's outlier factor."""
    at_base = (
        select(Module.id).where(Module.id == bindparam("b_module"), Module.version == bindparam("b_base")).exists()
    )
    flip = (
        update(ModuleStep)
        .where(
            ModuleStep.id == bindparam("b_step"),
            ModuleStep.status == StepStatus.RUNNING,
            ModuleStep.claimed_by == bindparam("b_name"),
            at_base,
        )
        .values(status=StepStatus.DONE, done_at=bindparam("b_now"))
    )
    this_module = update(Module).where(Module.id == bindparam("b_module"))
    returned = (Module.version, Module.weights_hash, Module.momentum_hash)
    advance = this_module.values(version=Module.version + 1, updated_at=bindparam("b_now")).returning(*returned)
    replace = this_module.values(
        version=Module.version + 1,
        updated_at=bindparam("b_now"),
        weights_hash=bindparam("b_weights_hash"),
        momentum_hash=bindparam("b_momentum_hash"),
        weight_norm=bindparam("b_weight_norm"),
    ).returning(*returned)
    history = insert(ModuleVersion)  # the row's columns come as the parameters
    factor = (
        update(ContributionGrad)
        .where(
            ContributionGrad.contribution_id == bindparam("b_contribution"),
            ContributionGrad.module_id == bindparam("b_module"),
        )
        .values(scale=bindparam("b_scale"), note=bindparam("b_note"))
    )
    return _CommitStatements(flip, replace, advance, history, factor)


class ApplyExecutor:
    """Claims and applies module steps until there are none (`work`), or until stopped (`serve`)."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        blobs: BlobStore,
        clock: Callable[[], datetime],
        name: str,
        faults: FaultInjector = NO_FAULTS,
        affinity: Affinity | None = None,
        claim_s: float = CLAIM_S,
        on_step: Callable[[StepDone], None] | None = None,
        batch: int = ASYNC_BATCH,
        handed: Callable[[], list[Claimed]] | None = None,
    ) -> None:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        self.name = name
        self._batch = batch
        """Async steps one claim may take (`claim_steps`); 1: one at a time, as before 2026-12-06."""
        self._sessions = sessions
        self._blobs = blobs
        self._clock = clock
        self._faults = faults
        self._affinity = affinity
        self._claim_s = claim_s
        self._on_step = on_step
        self._handed = handed
        """Steps claimed for this executor by the uploads of its process (`RoundCloser.take_handed`): taken
        before any claim of its own."""
        self.steps = 0
        """Steps this executor committed."""

    def work(self, stop: threading.Event | None = None) -> int:
        """Apply steps until none can be claimed, or until `stop` is set (the steps in hand are committed first,
        and no other claimed: a process about to exit leaves no claim for `claim_s` to free); returns how many
        this call committed."""
        done = 0
        with self._sessions() as session:
            while stop is None or not stop.is_set():
                claims = self._handed() if self._handed is not None else []
                if not claims:
                    claims = claim_steps(
                        session, self.name, now=self._clock(), claim_s=self._claim_s, limit=self._batch
                    )
                if not claims:
                    return done
                for result in self._apply(session, claims):
                    if result is not None:
                        done += 1
                        self.steps += 1
                        if self._on_step is not None:
                            self._on_step(result)
        return done

    def _apply(self, session: Session, claims: list[Claimed]) -> list[StepDone | None]:
        """Read and compute each claimed step, then commit those computed in one transaction. A step that fails is
        given up and recorded (`give_up_failed`); the others go on (all of them, when the commit fails)."""
        prepared = []
        verified: set[str] = set()
        for claimed in claims:
            try:
                prepared.append(_prepare_step(session, self._blobs, claimed, faults=self._faults, verified=verified))
            except Exception as exc:
                self._give_up(session, claimed, exc)
        if not prepared:
            return []
        try:
            return _commit(
                session, prepared, self.name, clock=self._clock, faults=self._faults, affinity=self._affinity
            )
        except Exception as exc:
            session.rollback()
            for done in prepared:
                self._give_up(session, done.claimed, exc)
            return []

    def _give_up(self, session: Session, claimed: Claimed, exc: Exception) -> None:
        log.error("apply executor %s: the step of module %d failed", self.name, claimed.module_id, exc_info=exc)
        give_up_failed(session, claimed, self.name, exc, now=self._clock(), claim_s=self._claim_s)

    def serve(self, stop: threading.Event, wake: threading.Event, *, poll_s: float) -> None:
        """Work whenever woken (a round closed in this process) or every `poll_s` (one closed elsewhere, a claim
        gone stale), until `stop` is set. A failed step is given up and tried again later (`give_up_failed`);
        other errors (the database unreachable) are logged and the loop goes on."""
        last_release = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() - last_release > 10 * poll_s:
                    with self._sessions() as session:
                        release_dead_claims(session)
                    last_release = time.monotonic()
                self.work(stop)
            except Exception:  # keep serving: a claim this left behind goes back to the pool when stale
                log.exception("apply executor %s: a step failed", self.name)
            wake.wait(poll_s)
            wake.clear()
