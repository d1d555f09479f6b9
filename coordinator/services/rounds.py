"""Closing a round: each module takes one outer step on the (weighted) mean outer gradient of the paths through it
(DiPaCo Alg. 1; the rule itself lives in `modules.outer.RoundAccumulator`), and the run moves to the next round.

A round closes when every path has contributed, or, once its deadline (run.round_deadline_s after it opened)
has passed, as soon as at least ceil(quorum * paths) paths have. Past the deadline without quorum the round
stays open and keeps leasing. Leases still out when a round closes get 409 on upload.

The apply is one transaction that starts by flipping the round from `open` to `applied` with a conditional
UPDATE: only one caller (thread, process or coordinator replica) can win it, and a crash before commit leaves
the round open with nothing changed, so the apply is re-done later exactly once. Outer gradients are folded one
contribution at a time, so memory is O(module size) whatever the number of paths.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from coordinator.blobstore import BlobStore
from coordinator.faults import NO_FAULTS, FaultInjector
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion, Round, Run
from coordinator.services.leases import Affinity, ReadyOffer, offer_next_round
from coordinator.states import ContributionStatus, RoundStatus, RunStatus
from coordinator.timeutil import as_utc
from modules import OuterConfig, RoundAccumulator, contribution_weight, decode, encode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AppliedRound:
    """A round this call applied: which, how many paths contributed, and the offers made for the next one."""

    run_id: int
    number: int
    contributions: int
    offers: list[ReadyOffer]


@dataclass(frozen=True, slots=True)
class _Grad:
    """One module's part of one accepted upload: tensors named `<prefix><param>` in blob `blob_hash`."""

    blob_hash: str
    prefix: str
    tokens: int


def apply_round(
    session: Session,
    blobs: BlobStore,
    run_id: int,
    *,
    now: datetime,
    faults: FaultInjector = NO_FAULTS,
    affinity: Affinity | None = None,
) -> AppliedRound | None:
    """Apply the run's current round if it is ready to close, and commit; None when it was not (or another
    caller won it).

    With `affinity`, the islands that trained the round's paths are offered them for the next round in the same
    transaction (see `leases.offer_next_round`).

    Readiness is probed without a lock first (most calls come from lease requests and find nothing to do), then
    checked again with the run row locked before anything is written.
    """
    if _ready_count(session, run_id, now) is None:
        session.rollback()
        return None
    started = time.perf_counter()
    claimed = _claim_round(session, run_id, now=now)
    if claimed is None:
        session.rollback()
        return None
    run, contributed = claimed
    number = run.current_round
    _step_modules(session, blobs, run, number, now=now)
    offers = _open_next_round(session, run, now=now, affinity=affinity)
    faults.point("apply.before_commit")
    session.commit()
    log.info(
        "run %s: round %s applied (%s of %s paths) in %.2f s",
        run_id,
        number,
        contributed,
        run.num_paths,
        time.perf_counter() - started,
    )
    return AppliedRound(run_id=run_id, number=number, contributions=contributed, offers=offers)


def _claim_round(session: Session, run_id: int, *, now: datetime) -> tuple[Run, int] | None:
    """Lock the run row, check the round is still ready, and flip it from `open` to `applied`: only one caller
    (thread, process or replica) changes that row, and a crash before commit leaves the round open. Returns the
    locked run and the number of contributing paths when this caller won."""
    run = session.scalar(
        select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
    )
    if run is None or run.status != RunStatus.RUNNING:
        return None
    contributed = _ready_count(session, run.id, now)  # again, now that the run row is locked
    if contributed is None:
        return None
    won = session.execute(
        update(Round)
        .where(Round.run_id == run.id, Round.number == run.current_round, Round.status == RoundStatus.OPEN)
        .values(status=RoundStatus.APPLIED, applied_at=now, num_contributions=contributed)
    )
    return (run, contributed) if won.rowcount == 1 else None  # type: ignore[attr-defined]


