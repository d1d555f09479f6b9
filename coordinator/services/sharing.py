"""Which path an island of an all-async run trains next, and a path's data cursor when leases share it.

An island's *home path* is the path of its latest lease in the run that was not shared: its inner AdamW state
and error-feedback residual live there, so it keeps it between two of its leases (with affinity on, no other
island takes a free home path of a live island).

With `path_leases` > 1 (`RunCreate.path_leases`, path sharing), up to that many leases train one path at once,
each on its own token range, all from the path's modules at their current versions (their contributions meet
in the modules' Delayed Nesterov periods, damped by their staleness like any other). An island whose home path
is ahead of another path by more than one lease of its own (inner steps accepted or leased) takes a shared lease
on that path, so a path held by a slow island no longer gets that island's tokens only.

Cursor. `Path.epoch` and `Path.token_offset` stay the end of the path's contiguous trained prefix. Leases past
it (pending, or accepted out of order) are *claims*: a new lease starts after the last claim, and an upload moves
the cursor over the accepted claims that continue it, in order (`advance_cursor`). A range given back (expired,
released) leaves a gap before the next claim, which is issued again first, as it was (same range, H and round
number, so a late upload of the old lease and the new one cannot both be accepted): every token range is still
trained once per epoch. A lease whose range would not fit in the rest of the shard takes the tail with fewer
whole steps when at least `min_inner_steps` (1 when unset) fit (`modules.cursor.fitting_steps`), else starts the
next epoch, also while claims of the current one are out (the cursor crosses into the next epoch only where no
range was given back; a lease that would wrap where one was given back at the cursor takes that range again, as
it was)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Select, and_, func, literal, or_, select
from sqlalchemy.orm import Session

from coordinator.models import Island, Lease, ModuleStep, Path, PathModule, Run, Shard
from coordinator.services.runs import path_leases, run_schedule, tokens_per_lease
from coordinator.states import PENDING_LEASES, IslandStatus, LeaseStatus, StepStatus
from modules.cursor import fitting_steps


def stepping(path_id: object) -> Any:
    """Whether a module of the path has a step waiting for (or in) an executor: a lease then would train from
    weights about to change (held back until the step commits, which takes well under a lease's time)."""
    return (
        select(ModuleStep.id)
        .join(PathModule, PathModule.module_id == ModuleStep.module_id)
        .where(PathModule.path_id == path_id, ModuleStep.status != StepStatus.DONE)
        .exists()
    )


def live_islands(island_id: int, now: datetime, live_s: float) -> Select[Any]:
    """Other islands that are active and heartbeated within `live_s`."""
    return select(Island.id).where(
        Island.id != island_id,
        Island.status == IslandStatus.ACTIVE,
        Island.last_heartbeat >= now - timedelta(seconds=live_s),
    )


def home_paths(run_id: int, islands: Any) -> Select[Any]:
    """The home path in the run of each island in `islands` (a select of island ids): the path of its latest
    lease that was not shared."""
    latest = (
        select(func.max(Lease.id))
        .where(Lease.run_id == run_id, Lease.island_id.in_(islands), Lease.shared.is_(False))
        .group_by(Lease.island_id)
    )
    return select(Lease.path_id).where(Lease.id.in_(latest))


def home_path(session: Session, run_id: int, island_id: int) -> int | None:
    return session.scalar(home_paths(run_id, select(literal(island_id))))


def wrap_range(offset: int, epoch: int, need: int, num_tokens: int) -> tuple[int, int, int]:
    """(start, end, epoch) of a range of `need` tokens from the cursor; when the rest of the shard is too short
    for it, from the start of the next epoch."""
    if offset + need > num_tokens:
        offset, epoch = 0, epoch + 1
    return offset, offset + need, epoch


@dataclass(frozen=True, slots=True)
class Claim:
    """A lease past its path's cursor that holds its token range: pending, or accepted out of order."""

    epoch: int
    start: int
    end: int
    submitted: bool


def _claims(session: Session, path: Path, *, now: datetime) -> list[Claim]:
    rows = session.execute(
        select(Lease.epoch, Lease.token_start, Lease.token_end, Lease.status)
        .where(
            Lease.path_id == path.id,
            or_(
                Lease.status == LeaseStatus.SUBMITTED,
                and_(Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now),
            ),
            or_(Lease.epoch > path.epoch, and_(Lease.epoch == path.epoch, Lease.token_start >= path.token_offset)),
        )
        .order_by(Lease.epoch, Lease.token_start)
    ).all()
    return [Claim(epoch, start, end, status == LeaseStatus.SUBMITTED) for epoch, start, end, status in rows]


def _given_back(session: Session, path_id: int, epoch: int, start: int, *, now: datetime) -> Any:
    """The latest lease of the path that started at `start` in `epoch` and gave its range back (expired,
    released, or past its expiry and not marked yet): (round, inner_steps, first_step, token_end), or None."""
    return session.execute(
        select(Lease.round, Lease.inner_steps, Lease.first_step, Lease.token_end)
        .where(Lease.path_id == path_id, Lease.epoch == epoch, Lease.token_start == start)
        .where(
            or_(
                Lease.status.in_((LeaseStatus.EXPIRED, LeaseStatus.RELEASED)),
                and_(Lease.status.in_(PENDING_LEASES), Lease.expires_at < now),
            )
        )
        .order_by(Lease.id.desc())
        .limit(1)
    ).first()


def _walk(
    session: Session, path: Path, claims: list[Claim], *, now: datetime, submitted_only: bool = False
) -> tuple[int, int, Claim | None]:
    """The cursor moved over the claims that continue it, in order (with `submitted_only`, accepted ones only),
    and the first claim that does not, or None. A claim continues the cursor when it starts where the cursor
    stands (the last target token of a range is the next one's first input), or at the start of a later epoch
    when no range given back starts at the cursor (the rest of the cursor's epoch was left out: too short for
    the lease that wrapped)."""
    epoch, offset = path.epoch, path.token_offset
    for claim in claims:
        if submitted_only and not claim.submitted:
            return epoch, offset, claim
        here = claim.epoch == epoch and claim.start == offset
        wraps = claim.epoch > epoch and claim.start == 0
        if not here and not (wraps and _given_back(session, path.id, epoch, offset, now=now) is None):
            return epoch, offset, claim
        epoch, offset = claim.epoch, claim.end - 1
    return epoch, offset, None


def advance_cursor(session: Session, path_id: int, *, now: datetime) -> tuple[int, int]:
    """(epoch, token_offset) of the path once its accepted claims are counted (the caller has just marked one
    submitted, flushed): the row is locked first, so two uploads on one path advance it one after the other."""
    path = session.scalar(
        select(Path).where(Path.id == path_id).with_for_update().execution_options(populate_existing=True)
    )
    assert path is not None
    epoch, offset, _ = _walk(session, path, _claims(session, path, now=now), now=now, submitted_only=True)
    return epoch, offset


@dataclass(frozen=True, slots=True)
class Span:
    """A lease's place on its path: token range, epoch, round number (unique per path), H, and its first global
    inner step (the path's steps before the range: accepted and leased ones, for the LR schedule)."""

    start: int
    end: int
    epoch: int
    round: int
    steps: int
    first_step: int
    shared: bool


@dataclass(frozen=True, slots=True)
class _Candidate:
    path_id: int
    index: int
    held: int
    progress: int
    """Inner steps accepted or leased."""
    home: bool


def plan_lease(
    session: Session,
    run: Run,
    island_id: int,
    *,
    now: datetime,
    budget: int,
    wanted: int,
    live_s: float | None,
    through: int | None = None,
) -> tuple[Path, Span] | None:
    """The path and span of the island's next lease in an all-async run, or None when no path may take one.

    A path may take a lease while its inner steps (accepted or leased) are under `budget`, no module of it is
    stepping (but `through`, the path an overlap lease may train through its steps: `leases.grant_through`), and
    fewer than `path_leases` leases hold it; a free path that is another live island's home
    (heartbeat within `live_s`; None: no reservation) is kept for it. The island's home path comes
    first, unless a held path is behind it by more than `wanted` steps (one lease of the island), then the
    path that trained least; without a usable home, free paths before held ones."""
    share = path_leases(run)
    held = {
        path_id: (int(count), int(steps))
        for path_id, count, steps in session.execute(
            select(Lease.path_id, func.count(), func.sum(func.coalesce(Lease.inner_steps, run.inner_steps)))
            .where(Lease.run_id == run.id, Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now)
            .group_by(Lease.path_id)
        )
    }
    home = home_path(session, run.id, island_id)
    reserved = (
        set() if live_s is None else set(session.scalars(home_paths(run.id, live_islands(island_id, now, live_s))))
    )
    usable = ~stepping(Path.id) if through is None else or_(~stepping(Path.id), Path.id == through)
    candidates = []
    for path_id, index, done in session.execute(
        select(Path.id, Path.index, Path.steps_done)
        .where(Path.run_id == run.id, Path.steps_done < budget, usable)
        .order_by(Path.index)
    ):
        count, steps = held.get(path_id, (0, 0))
        if count >= share or done + steps >= budget or (count == 0 and path_id != home and path_id in reserved):
            continue
        candidates.append(_Candidate(path_id, index, count, done + steps, path_id == home))
    home_usable = any(c.home for c in candidates)

    def order(c: _Candidate) -> tuple[int, int, int]:
        if c.home:
            return c.progress, 0, c.index
        if c.held:
            return c.progress + wanted, 1, c.index  # helping: only when behind the home path by a lease
        return c.progress, 1, c.index

    for candidate in sorted((c for c in candidates if c.home or c.held or not home_usable), key=order):
        path = session.get_one(Path, candidate.path_id)
        span = _span(session, run, path, candidate, now=now, budget=budget, wanted=wanted)
        if span is not None:
            return path, span
    return None


def _span(
    session: Session, run: Run, path: Path, candidate: _Candidate, *, now: datetime, budget: int, wanted: int
) -> Span | None:
    """The path's next span: the first gap before its claims, else the range after them: when the rest of the
    shard is too short for it, the tail in fewer whole steps if at least `min_inner_steps` fit
    (`modules.cursor.fitting_steps`), else the next epoch's first."""
    epoch, offset, blocker = _walk(session, path, _claims(session, path, now=now), now=now)
    shared = candidate.held > 0
    if blocker is not None:
        return _gap(session, run, path, epoch, offset, blocker, now=now, shared=shared)
    steps = min(wanted, budget - candidate.progress)
    num_tokens = session.scalar(select(Shard.num_tokens).where(Shard.run_id == run.id, Shard.path_index == path.index))
    assert num_tokens is not None
    per_step = tokens_per_lease(run, 1) - 1
    min_steps = run_schedule(run).min_inner_steps
    fitted = fitting_steps(offset, length=num_tokens, steps=steps, per_step=per_step, min_steps=min_steps)
    if fitted:
        end = offset + tokens_per_lease(run, fitted)
        return Span(offset, end, epoch, _new_round(session, path), fitted, candidate.progress, shared)
    # A range given back at the cursor would be a gap before the next epoch's claims (`_walk` crosses into it
    # only where none was): issue it again as it was instead, so its round number stays its own.
    back = _given_back(session, path.id, epoch, offset, now=now)
    if back is not None:
        return _again(run, path, epoch, offset, back, shared=shared)
    start, end, epoch = wrap_range(offset, epoch, tokens_per_lease(run, steps), num_tokens)
    return Span(start, end, epoch, _new_round(session, path), steps, candidate.progress, shared)


def _again(run: Run, path: Path, epoch: int, start: int, found: Any, *, shared: bool) -> Span:
    """The range a lease gave back (`_given_back`'s row), issued again as it was: same range, H, round and first
    step."""
    round_, steps, first_step, end = found
    first = path.steps_done if first_step is None else first_step
    return Span(start, int(end), epoch, round_, steps or run.inner_steps, first, shared)


def _gap(
    session: Session, run: Run, path: Path, epoch: int, offset: int, blocker: Claim, *, now: datetime, shared: bool
) -> Span | None:
    """The range before `blocker`: a range given back at the cursor, issued again as it was (same range, H,
    round and first step); else the tokens up to the blocker (in the blocker's epoch when it starts a later one),
    as the given-back lease there or in whole steps (None when they are not whole steps, which no sequence of
    leases makes)."""
    at_cursor = _given_back(session, path.id, epoch, offset, now=now)
    if at_cursor is not None and (blocker.epoch > epoch or at_cursor[3] == blocker.start + 1):
        start, gap_epoch, end, found = offset, epoch, int(at_cursor[3]), at_cursor
    else:
        start, gap_epoch = (offset, epoch) if blocker.epoch == epoch else (0, blocker.epoch)
        end = blocker.start + 1
        found = _given_back(session, path.id, gap_epoch, start, now=now)
        if found is not None and found[3] != end:
            found = None
    if found is not None:
        return _again(run, path, gap_epoch, start, found, shared=shared)
    # Not one lease's range: an expired lease delivered late after its range was issued again with another H.
    # The gap is still whole inner steps (every range is H x batch x seq_len + 1 tokens): issue it as is.
    per_step = tokens_per_lease(run, 1) - 1
    steps, rest = divmod(end - 1 - start, per_step)
    if steps < 1 or rest:
        return None
    return Span(start, end, gap_epoch, _new_round(session, path), steps, path.steps_done, shared)


def _new_round(session: Session, path: Path) -> int:
    """A round number no pending or accepted lease of the path has: the path's count of accepted leases when
    they came in order (as before path sharing), else one past the highest."""
    highest = session.scalar(
        select(func.max(Lease.round)).where(
            Lease.path_id == path.id, Lease.status.in_((*PENDING_LEASES, LeaseStatus.SUBMITTED))
        )
    )
    return path.leases_done if highest is None else max(path.leases_done, highest + 1)


def reissued(session: Session, lease: Lease, *, now: datetime) -> int | None:
    """The lease that holds (pending, or accepted) part of an expired lease's token range, issued after it; such
    an expired lease may no longer deliver (its range would be trained twice)."""
    if lease.status != LeaseStatus.EXPIRED:
        return None
    return session.scalar(
        select(Lease.id)
        .where(
            Lease.path_id == lease.path_id,
            Lease.id > lease.id,
            Lease.epoch == lease.epoch,
            Lease.token_start < lease.token_end - 1,
            Lease.token_end - 1 > lease.token_start,
            or_(
                Lease.status == LeaseStatus.SUBMITTED,
                and_(Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now),
            ),
        )
        .order_by(Lease.id)
        .limit(1)
    )
