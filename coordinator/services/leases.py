"""Leases: a path of the current round handed to one island, with its token range and an expiry.

A path is free in a round when it has neither a submitted lease nor an active, unexpired one for that round. An
island is offered the path it trained last when that path is free (its inner optimizer state and cached weights
are warm), else the free path with the lowest index that is not reserved for another live island (see
`Affinity`). An expired lease frees its path for the same round; the path's data cursor only advances when a
contribution is accepted, so an expired lease gives its token range back.

When a round is applied, each live island that trained a path in it is offered that path for the next round
(`offer_next_round`): a lease in status `offered`, written in the apply transaction, that the island takes up
with its next lease request or that expires after `Affinity.reserve_s`. The apply also returns each offer's lease
view (`ReadyOffer`), so the process that made it takes offers up in batches without reading anything else
(`take_up_offers`); any other process uses `take_offer`. A round opening then costs one batch of inserts and a
few batched updates instead of every island queueing for the run row at once.

Lease requests are the coordinator's most frequent call, so each is a handful of statements: one to take an
offer, one to find the open rounds, one probe for a free path (no lock; idle islands polling for work stop
there), and only when a path is free, the run row locked and the choice made again under the lock. The dispatcher
runs them as a reader (`db.reading`) until then: on SQLite a lease request that finds no work never takes the
write lock (`db.start_writing` where it finds some).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Container
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import Select, and_, case, func, literal, or_, select, update
from sqlalchemy.orm import Session

from coordinator.db import start_writing
from coordinator.errors import Conflict, Forbidden, NotFound
from coordinator.models import (
    Contribution,
    Island,
    Lease,
    Level,
    Module,
    ModuleStep,
    ModuleVersion,
    Path,
    PathModule,
    Round,
    Run,
    Shard,
)
from coordinator.schemas import LeaseHeldout, LeaseModule, LeaseModules, LeasePublic, LeaseShard
from coordinator.services.events import ExpiredLease, add_lease_expiries
from coordinator.services.runs import inner_step_bounds, overlap, tokens_per_lease
from coordinator.services.sharing import Span, home_paths, live_islands, plan_lease, stepping, wrap_range
from coordinator.states import PENDING_LEASES, IslandStatus, LeaseStatus, RoundStatus, RunStatus, StepStatus
from coordinator.timeutil import as_utc
from coordinator.wakeups import WorkSignal


def expire_stale_leases(session: Session, *, now: datetime, run_id: int | None = None) -> int:
    """Mark active or offered leases past their expiry as expired, with an event each (the caller commits);
    returns how many.

    A cheap read first: most calls find nothing to expire and then write nothing (no row locks taken).
    """
    stale = [Lease.status.in_(PENDING_LEASES), Lease.expires_at < now]
    if run_id is not None:
        stale.append(Lease.run_id == run_id)
    if session.scalar(select(Lease.id).where(*stale).limit(1)) is None:
        return 0
    # what each was before (offer or lease) is read first; the UPDATE re-checks, and RETURNING names only the
    # rows this call changed, so a lease expired by two processes at once gets one event
    offered = set(session.scalars(select(Lease.id).where(*stale, Lease.status == LeaseStatus.OFFERED)))
    changed = session.execute(
        update(Lease)
        .where(*stale)
        .values(status=LeaseStatus.EXPIRED)
        .returning(Lease.id, Lease.run_id, Lease.island_id, Lease.round, Lease.path_id)
    ).all()
    indices = dict(session.execute(select(Path.id, Path.index).where(Path.id.in_({row[4] for row in changed}))).all())
    add_lease_expiries(
        session,
        (
            ExpiredLease(
                lease_id=lease_id,
                run_id=run,
                island_id=island,
                round=round_,
                path_index=indices[path_id],
                offered=lease_id in offered,
            )
            for lease_id, run, island, round_, path_id in changed
        ),
        now=now,
    )
    return len(changed)


def work_signature(session: Session, *, now: datetime, reserve_s: float) -> tuple[int | None, int, int, int, int]:
    """Changes here can free a path: a round opened (newest round id), a lease expired or was released, a
    round's reservation window ended (paths kept for other islands become free to all), a lease of a run with
    async levels was accepted, a step of an async module was created or committed."""
    newest_round = session.scalar(select(func.max(Round.id)))
    given_back = session.scalar(
        select(func.count()).select_from(Lease).where(Lease.status.in_((LeaseStatus.EXPIRED, LeaseStatus.RELEASED)))
    )
    reserving = session.scalar(
        select(func.count())
        .select_from(Round)
        .where(Round.status == RoundStatus.OPEN, Round.opened_at >= now - timedelta(seconds=reserve_s))
    )
    # async levels: an accepted lease frees its path, a committed step releases the paths held back for it
    accepted = session.scalar(
        select(func.sum(Path.leases_done))
        .join(Run, Run.id == Path.run_id)
        .where(Run.status == RunStatus.RUNNING, Run.schedule != "round")
    )
    # only steps of async modules hold paths back; a closing round's steps are seen when its successor opens (all
    # of a round's waiting islands would otherwise query the database at each of its steps, during the apply)
    steps = session.scalar(
        select(func.count())
        .select_from(ModuleStep)
        .join(Module, Module.id == ModuleStep.module_id)
        .where(ModuleStep.status != StepStatus.DONE, Module.period_size.is_not(None))
    )
    return newest_round, int(given_back or 0), int(reserving or 0), int(accepted or 0), int(steps or 0)


@dataclass(frozen=True, slots=True)
class Affinity:
    """Keep paths with the island that trained them last (its AdamW state and caches are warm there).

    For `reserve_s` seconds after a round opens, a free path whose last island is another live island (active,
    heartbeated within `live_s`) is kept for that island; afterwards any island may take it, so a slow or silent
    island delays a round by at most `reserve_s`. 0 disables the reservation (the preference stays).
    """

    reserve_s: float = 10.0
    live_s: float = 30.0


@dataclass(frozen=True, slots=True)
class OpenRound:
    """The current round of a running run, as lease requests see it."""

    run_id: int
    number: int
    opened_at: datetime | None
    deadline: datetime | None
    open: bool = True
    """False while the round is closing (its modules being stepped): no leases, the next round comes soon."""
    schedule: str = "round"
    """`Run.schedule`: round, hybrid, or async (no rounds: `number` is unused, each path leases on its own)."""

    @property
    def free(self) -> bool:
        return self.schedule == "async"


def open_rounds(session: Session) -> list[OpenRound]:
    """Current rounds of the running runs, oldest run first (one statement). A run past its last round (its
    async modules still stepping) has none; an all-async run has one that stands for all its paths."""
    rows = session.execute(
        select(Run.id, Run.current_round, Run.num_rounds, Run.schedule, Round.opened_at, Round.deadline, Round.status)
        .join(Round, and_(Round.run_id == Run.id, Round.number == Run.current_round), isouter=True)
        .where(Run.status == RunStatus.RUNNING)
        .order_by(Run.id)
    ).all()
    return [
        OpenRound(
            run_id=run_id,
            number=number,
            opened_at=as_utc(opened) if opened is not None else None,
            deadline=as_utc(deadline) if deadline is not None else None,
            open=status != RoundStatus.CLOSING,
            schedule=schedule,
        )
        for run_id, number, num_rounds, schedule, opened, deadline, status in rows
        if schedule == "async" or number < num_rounds
    ]


def _free_path_query(rnd: OpenRound, island_id: int, *, now: datetime, affinity: Affinity) -> Select[Path]:
    """Paths of the round that are free for this island: its warm path first, then by index."""
    busy = select(Lease.path_id).where(
        Lease.run_id == rnd.run_id,
        Lease.round == rnd.number,
        or_(Lease.status == LeaseStatus.SUBMITTED, and_(Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now)),
    )
    query = select(Path).where(Path.run_id == rnd.run_id, Path.id.not_in(busy))
    if rnd.schedule != "round":
        query = query.where(~stepping(Path.id))
    opened = rnd.opened_at
    if affinity.reserve_s > 0 and opened is not None and now < opened + timedelta(seconds=affinity.reserve_s):
        others = live_islands(island_id, now, affinity.live_s)
        query = query.where(or_(Path.last_island_id.is_(None), Path.last_island_id.not_in(others)))
    warm_first = case((Path.last_island_id == island_id, 0), else_=1)
    return query.order_by(warm_first, Path.index).limit(1)


def _choose_locked(
    session: Session, run: Run, rnd: OpenRound, island_id: int, *, now: datetime, affinity: Affinity
) -> tuple[Path, tuple[LeaseShard, LeaseHeldout | None], bool] | None:
    """Under the run lock, in one statement: the free path to lease (`_free_path_query` again), its shard's view
    (`SHARD_VIEW`), and whether the run has stale pending leases to mark expired; None when no path is free or
    the round is no longer open (a close marks it closing under the run lock, so this read sees it)."""
    still_open = (
        select(Round.id)
        .where(Round.run_id == rnd.run_id, Round.number == rnd.number, Round.status == RoundStatus.OPEN)
        .exists()
    )
    stale = (
        select(Lease.id)
        .where(Lease.run_id == rnd.run_id, Lease.status.in_(PENDING_LEASES), Lease.expires_at < now)
        .exists()
    )
    row = session.execute(
        _free_path_query(rnd, island_id, now=now, affinity=affinity)
        .add_columns(*SHARD_VIEW, stale)
        .join(Shard, and_(Shard.run_id == Path.run_id, Shard.path_index == Path.index))
        .where(still_open)
    ).one_or_none()
    if row is None:
        return None
    path, *shard, has_stale = row
    return path, _shard_view(run, *shard), bool(has_stale)


def _own_path_stepping(session: Session, run_id: int, island_id: int, budget: int, *, through: int | None) -> bool:
    """Whether the island's home path in the run still has steps to train but waits for a module step: the
    island then waits for it (well under a lease's time) rather than taking another path cold; not when it may
    train through the step (`through` is that path, `grant_through`)."""
    own = home_paths(run_id, select(literal(island_id))).scalar_subquery()
    held = select(Path.id).where(Path.id == own, Path.steps_done < budget, stepping(Path.id))
    if through is not None:
        held = held.where(Path.id != through)
    return session.scalar(held) is not None


def acquire_lease(
    session: Session,
    island_id: int,
    rounds: list[OpenRound],
    *,
    now: datetime,
    affinity: Affinity = Affinity(),
    max_leases: int = 1,
) -> tuple[LeasePublic | None, int]:
    """Issue a lease on a free path of one of `rounds` (see `open_rounds`) and commit; (None, 0) when no path is
    free. The int is the number of stale leases marked expired on the way.

    Free paths are probed without a lock; only when one exists is the run row locked and the choice made again,
    so idle islands polling for work never queue behind each other. An island holds at most `max_leases` leases
    at once, fewer when its capabilities say so (`island_capacity`): one more is refused with 409.
    """
    for rnd in rounds:
        if rnd.free:
            issued = _acquire_free(session, island_id, rnd, now=now, max_leases=max_leases, affinity=affinity)
            if issued is not None:
                return issued
            continue
        if not rnd.open:
            continue  # closing: its paths are done, the next round opens once the executors apply it
        probe = _free_path_query(rnd, island_id, now=now, affinity=affinity).with_only_columns(Path.id)
        if session.scalar(probe) is None:
            continue
        # FOR NO KEY UPDATE: grants queue behind each other and behind a close (FOR UPDATE), not behind uploads
        # (FOR KEY SHARE, `uploads._record`)
        start_writing(session)
        run = session.scalar(
            select(Run)
            .where(Run.id == rnd.run_id)
            .with_for_update(key_share=True)
            .execution_options(populate_existing=True)
        )
        if run is None or run.status != RunStatus.RUNNING or run.current_round != rnd.number:
            session.rollback()
            continue
        chosen = _choose_locked(session, run, rnd, island_id, now=now, affinity=affinity)
        if chosen is None:  # taken meanwhile, or the round began closing
            session.rollback()
            continue
        path, shard, stale = chosen
        expired = expire_stale_leases(session, now=now, run_id=run.id) if stale else 0
        _check_capacity(session, island_id, now=now, max_leases=max_leases)
        lease = _issue(session, run, path, island_id, now=now, shard=shard)
        session.commit()
        return lease, expired
    session.rollback()
    return None, 0


def _acquire_free(
    session: Session,
    island_id: int,
    rnd: OpenRound,
    *,
    now: datetime,
    max_leases: int,
    affinity: Affinity,
) -> tuple[LeasePublic, int] | None:
    """A lease of an all-async run (committed): the same probe-then-lock as a round's, on the path's own count
    (`sharing.plan_lease` chooses the path and span). With affinity on, an island whose home path waits for a
    module step waits too (`_own_path_stepping`); only its upload's reply may train through the step
    (`grant_through`)."""
    run = session.get(Run, rnd.run_id)
    if run is None:
        return None
    plan = _free_planner(session, run, island_id, now=now, affinity=affinity)
    if plan is None or plan(run) is None:  # the probe spares idle islands the lock
        session.rollback()
        return None
    start_writing(session)
    run = session.scalar(
        select(Run).where(Run.id == rnd.run_id).with_for_update().execution_options(populate_existing=True)
    )
    if run is None or run.status != RunStatus.RUNNING:
        session.rollback()
        return None
    expired = expire_stale_leases(session, now=now, run_id=run.id)
    planned = plan(run)
    if planned is None:
        session.rollback()
        return None
    _check_capacity(session, island_id, now=now, max_leases=max_leases)
    path, span = planned
    lease = _issue(session, run, path, island_id, now=now, span=span)
    session.commit()
    return lease, expired


def _free_planner(
    session: Session, run: Run, island_id: int, *, now: datetime, affinity: Affinity, through: int | None = None
) -> Callable[[Run], tuple[Path, Span] | None] | None:
    """`sharing.plan_lease` for the island in an all-async run, bound to everything but the run row (read again
    under the lock); None when, with affinity on, the island's home path waits for a module step and so does the
    island (`_own_path_stepping`; not when it may train through that step, `through`)."""
    budget = run.num_rounds * run.inner_steps
    if affinity.reserve_s > 0 and _own_path_stepping(session, run.id, island_id, budget, through=through):
        return None
    live_s = affinity.live_s if affinity.reserve_s > 0 else None
    wanted = lease_steps(session, run, island_id)
    return functools.partial(
        plan_lease, session, island_id=island_id, now=now, budget=budget, wanted=wanted, live_s=live_s, through=through
    )


def grant_through(
    session: Session, run: Run, island_id: int, path_id: int, *, now: datetime, affinity: Affinity, max_leases: int
) -> LeasePublic | None:
    """The island's next lease, inside the transaction of its accepted upload on `path_id` (`uploads._record`,
    which holds the run row as a lease grant does: FOR UPDATE), in a run with `overlap`: that path may be leased
    while module steps are due on it (whoever's upload made them due), against the versions those steps will
    make (`_modules(ahead=True)`: those modules come without weights; the island trains on from its own end
    weights of the path and fetches them from `lease_modules` when they land); else as a lease request would.
    The lease is committed with the upload: one transaction and one wait for the log, not two (docs/LOG.md
    2026-12-07). Flushed, not committed; None, with nothing written, when the run does not overlap, the island
    may hold no more leases or is no longer active, or no path is free."""
    if run.status != RunStatus.RUNNING or run.schedule != "async" or not overlap(run):
        return None
    plan = _free_planner(session, run, island_id, now=now, affinity=affinity, through=path_id)
    if plan is None:
        return None
    status, holding, allowed = _holding(session, island_id, now=now, max_leases=max_leases)
    if status != IslandStatus.ACTIVE or holding >= allowed:
        return None
    planned = plan(run)
    if planned is None:
        return None
    path, span = planned
    return _issue(session, run, path, island_id, now=now, span=span, ahead=True)


def lease_modules(session: Session, lease_id: int, island_id: int) -> LeaseModules:
    """The modules of the island's pending lease at its base versions, each with its weights once that version
    exists (`LeaseModules.ready` when all do). 404 for an unknown lease, 403 for another island's, 409 once it
    is no longer pending."""
    lease = get_lease(session, lease_id)
    if lease.island_id != island_id:
        raise Forbidden(f"lease {lease_id} belongs to island {lease.island_id}, not island {island_id}")
    if lease.status not in PENDING_LEASES:
        raise Conflict(f"lease {lease_id} is {lease.status.value}: its modules are no longer served to it")
    bases = {int(k): int(v) for k, v in lease.base_versions.items()}
    hashes = {
        module_id: digest
        for module_id, version, digest in session.execute(
            select(ModuleVersion.module_id, ModuleVersion.version, ModuleVersion.weights_hash).where(
                ModuleVersion.module_id.in_(list(bases)), ModuleVersion.version.in_(set(bases.values()))
            )
        )
        if bases.get(module_id) == version
    }
    modules = [
        LeaseModule(level=level, level_name=name, module_id=mid, version=bases[mid], weights_hash=hashes.get(mid))
        for mid, level, name in session.execute(
            select(Module.id, Module.level_index, Level.name)
            .join(PathModule, PathModule.module_id == Module.id)
            .join(Level, Level.id == Module.level_id)
            .where(PathModule.path_id == lease.path_id)
            .order_by(Module.level_index)
        )
    ]
    return LeaseModules(lease_id=lease.id, ready=all(m.weights_hash is not None for m in modules), modules=modules)


RECENT_LEASES = 3
"""Dynamic local updates: an island's speed is measured over its last this many accepted leases of the run."""


def lease_steps(session: Session, run: Run, island_id: int) -> int:
    """H of the island's next lease: the run's, or with dynamic local updates (min/max_inner_steps) scaled by
    the island's speed relative to the median island of the run, so that leases take about the same wall time.

    Speed: tokens per second of wall time from lease to accepted upload over the island's last
    `RECENT_LEASES` leases of the run; an island with none yet is compared by its join probe
    (`capabilities.tokens_per_s`) to the median probe of the run's other islands (`_probes`)."""
    low, high = inner_step_bounds(run)
    if low == high:
        return run.inner_steps
    speeds = _recent_speeds(session, run)
    if island_id in speeds:
        ratio = speeds[island_id] / statistics.median(speeds.values())
    else:
        probes = _probes(session, run.id, island_id)
        own = probes.pop(island_id, None)
        ratio = own / statistics.median(probes.values()) if own and probes else 1.0
    return max(low, min(high, round(run.inner_steps * ratio)))


def _recent_speeds(session: Session, run: Run) -> dict[int, float]:
    """island id -> tokens/s over its last `RECENT_LEASES` accepted leases of the run (recent leases only).

    The tokens are the lease's own (its H x batch x seq_len, what the coordinator handed out), not the count the
    island sent with its upload: that one is the island's word (a client may send 0, or any number, where the
    run's weighting does not use it), and an island's H must not follow what it says of itself."""
    per_step = run.config["inner"]["batch_size"] * run.config["model"]["seq_len"]
    rows = session.execute(
        select(
            Lease.island_id, func.coalesce(Lease.inner_steps, run.inner_steps), Lease.issued_at, Contribution.created_at
        )
        .join(Contribution, Contribution.lease_id == Lease.id)
        .where(Lease.run_id == run.id)
        .order_by(Contribution.id.desc())
        .limit(64)
    ).all()
    tokens: dict[int, float] = {}
    seconds: dict[int, float] = {}
    seen: dict[int, int] = {}
    for island, steps, issued, done in rows:
        if seen.get(island, 0) >= RECENT_LEASES:
            continue
        seen[island] = seen.get(island, 0) + 1
        tokens[island] = tokens.get(island, 0.0) + steps * per_step
        seconds[island] = seconds.get(island, 0.0) + max((as_utc(done) - as_utc(issued)).total_seconds(), 1e-3)
    return {island: tokens[island] / seconds[island] for island in tokens if tokens[island] > 0}


def _probes(session: Session, run_id: int, island_id: int) -> dict[int, float]:
    """island id -> `capabilities.tokens_per_s` of this island and of the run's other active islands: those that
    have leased in the run, and those that have leased in none yet (they take this run's work as soon as any).

    The probe times the same reference model (the debug flavour) on every island, so probes compare devices
    whatever the runs' model sizes. But an island that has only ever worked on other runs is left out: islands
    serve the oldest run first and keep their home paths, so one coordinator's runs can be trained by different
    islands (the GPUs on one, the CPUs on another), and another run's islands would set this run's median, e.g.
    every CPU island's first lease cut to `min_inner_steps` against GPUs that never lease here."""
    leased = select(Lease.run_id).where(Lease.island_id == Island.id)
    here = leased.where(Lease.run_id == run_id).exists()
    probes: dict[int, float] = {}
    for island, capabilities in session.execute(
        select(Island.id, Island.capabilities).where(
            or_(Island.id == island_id, and_(Island.status == IslandStatus.ACTIVE, or_(here, ~leased.exists())))
        )
    ):
        value = capabilities.get("tokens_per_s") if isinstance(capabilities, dict) else None
        if isinstance(value, int | float) and value > 0:
            probes[island] = float(value)
    return probes


class OfferPending(Conflict):
    """Raised instead of the capacity refusal when what fills the island's slots includes an offer made to it: the
    round before closed between the request's look for an offer (`take_offer`) and its grant, and the offer is
    the answer (`LeaseDispatcher` takes it). Only reaches a client if that offer is gone again by then."""


def _holding(session: Session, island_id: int, *, now: datetime, max_leases: int) -> tuple[IslandStatus, int, int]:
    """The island's status, how many leases it holds now, and how many it may (its claimed `max_leases`, within
    the coordinator's), in one statement."""
    pending = [Lease.island_id == island_id, Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now]
    count = select(func.count(Lease.id)).where(*pending).scalar_subquery()
    capabilities, status, holding = session.execute(
        select(Island.capabilities, Island.status, count).where(Island.id == island_id)
    ).one()
    claimed = capabilities.get("max_leases", 1) if isinstance(capabilities, dict) else 1
    return status, holding, max(1, min(max_leases, claimed if isinstance(claimed, int) else 1))


def _check_capacity(session: Session, island_id: int, *, now: datetime, max_leases: int) -> None:
    """Refuse (409, after a rollback) a lease to an island that already holds as many as it may (its claimed
    `max_leases` and the count of its pending leases in one statement; their ids only for the refusal), or that
    is no longer active (it left or was revoked while its request was held waiting for work).
    `OfferPending` when one of them is an offer it has not taken yet."""
    status, holding, allowed = _holding(session, island_id, now=now, max_leases=max_leases)
    if status != IslandStatus.ACTIVE:
        session.rollback()
        raise Conflict(f"island {island_id} has status {status}: it gets no lease (join again for a new island)")
    if holding >= allowed:
        pending = [Lease.island_id == island_id, Lease.status.in_(PENDING_LEASES), Lease.expires_at >= now]
        rows = session.execute(select(Lease.id, Lease.status).where(*pending).order_by(Lease.id)).all()
        session.rollback()
        held = [lease_id for lease_id, _ in rows]
        offered = [lease_id for lease_id, status in rows if status == LeaseStatus.OFFERED]
        if offered:
            raise OfferPending(f"island {island_id} has an offer waiting (lease {offered[0]}); ask again to take it")
        listed = ", ".join(str(lease_id) for lease_id in held)
        raise Conflict(
            f"island {island_id} already holds {len(held)} lease(s) ({listed}), as many as it may at once; "
            "upload or release one first"
        )


def next_change(session: Session, rounds: list[OpenRound], *, now: datetime, affinity: Affinity) -> datetime | None:
    """When time alone may next bring work in `rounds` (a pending lease expiring, a reservation window ending, a
    deadline that may close a round on quorum); None when only an event (an upload closing a round, a release)
    can. An island that found no free path need not look again before then unless told of such an event."""
    times = [r.deadline for r in rounds if r.deadline is not None and r.deadline > now]
    if affinity.reserve_s > 0:
        window = timedelta(seconds=affinity.reserve_s)
        times += [r.opened_at + window for r in rounds if r.opened_at is not None and r.opened_at + window > now]
    expiry = session.scalar(
        select(func.min(Lease.expires_at)).where(
            or_(
                *(
                    Lease.run_id == r.run_id if r.free else and_(Lease.run_id == r.run_id, Lease.round == r.number)
                    for r in rounds
                )
            ),  # fmt: skip
            Lease.status.in_(PENDING_LEASES),
            Lease.expires_at >= now,
        )
    )
    if expiry is not None:
        times.append(as_utc(expiry))
    return min(times, default=None)


def _token_range(run: Run, path: Path, num_tokens: int) -> tuple[int, int, int]:
    """(start, end, epoch) of the path's next lease of the run's H: its data cursor, wrapping into a new epoch."""
    return wrap_range(path.token_offset, path.epoch, tokens_per_lease(run), num_tokens)


SHARD_VIEW = (Shard.id, Shard.tokens_hash, Shard.num_tokens, Shard.heldout_hash, Shard.heldout_tokens)
"""What a lease view needs of a shard row (`_shard_view`)."""


def _shard(session: Session, run: Run, path_index: int) -> tuple[LeaseShard, LeaseHeldout | None]:
    row = session.execute(select(*SHARD_VIEW).where(Shard.run_id == run.id, Shard.path_index == path_index)).one()
    return _shard_view(run, *row)


def _shard_view(
    run: Run, shard_id: int, tokens_hash: str, num_tokens: int, heldout_hash: str | None, heldout_tokens: int | None
) -> tuple[LeaseShard, LeaseHeldout | None]:
    """The lease's shard, and its held-out slice when the path has one and the run scores it."""
    shard = LeaseShard(shard_id=shard_id, tokens_hash=tokens_hash, num_tokens=num_tokens)
    score = int(run.config.get("heldout_tokens", 0))
    if heldout_hash is None or not heldout_tokens or score <= 0:
        return shard, None
    heldout = LeaseHeldout(
        shard_id=shard_id,
        tokens_hash=heldout_hash,
        num_tokens=heldout_tokens,
        score_tokens=min(score, heldout_tokens),
    )
    return shard, heldout


def _modules(session: Session, path_id: int, *, ahead: bool = False) -> list[LeaseModule]:
    """The path's modules at their current versions, by level; with `ahead`, an async module whose steps are due
    at the version they will make (its period), without weights (an overlap lease, `grant_through`)."""
    modules = []
    for module_id, level, version, weights, name, period, period_size in session.execute(
        select(
            Module.id,
            Module.level_index,
            Module.version,
            Module.weights_hash,
            Level.name,
            Module.period,
            Module.period_size,
        )
        .join(PathModule, PathModule.module_id == Module.id)
        .join(Level, Level.id == Module.level_id)
        .where(PathModule.path_id == path_id)
        .order_by(Module.level_index)
    ):
        pending = ahead and period_size is not None and period > version
        modules.append(
            LeaseModule(
                level=level,
                level_name=name,
                module_id=module_id,
                version=period if pending else version,
                weights_hash=None if pending else weights,
            )
        )
    return modules


def _new_lease(
    run: Run,
    path: Path,
    island_id: int,
    *,
    num_tokens: int,
    base_versions: dict[str, int],
    status: LeaseStatus,
    expires: datetime,
    now: datetime,
    span: Span | None = None,
) -> Lease:
    """A lease for modules at `base_versions`: on the path's next token range of a shard of `num_tokens`, in the
    run's current round, with the run's H; or (an all-async run) on `span` (`sharing.plan_lease`)."""
    if span is None:
        start, end, epoch = _token_range(run, path, num_tokens)
        span = Span(start, end, epoch, run.current_round, run.inner_steps, run.current_round * run.inner_steps, False)
        steps = None
    else:
        steps = span.steps
    return Lease(
        run_id=run.id,
        island_id=island_id,
        path_id=path.id,
        round=span.round,
        status=status,
        base_versions=base_versions,
        token_start=span.start,
        token_end=span.end,
        epoch=span.epoch,
        issued_at=now,
        expires_at=expires,
        inner_steps=steps,
        first_step=None if steps is None else span.first_step,
        shared=span.shared,
    )


def _public(
    run: Run,
    path: Path,
    lease: Lease,
    shard: tuple[LeaseShard, LeaseHeldout | None],
    modules: list[LeaseModule],
) -> LeasePublic:
    first_step = lease.first_step if lease.first_step is not None else lease.round * run.inner_steps
    return LeasePublic(
        lease_id=lease.id,
        run_id=run.id,
        round=lease.round,
        path_id=path.id,
        path_index=path.index,
        model=run.config["model"],
        inner=run.config["inner"],
        inner_steps=lease.inner_steps or run.inner_steps,
        first_step=first_step,
        modules=modules,
        shard=shard[0],
        heldout=shard[1],
        token_start=lease.token_start,
        token_end=lease.token_end,
        epoch=lease.epoch,
        seed=run.seed * 1_000_003 + lease.round * 1_009 + path.index,
        codec=run.config.get("codec", "fp32"),
        sparse_rows=run.config.get("sparse_rows", False),
        expires_at=as_utc(lease.expires_at),
        status=LeaseStatus.ACTIVE,
    )


def _issue(
    session: Session,
    run: Run,
    path: Path,
    island_id: int,
    *,
    now: datetime,
    span: Span | None = None,
    shard: tuple[LeaseShard, LeaseHeldout | None] | None = None,
    ahead: bool = False,
) -> LeasePublic:
    """Insert a lease of `path` for the island (flushed, not committed) and return its view; `shard` when the
    caller read it already (`_choose_locked`); `ahead` as in `_modules`."""
    if shard is None:
        shard = _shard(session, run, path.index)
    modules = _modules(session, path.id, ahead=ahead)
    expires = now + timedelta(seconds=run.lease_ttl_s)
    versions = {str(m.module_id): m.version for m in modules}
    pending = [m.module_id for m in modules if m.weights_hash is None]
    lease = _new_lease(
        run,
        path,
        island_id,
        num_tokens=shard[0].num_tokens,
        base_versions=versions,
        status=LeaseStatus.ACTIVE,
        expires=expires,
        now=now,
        span=span,
    )
    lease.pending_modules = pending or None
    session.add(lease)
    session.flush()
    return _public(run, path, lease, shard, modules)


@dataclass(frozen=True, slots=True)
class ReadyOffer:
    """An offer as its island will receive it, built by the apply that made it (see `take_up_offers`)."""

    island_id: int
    lease_id: int
    lease_ttl_s: float
    lease: LeasePublic
    """The lease view; `expires_at` is set when the offer is taken up."""


def offer_next_round(session: Session, run: Run, *, now: datetime, affinity: Affinity) -> list[ReadyOffer]:
    """Offer each live island one path it trained last (the lowest index) for the run's new current round.

    Called inside the apply transaction, after the module versions moved on (the caller commits). An offer
    holds its path for `affinity.reserve_s`, like the reservation it replaces for that island; heartbeats do
    not extend it. Returns the offers made (none when the reservation is disabled), each with the lease view
    its island will receive, so that taking one up needs no further reads.
    """
    if affinity.reserve_s <= 0:
        return []
    live = select(Island.id).where(
        Island.status == IslandStatus.ACTIVE, Island.last_heartbeat >= now - timedelta(seconds=affinity.live_s)
    )
    chosen: dict[int, Path] = {}
    for path in session.scalars(
        select(Path).where(Path.run_id == run.id, Path.last_island_id.in_(live)).order_by(Path.index)
    ):
        assert path.last_island_id is not None
        chosen.setdefault(path.last_island_id, path)
    if not chosen:
        return []
    shards, modules = _views(session, run, list(chosen.values()))
    expires = now + timedelta(seconds=affinity.reserve_s)
    offers = {
        island_id: _new_lease(
            run,
            path,
            island_id,
            num_tokens=shards[path.index][0].num_tokens,
            base_versions={str(m.module_id): m.version for m in modules[path.id]},
            status=LeaseStatus.OFFERED,
            expires=expires,
            now=now,
        )
        for island_id, path in chosen.items()
    }
    session.add_all(offers.values())
    session.flush()  # lease ids
    return [
        ReadyOffer(
            island_id=island_id,
            lease_id=lease.id,
            lease_ttl_s=run.lease_ttl_s,
            lease=_public(run, chosen[island_id], lease, shards[chosen[island_id].index], modules[lease.path_id]),
        )
        for island_id, lease in offers.items()
    ]


def _views(
    session: Session, run: Run, paths: list[Path]
) -> tuple[dict[int, tuple[LeaseShard, LeaseHeldout | None]], dict[int, list[LeaseModule]]]:
    """What lease views of `paths` need, in two statements: the run's shards by path index, and each path's
    modules at their current versions (by path id, in level order)."""
    shards = {
        index: _shard_view(run, shard_id, tokens_hash, n, heldout_hash, heldout_n)
        for index, shard_id, tokens_hash, n, heldout_hash, heldout_n in session.execute(
            select(Shard.path_index, *SHARD_VIEW).where(Shard.run_id == run.id)
        )
    }
    modules: dict[int, list[LeaseModule]] = {path.id: [] for path in paths}
    for path_id, module_id, level, version, weights, name in session.execute(
        select(PathModule.path_id, Module.id, Module.level_index, Module.version, Module.weights_hash, Level.name)
        .join(Module, Module.id == PathModule.module_id)
        .join(Level, Level.id == Module.level_id)
        .where(PathModule.path_id.in_(list(modules)))
        .order_by(PathModule.path_id, Module.level_index)
    ):
        modules[path_id].append(
            LeaseModule(level=level, level_name=name, module_id=module_id, version=version, weights_hash=weights)
        )
    return shards, modules


def pending_offers(session: Session, *, now: datetime, known: Container[int] = ()) -> list[ReadyOffer]:
    """Every offer of a running run's current round not yet taken up or run out, with its lease view: those
    another process's apply made (an `apply-worker`, another worker or replica) or made before a restart, for
    this process's `OfferBook`; offers whose lease id is in `known` (the book's) are left out before any view is
    built. One read of the offers, then two per run with offers left (`_views`)."""
    rows = session.execute(
        select(Lease, Run, Path)
        .join(Run, Run.id == Lease.run_id)
        .join(Path, Path.id == Lease.path_id)
        .where(
            Lease.status == LeaseStatus.OFFERED,
            Lease.expires_at >= now,
            Run.status == RunStatus.RUNNING,
            Lease.round == Run.current_round,
        )
        .order_by(Lease.id)
    ).all()
    by_run: dict[int, tuple[Run, list[tuple[Lease, Path]]]] = {}
    for lease, run, path in rows:
        if lease.id not in known:
            by_run.setdefault(run.id, (run, []))[1].append((lease, path))
    ready: list[ReadyOffer] = []
    for run, offered in by_run.values():
        shards, modules = _views(session, run, [path for _, path in offered])
        ready.extend(
            ReadyOffer(
                island_id=lease.island_id,
                lease_id=lease.id,
                lease_ttl_s=run.lease_ttl_s,
                lease=_public(run, path, lease, shards[path.index], modules[path.id]),
            )
            for lease, path in offered
        )
    return ready


def take_up_offers(session: Session, offers: list[ReadyOffer], *, now: datetime) -> list[LeasePublic | None]:
    """Turn offers built by this process's applies into active leases (committed): one UPDATE per lease TTL.

    An offer that expired, was released or whose round closed meanwhile is not taken (None in its place); the
    caller then asks the database the slow way (`take_offer`), which also marks such an offer expired.
    """
    by_ttl: dict[float, list[int]] = {}
    for offer in offers:
        by_ttl.setdefault(offer.lease_ttl_s, []).append(offer.lease_id)
    current = select(Run.current_round).where(Run.id == Lease.run_id, Run.status == RunStatus.RUNNING).scalar_subquery()
    taken: set[int] = set()
    for ttl, ids in by_ttl.items():
        taken.update(
            session.scalars(
                update(Lease)
                .where(
                    Lease.id.in_(ids),
                    Lease.status == LeaseStatus.OFFERED,
                    Lease.expires_at >= now,
                    Lease.round == current,
                )
                .values(status=LeaseStatus.ACTIVE, expires_at=now + timedelta(seconds=ttl))
                .returning(Lease.id),
                execution_options={"synchronize_session": False},
            )
        )
    session.commit()
    return [
        offer.lease.model_copy(update={"expires_at": now + timedelta(seconds=offer.lease_ttl_s)})
        if offer.lease_id in taken
        else None
        for offer in offers
    ]


def take_offer(session: Session, island_id: int, *, now: datetime) -> LeasePublic | None:
    """The island's pending offer, turned into an active lease (committed); None when it has none (found by a
    read, so that inside `db.reading` the lock is only taken when there is one)."""
    pending = (
        select(Lease)
        .where(Lease.island_id == island_id, Lease.status == LeaseStatus.OFFERED, Lease.expires_at >= now)
        .order_by(Lease.id)
        .limit(1)
    )
    if session.scalar(pending.with_only_columns(Lease.id)) is None:
        return None
    start_writing(session)
    lease = session.scalar(pending.with_for_update())
    if lease is None:
        return None
    run = session.get_one(Run, lease.run_id)
    if run.status != RunStatus.RUNNING or run.current_round != lease.round:
        lease.status = LeaseStatus.EXPIRED  # its round closed without it (deadline and quorum)
        session.commit()
        return None
    path = session.get_one(Path, lease.path_id)
    lease.status = LeaseStatus.ACTIVE
    lease.expires_at = now + timedelta(seconds=run.lease_ttl_s)
    shard, modules = _shard(session, run, path.index), _modules(session, path.id)
    session.commit()
    return _public(run, path, lease, shard, modules)


def get_lease(session: Session, lease_id: int) -> Lease:
    lease = session.get(Lease, lease_id)
    if lease is None:
        raise NotFound(f"lease {lease_id} does not exist")
    return lease


def release_lease(session: Session, lease_id: int, island_id: int, *, wakeups: WorkSignal) -> Lease:
    """The island gives its lease back (e.g. on Ctrl-C): its path is free for the same round at once."""
    lease = get_lease(session, lease_id)
    if lease.island_id != island_id:
        raise Forbidden(f"lease {lease_id} belongs to island {lease.island_id}, not island {island_id}")
    if lease.status == LeaseStatus.ACTIVE:
        lease.status = LeaseStatus.RELEASED
    elif lease.status == LeaseStatus.SUBMITTED:
        raise Conflict(f"lease {lease_id} was already submitted; nothing to release")
    session.commit()
    wakeups.notify()
    return lease