def _step_modules(session: Session, blobs: BlobStore, run: Run, number: int, *, now: datetime) -> None:
    """Each module folds the outer gradients of the paths through it (`modules.RoundAccumulator`, one
    contribution at a time from the memory-mapped upload blobs) and takes its outer step; a new version is
    written and the old one kept in the history. A module no contributing path uses is left as it is."""
    outer = OuterConfig(**run.config["outer"])
    grads = _round_grads(session, run.id, number)
    verified: set[str] = set()
    for module in session.scalars(select(Module).where(Module.run_id == run.id).order_by(Module.id)):
        acc = RoundAccumulator()
        for grad in grads.get(module.id, []):
            acc.add(
                blobs.load_tensors(grad.blob_hash, grad.prefix, verified=verified),
                contribution_weight(outer, grad.tokens),
            )
        if acc.count == 0:
            continue  # weights, version and momentum stay as they are
        params = decode(blobs.get_bytes(module.weights_hash))
        momentum = decode(blobs.get_bytes(module.momentum_hash)) if module.momentum_hash else None
        new_params, new_momentum = acc.finish(params, momentum, outer)
        module.weights_hash = blobs.put_bytes(encode(new_params))
        module.momentum_hash = blobs.put_bytes(encode(new_momentum)) if new_momentum is not None else None
        module.version += 1
        module.updated_at = now
        session.add(
            ModuleVersion(
                module_id=module.id,
                version=module.version,
                weights_hash=module.weights_hash,
                momentum_hash=module.momentum_hash,
                round=number,
                created_at=now,
            )
        )


def _round_grads(session: Session, run_id: int, number: int) -> dict[int, list[_Grad]]:
    """module id -> the accepted outer gradients of the round for it, in path order (the simulator's order)."""
    grads: dict[int, list[_Grad]] = defaultdict(list)
    for module_id, blob_hash, prefix, tokens in session.execute(
        select(ContributionGrad.module_id, ContributionGrad.blob_hash, ContributionGrad.prefix, Contribution.tokens)
        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
        .where(
            Contribution.run_id == run_id,
            Contribution.round == number,
            Contribution.status == ContributionStatus.ACCEPTED,
        )
        .order_by(Contribution.path_id)
    ):
        grads[module_id].append(_Grad(blob_hash=blob_hash, prefix=prefix, tokens=tokens))
    return grads


def _open_next_round(session: Session, run: Run, *, now: datetime, affinity: Affinity | None) -> list[ReadyOffer]:
    """Move the run to its next round (or finish it); offer the next round's paths to their islands."""
    run.current_round += 1
    if run.current_round >= run.num_rounds:
        run.status = RunStatus.FINISHED
        return []
    open_round(session, run, run.current_round, now=now)
    return offer_next_round(session, run, now=now, affinity=affinity) if affinity is not None else []


def _ready_count(session: Session, run_id: int, now: datetime) -> int | None:
    """Paths that contributed to the run's open round, if the round may close now (else None): every path did,
    or its deadline passed with a quorum. One statement (the unlocked probe runs after every accepted upload)."""
    contributed = (
        select(func.count(func.distinct(Contribution.path_id)))
        .where(
            Contribution.run_id == Run.id,
            Contribution.round == Run.current_round,
            Contribution.status == ContributionStatus.ACCEPTED,
        )
        .scalar_subquery()
    )
    row = session.execute(
        select(Run.num_paths, Run.quorum, Round.deadline, contributed)
        .join(Round, and_(Round.run_id == Run.id, Round.number == Run.current_round))
        .where(Run.id == run_id, Run.status == RunStatus.RUNNING, Round.status == RoundStatus.OPEN)
    ).first()
    if row is None:
        return None
    num_paths, quorum, deadline, count = row
    complete = count >= num_paths
    past_deadline = deadline is not None and now >= as_utc(deadline)
    return count if complete or (past_deadline and count >= _quorum(quorum, num_paths)) else None


def _quorum(quorum: float, num_paths: int) -> int:
    """Contributions needed to close a round past its deadline."""
    return max(1, math.ceil(quorum * num_paths - 1e-9))


def open_round(session: Session, run: Run, number: int, *, now: datetime) -> Round:
    deadline = now + timedelta(seconds=run.round_deadline_s) if run.round_deadline_s else None
    rnd = Round(run_id=run.id, number=number, status=RoundStatus.OPEN, opened_at=now, deadline=deadline)
    session.add(rnd)
    return rnd


def apply_ready_rounds(
    session: Session,
    blobs: BlobStore,
    *,
    now: datetime,
    run_ids: list[int] | None = None,
    faults: FaultInjector = NO_FAULTS,
    affinity: Affinity | None = None,
) -> list[AppliedRound]:
    """Apply the rounds of `run_ids` (default: every running run) that are ready: complete, or past their
    deadline with a quorum (start-up recovery, the sweeper, lease and upload requests)."""
    if run_ids is None:
        run_ids = list(session.scalars(select(Run.id).where(Run.status == RunStatus.RUNNING)))
        session.rollback()
    applied = (apply_round(session, blobs, run_id, now=now, faults=faults, affinity=affinity) for run_id in run_ids)
    return [a for a in applied if a is not None]
