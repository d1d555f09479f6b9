"""Leases: a path of the current round handed to one island, with its token range and an expiry.

A path is free in a round when it has neither an active nor a submitted lease for that round. An island is
offered the path it trained last when that path is free (its inner optimizer state and cached weights are
warm), else the free path with the lowest index that is not reserved for another live island (see `Affinity`).
Expired leases free their path for the same round; the path's
data cursor only advances when a contribution is accepted, so an expired lease gives its token range back.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, selectinload

from coordinator.errors import Conflict, Forbidden, NotFound
from coordinator.models import Island, Lease, Module, Path, PathModule, Round, Run, Shard
from coordinator.schemas import LeaseModule, LeasePublic, LeaseShard
from coordinator.services.runs import tokens_per_lease
from coordinator.timeutil import as_utc


def expire_stale_leases(session: Session, *, now: datetime) -> int:
    """Mark active leases past their expiry as expired (the caller commits).

    A cheap read first: most calls find nothing to expire and then write nothing (no row locks taken).
    """
    stale = select(Lease.id).where(Lease.status == "active", Lease.expires_at < now)
    if session.scalar(stale.limit(1)) is None:
        return 0
    result = session.execute(
        update(Lease).where(Lease.status == "active", Lease.expires_at < now).values(status="expired")
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Affinity:
    """Keep paths with the island that trained them last (its AdamW state and caches are warm there).

    For `reserve_s` seconds after a round opens, a free path whose last island is another live island (active,
    heartbeated within `live_s`) is kept for that island; afterwards any island may take it, so a slow or silent
    island delays a round by at most `reserve_s`. 0 disables the reservation (the preference stays).
    """

    reserve_s: float = 10.0
    live_s: float = 30.0


def _free_path(
    session: Session, run_id: int, round_: int, island_id: int, *, now: datetime, affinity: Affinity
) -> Path | None:
    """The path this island trained last if it is free, else the free path with the lowest index that is not
    reserved for another island."""
    busy = select(Lease.path_id).where(
        Lease.run_id == run_id, Lease.round == round_, Lease.status.in_(("active", "submitted"))
    )
    free = select(Path).where(Path.run_id == run_id, Path.id.not_in(busy))
    warm = session.scalar(free.where(Path.last_island_id == island_id).order_by(Path.index).limit(1))
    if warm is not None:
        return warm
    if affinity.reserve_s > 0:
        opened = session.scalar(select(Round.opened_at).where(Round.run_id == run_id, Round.number == round_))
        if opened is not None and now < as_utc(opened) + timedelta(seconds=affinity.reserve_s):
            others = select(Island.id).where(
                Island.id != island_id,
                Island.status == "active",
                Island.last_heartbeat >= now - timedelta(seconds=affinity.live_s),
            )
            free = free.where(or_(Path.last_island_id.is_(None), Path.last_island_id.not_in(others)))
    return session.scalar(free.order_by(Path.index).limit(1))


def acquire_lease(
    session: Session, island_id: int, *, now: datetime, affinity: Affinity = Affinity()
) -> tuple[Lease | None, str]:
    """Issue a lease to an island, or return (None, reason) with reason `waiting` or `no-running-runs`.

    Call `expire_stale_leases` (and commit) first so that paths of expired leases are free again. Free paths are
    probed without a lock; only when one exists is the run row locked and the choice made again under the lock,
    so idle islands polling for work never queue behind each other.
    """
    running = session.execute(select(Run.id, Run.current_round).where(Run.status == "running").order_by(Run.id)).all()
    if not running:
        session.rollback()
        return None, "no-running-runs"
    for run_id, round_ in running:
        if _free_path(session, run_id, round_, island_id, now=now, affinity=affinity) is None:
            continue
        run = session.scalar(
            select(Run).where(Run.id == run_id).with_for_update().execution_options(populate_existing=True)
        )
        if run is None or run.status != "running":
            continue
        path = _free_path(session, run.id, run.current_round, island_id, now=now, affinity=affinity)
        if path is None:
            continue
        lease = _issue(session, run, path, island_id, now=now)
        session.commit()
        return lease, "leased"
    session.rollback()
    return None, "waiting"


def _issue(session: Session, run: Run, path: Path, island_id: int, *, now: datetime) -> Lease:
    shard = session.scalar(select(Shard).where(Shard.run_id == run.id, Shard.path_index == path.index))
    assert shard is not None, "a running run has a shard for every path"
    need = tokens_per_lease(run)
    start, epoch = path.token_offset, path.epoch
    if start + need > shard.num_tokens:
        # The rest of the shard is too short for a full lease: start the next epoch from the beginning.
        start, epoch = 0, epoch + 1
    modules = session.execute(
        select(Module.id, Module.version)
        .join(PathModule, PathModule.module_id == Module.id)
        .where(PathModule.path_id == path.id)
    ).all()
    lease = Lease(
        run_id=run.id,
        island_id=island_id,
        path_id=path.id,
        round=run.current_round,
        status="active",
        base_versions={str(mid): version for mid, version in modules},
        token_start=start,
        token_end=start + need,
        epoch=epoch,
        issued_at=now,
        expires_at=now + timedelta(seconds=run.lease_ttl_s),
    )
    session.add(lease)
    session.flush()
    return lease


def get_lease(session: Session, lease_id: int) -> Lease:
    lease = session.get(Lease, lease_id)
    if lease is None:
        raise NotFound(f"lease {lease_id} does not exist")
    return lease


def release_lease(session: Session, lease_id: int, island_id: int) -> Lease:
    lease = get_lease(session, lease_id)
    if lease.island_id != island_id:
        raise Forbidden(f"lease {lease_id} belongs to island {lease.island_id}, not island {island_id}")
    if lease.status == "active":
        lease.status = "released"
    elif lease.status == "submitted":
        raise Conflict(f"lease {lease_id} was already submitted; nothing to release")
    session.commit()
    return lease


def lease_public(session: Session, lease: Lease) -> LeasePublic:
    run = session.get_one(Run, lease.run_id)
    path = session.scalar(select(Path).where(Path.id == lease.path_id).options(selectinload(Path.modules)))
    assert path is not None
    shard = session.scalar(select(Shard).where(Shard.run_id == run.id, Shard.path_index == path.index))
    assert shard is not None
    module_rows = {
        m.id: m
        for m in session.scalars(
            select(Module)
            .where(Module.id.in_([pm.module_id for pm in path.modules]))
            .options(selectinload(Module.level))
        )
    }
    lease_modules = []
    for pm in path.modules:
        m = module_rows[pm.module_id]
        version = int(lease.base_versions[str(m.id)])
        if version != m.version:
            raise Conflict(
                f"lease {lease.id} was issued on module {m.id} version {version}, the module is at {m.version}"
            )
        lease_modules.append(
            LeaseModule(
                level=m.level_index,
                level_name=m.level.name,
                module_id=m.id,
                version=m.version,
                weights_hash=m.weights_hash,
            )
        )
    return LeasePublic(
        lease_id=lease.id,
        run_id=run.id,
        round=lease.round,
        path_id=path.id,
        path_index=path.index,
        model=run.config["model"],
        inner=run.config["inner"],
        inner_steps=run.inner_steps,
        first_step=lease.round * run.inner_steps,
        modules=lease_modules,
        shard=LeaseShard(shard_id=shard.id, tokens_hash=shard.tokens_hash, num_tokens=shard.num_tokens),
        token_start=lease.token_start,
        token_end=lease.token_end,
        epoch=lease.epoch,
        seed=run.seed * 1_000_003 + lease.round * 1_009 + path.index,
        expires_at=as_utc(lease.expires_at),
        status=lease.status,  # type: ignore[arg-type]
    )


def lease_path_index(session: Session, lease: Lease) -> int:
    return session.get_one(Path, lease.path_id).index
