"""Closing a round: each module takes one outer Nesterov step on the mean outer gradient of the paths through it
(DiPaCo Alg. 1), and the run moves to the next round.

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
from datetime import datetime, timedelta

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from coordinator.blobstore import BlobStore
from coordinator.faults import NO_FAULTS, FaultInjector
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion, Round, Run
from coordinator.services.leases import Affinity, ReadyOffer, offer_next_round
from coordinator.timeutil import as_utc
from modules import OuterConfig, accumulate, decode, encode, nesterov_step

log = logging.getLogger(__name__)


def maybe_apply_round(
    session: Session,
    blobs: BlobStore,
    run_id: int,
    *,
    now: datetime,
    faults: FaultInjector = NO_FAULTS,
    affinity: Affinity | None = None,
    offered: list[ReadyOffer] | None = None,
) -> bool:
    """Apply the run's current round if it is ready to close; True if this call applied it.

    With `affinity`, the islands that trained the round's paths are offered them for the next round in the same
    transaction (see `leases.offer_next_round`); the offers are appended to `offered` once committed.

    Readiness is probed without a lock first (most calls come from lease requests and find nothing to do), then
    checked again with the run row locked before anything is written.
    """
    if _ready_count(session, run_id, now) is None:
        session.rollback()
        return False
    run = session.scalar(
        select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
    )
    if run is None or run.status != "running":
        session.rollback()
        return False
    number = run.current_round
    contributed = _ready_count(session, run.id, now)  # again, now that the run row is locked
    if contributed is None:
        session.rollback()
        return False
    started = time.perf_counter()
    won = session.execute(
        update(Round)
        .where(Round.run_id == run.id, Round.number == number, Round.status == "open")
        .values(status="applied", applied_at=now, num_contributions=contributed)
    )
    if won.rowcount != 1:  # type: ignore[attr-defined]
        session.rollback()
        return False

    grads: dict[int, list[tuple[str, str]]] = defaultdict(list)
    for module_id, blob_hash, prefix in session.execute(
        select(ContributionGrad.module_id, ContributionGrad.blob_hash, ContributionGrad.prefix)
        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
        .where(Contribution.run_id == run.id, Contribution.round == number, Contribution.status == "accepted")
        .order_by(Contribution.path_id)
    ):
        grads[module_id].append((blob_hash, prefix))
    outer = OuterConfig(**run.config["outer"])
    verified: set[str] = set()
    for module in session.scalars(select(Module).where(Module.run_id == run.id).order_by(Module.id)):
        hashes = grads.get(module.id)
        if not hashes:
            continue  # no path through this module contributed: weights and momentum stay as they are
        acc = None
        for digest, prefix in hashes:
            acc = accumulate(acc, blobs.load_tensors(digest, prefix, verified=verified), 1.0)
        assert acc is not None
        mean = {name: t / len(hashes) for name, t in acc.items()}
        params = decode(blobs.get_bytes(module.weights_hash))
        momentum = decode(blobs.get_bytes(module.momentum_hash)) if module.momentum_hash else None
        new_params, new_momentum = nesterov_step(params, mean, momentum, outer)
        module.weights_hash = blobs.put_bytes(encode(new_params))
        module.momentum_hash = blobs.put_bytes(encode(new_momentum))
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
    run.current_round = number + 1
    offers: list[ReadyOffer] = []
    if run.current_round >= run.num_rounds:
        run.status = "finished"
    else:
        open_round(session, run, run.current_round, now=now)
        if affinity is not None:
            offers = offer_next_round(session, run, now=now, affinity=affinity)
    faults.point("apply.before_commit")
    session.commit()
    if offered is not None:
        offered.extend(offers)
    log.info(
        "run %s: round %s applied (%s of %s paths) in %.2f s",
        run.id,
        number,
        contributed,
        run.num_paths,
        time.perf_counter() - started,
    )
    return True


def _ready_count(session: Session, run_id: int, now: datetime) -> int | None:
    """Paths that contributed to the run's open round, if the round may close now (else None): every path did,
    or its deadline passed with a quorum. One statement (the unlocked probe runs after every accepted upload)."""
    contributed = (
        select(func.count(func.distinct(Contribution.path_id)))
        .where(
            Contribution.run_id == Run.id, Contribution.round == Run.current_round, Contribution.status == "accepted"
        )
        .scalar_subquery()
    )
    row = session.execute(
        select(Run.num_paths, Run.quorum, Round.deadline, contributed)
        .join(Round, and_(Round.run_id == Run.id, Round.number == Run.current_round))
        .where(Run.id == run_id, Run.status == "running", Round.status == "open")
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
    rnd = Round(run_id=run.id, number=number, status="open", opened_at=now, deadline=deadline)
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
    offered: list[ReadyOffer] | None = None,
) -> int:
    """Apply the rounds of `run_ids` (default: every running run) that are ready: complete, or past their
    deadline with a quorum (start-up recovery, the sweeper, lease and upload requests). Returns how many."""
    if run_ids is None:
        run_ids = list(session.scalars(select(Run.id).where(Run.status == "running")))
        session.rollback()
    return sum(
        maybe_apply_round(session, blobs, run_id, now=now, faults=faults, affinity=affinity, offered=offered)
        for run_id in run_ids
    )
