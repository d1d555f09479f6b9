"""Closing a round: when every path has contributed, or its deadline has passed with a quorum, the round stops
taking leases and uploads and is handed to the apply executors (`services/apply.py`), one step per module; when
the last module's step is committed, `finish_round` moves the run to its next round.

A round closes when every path has contributed, or, once its deadline (run.round_deadline_s after it opened)
has passed, as soon as at least ceil(quorum * paths) paths have. Past the deadline without quorum the round
stays open and keeps leasing. Leases still out when a round closes get 409 on upload.

Closing is one short transaction that flips the round from `open` to `closing` with a conditional UPDATE (only
one caller, thread, process or replica, wins it) and records the module steps; no outer math runs in it, so the
upload that completes a round answers as fast as any other. A crash before its commit leaves the round open,
to be closed again; after it, the steps wait in the database for any executor.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from coordinator.models import Contribution, ContributionGrad, Module, ModuleStep, Round, Run
from coordinator.services.leases import Affinity, ReadyOffer, offer_next_round
from coordinator.services.periods import finish_if_done, flush_periods
from coordinator.states import ContributionStatus, RoundStatus, RunStatus, StepStatus
from coordinator.timeutil import as_utc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClosedRound:
    """A round this call closed: which, how many paths contributed, how many module steps wait for executors."""

    run_id: int
    number: int
    contributions: int
    steps: int


def close_round(session: Session, run_id: int, *, now: datetime) -> ClosedRound | None:
    """Close the run's current round if it is ready, and commit; None when it was not (or another caller won).

    Readiness is probed without a lock first (most calls come from lease requests and uploads and find nothing
    to do), then checked again with the run row locked before anything is written.
    """
    if _ready_count(session, run_id, now) is None:
        session.rollback()
        return None
    run = session.scalar(
        select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
    )
    contributed = _ready_count(session, run_id, now) if run is not None else None  # again, under the lock
    if run is None or contributed is None:
        session.rollback()
        return None
    number = run.current_round
    won = session.execute(
        update(Round)
        .where(Round.run_id == run.id, Round.number == number, Round.status == RoundStatus.OPEN)
        .values(status=RoundStatus.CLOSING, num_contributions=contributed)
    )
    if won.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return None
    modules = session.scalars(
        select(ContributionGrad.module_id)
        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
        .join(Module, Module.id == ContributionGrad.module_id)
        .where(
            Contribution.run_id == run.id,
            Contribution.round == number,
            Contribution.status == ContributionStatus.ACCEPTED,
            Module.period_size.is_(None),  # round levels; async ones step on their own periods
        )
        .distinct()
    ).all()
    session.add_all(
        ModuleStep(run_id=run.id, round=number, module_id=module_id, status=StepStatus.PENDING, attempts=0)
        for module_id in sorted(modules)
    )
    if number == run.num_rounds - 1:
        flush_periods(session, run)  # hybrid: the async levels' last contributions are in
    session.commit()
    log.info(
        "run %s: round %s closed (%s of %s paths), %s module steps",
        run_id,
        number,
        contributed,
        run.num_paths,
        len(modules),
    )
    return ClosedRound(run_id=run_id, number=number, contributions=contributed, steps=len(modules))


def close_ready_rounds(session: Session, *, now: datetime, run_ids: list[int] | None = None) -> list[ClosedRound]:
    """Close the rounds of `run_ids` (default: every running run) that are ready: complete, or past their
    deadline with a quorum (start-up recovery, the sweeper, lease and upload requests)."""
    if run_ids is None:
        run_ids = list(session.scalars(select(Run.id).where(Run.status == RunStatus.RUNNING)))
        session.rollback()
    closed = (close_round(session, run_id, now=now) for run_id in run_ids)
    return [c for c in closed if c is not None]


def round_closed(session: Session, run_id: int, number: int) -> bool:
    """Whether round `number` of the run has stopped taking uploads (closing or applied). An upload accepted
    into that round and followed by this answer is one of the contributions the round closed with: closing
    takes the run row exclusively, so it saw every upload committed before it and refuses every one after."""
    status = session.scalar(select(Round.status).where(Round.run_id == run_id, Round.number == number))
    session.rollback()
    return status is not None and status != RoundStatus.OPEN


def finish_round(
    session: Session, run: Run, number: int, *, now: datetime, affinity: Affinity | None
) -> list[ReadyOffer]:
    """In the transaction that committed a round's last module step (the run row locked): the round is applied,
    the run moves to its next round (or finishes), and the islands that trained its paths are offered them
    (`leases.offer_next_round`). Returns the offers made."""
    session.execute(
        update(Round)
        .where(Round.run_id == run.id, Round.number == number, Round.status == RoundStatus.CLOSING)
        .values(status=RoundStatus.APPLIED, applied_at=now)
    )
    return _open_next_round(session, run, now=now, affinity=affinity)


def _open_next_round(session: Session, run: Run, *, now: datetime, affinity: Affinity | None) -> list[ReadyOffer]:
    """Move the run to its next round (or finish it); offer the next round's paths to their islands."""
    run.current_round += 1
    if run.current_round >= run.num_rounds:
        finish_if_done(session, run)  # else the last async step finishes it
        return []
    open_round(session, run, run.current_round, now=now)
    return offer_next_round(session, run, now=now, affinity=affinity) if affinity is not None else []


