"""What a run has done: its rounds with every path's train loss (`run_history`) and per-run totals
(`run_stats`), in a few statements per page, whatever the number of paths and rounds.

The dashboard polls both; a page of history costs three statements (rounds, their contributions, their event
counts), a page of stats five for the whole page of runs.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, Float, cast, func, or_, select, union
from sqlalchemy.orm import Session

from coordinator.errors import NotFound
from coordinator.models import Contribution, Event, Island, Lease, Path, Round, Run
from coordinator.schemas import PathLoss, RoundHistory, RunHistory, RunStats
from coordinator.services.rounds import quorum_paths
from coordinator.states import PENDING_LEASES, ContributionStatus, EventKind, IslandStatus, RoundStatus, RunStatus
from coordinator.timeutil import as_utc


def run_history(session: Session, run_id: int, *, offset: int, limit: int) -> RunHistory:
    """Rounds `offset` .. `offset + limit - 1` of the run (by number), each with its accepted contributions by
    path and its counts of refused uploads and lease expiries."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFound(f"run {run_id} does not exist")
    count = session.scalar(select(func.count()).select_from(Round).where(Round.run_id == run_id)) or 0
    rounds = list(
        session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.number).offset(offset).limit(limit))
    )
    losses: dict[int, list[PathLoss]] = defaultdict(list)
    events: dict[tuple[int, EventKind], int] = {}
    if rounds:
        first, last = rounds[0].number, rounds[-1].number
        for number, path_index, loss, tokens, island_id, heldout in session.execute(
            select(
                Contribution.round,
                Path.index,
                Contribution.train_loss,
                Contribution.tokens,
                Lease.island_id,
                Contribution.heldout_loss,
            )
            .join(Path, Path.id == Contribution.path_id)
            .join(Lease, Lease.id == Contribution.lease_id)
            .where(
                Contribution.run_id == run_id,
                Contribution.round.between(first, last),
                Contribution.status == ContributionStatus.ACCEPTED,
            )
            .order_by(Contribution.round, Path.index)
        ):
            losses[number].append(
                PathLoss(
                    path_index=path_index, train_loss=loss, tokens=tokens, island_id=island_id, heldout_loss=heldout
                )
            )
        for event_round, kind, n in session.execute(
            select(Event.round, Event.kind, func.count())
            .where(Event.run_id == run_id, Event.round.between(first, last))
            .group_by(Event.round, Event.kind)
        ):
            if event_round is not None:  # always, given the filter; the column is nullable
                events[(event_round, kind)] = n
    quorum = quorum_paths(run.quorum, run.num_paths)
    return RunHistory(
        run_id=run_id,
        num_paths=run.num_paths,
        num_rounds=run.num_rounds,
        current_round=run.current_round,
        count=count,
        data=[
            RoundHistory(
                number=r.number,
                status=r.status,
                opened_at=as_utc(r.opened_at),
                applied_at=as_utc(r.applied_at) if r.applied_at else None,
                deadline=as_utc(r.deadline) if r.deadline else None,
                quorum_paths=quorum,
                contributions=len(losses[r.number]),
                refused_uploads=events.get((r.number, EventKind.UPLOAD_REFUSED), 0),
                lease_expiries=events.get((r.number, EventKind.LEASE_EXPIRED), 0),
                losses=losses[r.number],
            )
            for r in rounds
        ],
    )


def _seconds_between(session: Session, start: Any, end: Any) -> ColumnElement[float]:
    """`end - start` in seconds, as SQL (SQLite keeps timestamps as text; PostgreSQL has intervals)."""
    if session.get_bind().dialect.name == "sqlite":
        return (func.julianday(end) - func.julianday(start)) * 86400.0
    return cast(func.extract("epoch", end - start), Float)


def run_stats(
    session: Session, *, status: RunStatus | None, offset: int, limit: int, now: datetime, live_s: float
) -> tuple[list[RunStats], int]:
    """Totals of a page of runs (same order and filter as the list of runs, so the two pages line up)."""
    q = select(Run.id).order_by(Run.id)
    if status:
        q = q.where(Run.status == status)
    count = session.scalar(select(func.count()).select_from(q.order_by(None).subquery())) or 0
    ids = list(session.scalars(q.offset(offset).limit(limit)))
    if not ids:
        return [], count
    tokens = dict(
        session.execute(
            select(Path.run_id, func.sum(Path.tokens_trained)).where(Path.run_id.in_(ids)).group_by(Path.run_id)
        ).all()
    )
    took = _seconds_between(session, Round.opened_at, Round.applied_at)
    applied = {
        run_id: (n, last, mean)
        for run_id, n, last, mean in session.execute(
            select(Round.run_id, func.count(), func.max(Round.number), func.avg(took))
            .where(Round.run_id.in_(ids), Round.status == RoundStatus.APPLIED)
            .group_by(Round.run_id)
        )
    }
    last_rounds = [(run_id, last) for run_id, (_, last, _) in applied.items()]
    latest: dict[int, tuple[float | None, float | None]] = {}
    if last_rounds:
        pairs = or_(*((Round.run_id == run_id) & (Round.number == last) for run_id, last in last_rounds))
        mean_loss = (
            select(func.avg(Contribution.train_loss))
            .where(Contribution.run_id == Round.run_id, Contribution.round == Round.number)
            .scalar_subquery()
        )
        latest = {
            run_id: (loss, seconds)
            for run_id, loss, seconds in session.execute(select(Round.run_id, mean_loss, took).where(pairs))
        }
    live = select(Island.id).where(
        Island.status == IslandStatus.ACTIVE, Island.last_heartbeat >= now - timedelta(seconds=live_s)
    )
    working = union(
        select(Lease.run_id, Lease.island_id).where(
            Lease.run_id.in_(ids), Lease.status.in_(PENDING_LEASES), Lease.island_id.in_(live)
        ),
        select(Path.run_id, Path.last_island_id)
        .join(Run, Run.id == Path.run_id)
        .where(Path.run_id.in_(ids), Path.last_island_id.in_(live), Run.status == RunStatus.RUNNING),
    ).subquery()
    islands: dict[int, int] = {
        run_id: n
        for run_id, n in session.execute(
            select(working.c[0], func.count(func.distinct(working.c[1]))).group_by(working.c[0])
        )
    }
    out = []
    for run_id in ids:
        n, _, mean = applied.get(run_id, (0, None, None))
        loss, last_s = latest.get(run_id, (None, None))
        out.append(
            RunStats(
                run_id=run_id,
                rounds_applied=n,
                tokens_trained=int(tokens.get(run_id) or 0),
                islands_active=int(islands.get(run_id, 0)),
                latest_train_loss=float(loss) if loss is not None else None,
                mean_round_s=float(mean) if mean is not None else None,
                last_round_s=float(last_s) if last_s is not None else None,
            )
        )
    return out, count