def _ready_count(session: Session, run_id: int, now: datetime) -> int | None:
    """Paths that contributed to the run's open round, if the round may close now (else None): every path did,
    or its deadline passed with a quorum. One statement (the unlocked probe of a lease request that found no
    path; an upload runs `after_upload` instead)."""
    row = session.execute(
        select(Run.num_paths, Run.quorum, Round.deadline, _contributed(Run.current_round))
        .join(Round, and_(Round.run_id == Run.id, Round.number == Run.current_round))
        .where(Run.id == run_id, Run.status == RunStatus.RUNNING, Round.status == RoundStatus.OPEN)
    ).first()
    if row is None:
        return None
    num_paths, quorum, deadline, count = row
    return count if _may_close(num_paths, quorum, deadline, count, now) else None


def after_upload(session: Session, run_id: int, number: int, now: datetime) -> Literal["open", "ready", "closed"]:
    """Round `number` once an upload into it committed, in one statement: still taking uploads (`open`), ready
    to close (the run's current round, every path in or past its deadline with a quorum), or `closed` (closing
    or applied, by whoever). Rolls back."""
    row = session.execute(
        select(Run.status, Run.current_round, Run.num_paths, Run.quorum, Round.deadline, Round.status)
        .add_columns(_contributed(number))
        .outerjoin(Round, and_(Round.run_id == Run.id, Round.number == number))
        .where(Run.id == run_id)
    ).first()
    session.rollback()
    if row is None:
        return "open"
    run_status, current, num_paths, quorum, deadline, round_status, count = row
    if round_status is not None and round_status != RoundStatus.OPEN:
        return "closed"
    if (
        round_status == RoundStatus.OPEN
        and run_status == RunStatus.RUNNING
        and current == number
        and _may_close(num_paths, quorum, deadline, count, now)
    ):
        return "ready"
    return "open"


def _contributed(number: Any) -> Any:
    """Paths with an accepted contribution to round `number` of the run (a correlated scalar subquery)."""
    return (
        select(func.count(func.distinct(Contribution.path_id)))
        .where(
            Contribution.run_id == Run.id,
            Contribution.round == number,
            Contribution.status == ContributionStatus.ACCEPTED,
        )
        .scalar_subquery()
    )


def _may_close(num_paths: int, quorum: float, deadline: datetime | None, count: int, now: datetime) -> bool:
    """Every path contributed, or the round's deadline passed with a quorum."""
    past_deadline = deadline is not None and now >= as_utc(deadline)
    return count >= num_paths or (past_deadline and count >= quorum_paths(quorum, num_paths))


def quorum_paths(quorum: float, num_paths: int) -> int:
    """Contributions needed to close a round past its deadline."""
    return max(1, math.ceil(quorum * num_paths - 1e-9))


def open_round(session: Session, run: Run, number: int, *, now: datetime) -> Round:
    deadline = now + timedelta(seconds=run.round_deadline_s) if run.round_deadline_s else None
    rnd = Round(run_id=run.id, number=number, status=RoundStatus.OPEN, opened_at=now, deadline=deadline)
    session.add(rnd)
    return rnd
