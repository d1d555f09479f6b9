"""Registry reads: rows -> public schemas, with filters and pagination."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, selectinload

from coordinator.auth import Principal
from coordinator.errors import Forbidden, NotFound
from coordinator.models import (
    Contribution,
    ContributionGrad,
    Island,
    Lease,
    Module,
    ModuleVersion,
    Path,
    PathModule,
    Round,
    Run,
    Shard,
)
from coordinator.schemas import (
    ContributionModule,
    ContributionSummary,
    IslandCapabilities,
    IslandPublic,
    IslandStats,
    ModulePublic,
    PathPublic,
    RoundPublic,
    RunPublic,
)
from coordinator.states import ContributionStatus, IslandStatus, RunStatus
from coordinator.timeutil import as_utc


def _page(session: Session, query: Select[Any], *, offset: int, limit: int) -> tuple[list[Any], int]:
    count = session.scalar(select(func.count()).select_from(query.order_by(None).subquery())) or 0
    rows = list(session.scalars(query.offset(offset).limit(limit)))
    return rows, count


def run_public(run: Run) -> RunPublic:
    return RunPublic(
        id=run.id,
        name=run.name,
        status=run.status,
        current_round=run.current_round,
        num_rounds=run.num_rounds,
        num_paths=run.num_paths,
        inner_steps=run.inner_steps,
        layout=run.layout,
        config=run.config,
        lease_ttl_s=run.lease_ttl_s,
        max_lease_s=run.max_lease_s,
        quorum=run.quorum,
        round_deadline_s=run.round_deadline_s,
        created_at=as_utc(run.created_at),
        schedule="async" if run.schedule == "async" else "hybrid" if run.schedule == "hybrid" else "round",
    )


def list_runs(session: Session, *, status: RunStatus | None, offset: int, limit: int) -> tuple[list[RunPublic], int]:
    q = select(Run).order_by(Run.id)
    if status:
        q = q.where(Run.status == status)
    rows, count = _page(session, q, offset=offset, limit=limit)
    return [run_public(r) for r in rows], count


def module_public(m: Module) -> ModulePublic:
    return ModulePublic(
        id=m.id,
        run_id=m.run_id,
        level=m.level_index,
        level_name=m.level.name,
        index=m.index,
        sharing=m.level.sharing,
        mode="async" if m.level.mode == "async" else "round",
        version=m.version,
        weights_hash=m.weights_hash,
        num_params=m.num_params,
        updated_at=as_utc(m.updated_at),
        weight_norm=m.weight_norm,
    )


def list_modules(
    session: Session, *, run_id: int | None, level: int | None, offset: int, limit: int
) -> tuple[list[ModulePublic], int]:
    q = select(Module).options(selectinload(Module.level)).order_by(Module.run_id, Module.level_index, Module.index)
    if run_id is not None:
        q = q.where(Module.run_id == run_id)
    if level is not None:
        q = q.where(Module.level_index == level)
    rows, count = _page(session, q, offset=offset, limit=limit)
    return [module_public(m) for m in rows], count


def get_module(session: Session, module_id: int) -> Module:
    m = session.scalar(select(Module).where(Module.id == module_id).options(selectinload(Module.level)))
    if m is None:
        raise NotFound(f"module {module_id} does not exist")
    return m


def require_run_data(session: Session, principal: Principal, run_id: int, *, what: str) -> None:
    """Weights and training data are the admin's and the run's islands' (an island that holds or held a lease of
    the run); registry metadata is for any valid token. 403 otherwise, naming the run."""
    if principal.scope == "admin":
        return
    if principal.scope == "island":
        held = session.scalar(
            select(Lease.id).where(Lease.island_id == principal.island_id, Lease.run_id == run_id).limit(1)
        )
        if held is not None:
            return
        raise Forbidden(
            f"island {principal.island_id} has no lease in run {run_id}: {what} are for the run's islands and the admin"
        )
    raise Forbidden(f"{what} of run {run_id} need an admin token or the token of an island of the run")


def module_weights_hash(session: Session, module_id: int, *, version: int | None, reader: Principal) -> str:
    """The blob holding a module's weights: its current version, or `version` from its history (for the admin
    and the run's islands: `require_run_data`)."""
    row = session.execute(
        select(Module.version, Module.weights_hash, Module.run_id).where(Module.id == module_id)
    ).first()
    if row is None:
        raise NotFound(f"module {module_id} does not exist")
    current, digest, run_id = row
    require_run_data(session, reader, run_id, what="module weights")
    if version is None or version == current:
        return str(digest)
    past = session.scalar(
        select(ModuleVersion.weights_hash).where(ModuleVersion.module_id == module_id, ModuleVersion.version == version)
    )
    if past is None:
        raise NotFound(f"module {module_id} has no version {version}; current version is {current}")
    return past


def paths_public(session: Session, paths: list[Path]) -> list[PathPublic]:
    """Public views of a page of paths: two queries for the whole page, not two per path."""
    modules: dict[int, list[tuple[int, int]]] = {p.id: [] for p in paths}
    for path_id, module_id, module_index in session.execute(
        select(PathModule.path_id, PathModule.module_id, Module.index)
        .join(Module, Module.id == PathModule.module_id)
        .where(PathModule.path_id.in_(list(modules)))
        .order_by(PathModule.path_id, PathModule.level_index)
    ):
        modules[path_id].append((module_id, module_index))
    run_ids = {p.run_id for p in paths}
    shards = {
        (run_id, path_index): shard_id
        for shard_id, run_id, path_index in session.execute(
            select(Shard.id, Shard.run_id, Shard.path_index).where(Shard.run_id.in_(run_ids))
        )
    }
    return [
        PathPublic(
            id=p.id,
            run_id=p.run_id,
            index=p.index,
            module_ids=[m[0] for m in modules[p.id]],
            module_indices=[m[1] for m in modules[p.id]],
            shard_id=shards.get((p.run_id, p.index)),
            epoch=p.epoch,
            token_offset=p.token_offset,
            tokens_trained=p.tokens_trained,
            last_train_loss=p.last_train_loss,
        )
        for p in paths
    ]


def list_paths(session: Session, *, run_id: int | None, offset: int, limit: int) -> tuple[list[PathPublic], int]:
    q = select(Path).order_by(Path.run_id, Path.index)
    if run_id is not None:
        q = q.where(Path.run_id == run_id)
    rows, count = _page(session, q, offset=offset, limit=limit)
    return paths_public(session, rows), count


def get_path(session: Session, path_id: int) -> PathPublic:
    p = session.get(Path, path_id)
    if p is None:
        raise NotFound(f"path {path_id} does not exist")
    return paths_public(session, [p])[0]


def island_public(i: Island, stats: IslandStats | None = None) -> IslandPublic:
    return IslandPublic(
        id=i.id,
        name=i.name,
        site=i.site,
        status=i.status,
        capabilities=IslandCapabilities(**i.capabilities),
        last_heartbeat=as_utc(i.last_heartbeat) if i.last_heartbeat else None,
        created_at=as_utc(i.created_at),
        stats=stats,
    )


RECENT_CONTRIBUTIONS = 10
"""An island's measured tokens/s is taken over its last this many contributions."""


def island_stats(session: Session, island_ids: list[int]) -> dict[int, IslandStats]:
    """Each island's contributions, tokens, upload bytes and measured tokens/s: two queries for the whole page
    (the sums grouped by island; the last `RECENT_CONTRIBUTIONS` of each island by a window), not two per island.

    Tokens/s: the recent contributions' tokens over the wall time from each one's lease to its upload (fetch,
    train and upload together; at least 1 ms each, as `leases.lease_steps` measures an island's speed)."""
    if not island_ids:
        return {}
    sums = {
        island_id: (n, int(tokens), int(upload_bytes))
        for island_id, n, tokens, upload_bytes in session.execute(
            select(
                Lease.island_id,
                func.count(Contribution.id),
                func.coalesce(func.sum(Contribution.tokens), 0),
                func.coalesce(func.sum(Contribution.upload_bytes), 0),
            )
            .join(Lease, Lease.id == Contribution.lease_id)
            .where(Lease.island_id.in_(island_ids))
            .group_by(Lease.island_id)
        )
    }
    newest_first = (
        func.row_number().over(partition_by=Lease.island_id, order_by=Contribution.id.desc()).label("newest_first")
    )
    recent = (
        select(Lease.island_id, Contribution.tokens, Lease.issued_at, Contribution.created_at, newest_first)
        .join(Lease, Lease.id == Contribution.lease_id)
        .where(Lease.island_id.in_(island_ids))
        .subquery()
    )
    tokens: dict[int, int] = {}
    seconds: dict[int, float] = {}
    for island_id, n, issued, done in session.execute(
        select(recent.c.island_id, recent.c.tokens, recent.c.issued_at, recent.c.created_at).where(
            recent.c.newest_first <= RECENT_CONTRIBUTIONS
        )
    ):
        tokens[island_id] = tokens.get(island_id, 0) + n
        took = max((as_utc(done) - as_utc(issued)).total_seconds(), 1e-3)
        seconds[island_id] = seconds.get(island_id, 0.0) + took
    out = {}
    for island_id in island_ids:
        n, total, upload_bytes = sums.get(island_id, (0, 0, 0))
        out[island_id] = IslandStats(
            contributions=n,
            tokens_trained=total,
            upload_bytes=upload_bytes,
            tokens_per_s=tokens[island_id] / seconds[island_id] if island_id in seconds else None,
        )
    return out


def list_islands(
    session: Session, *, status: IslandStatus | None, offset: int, limit: int
) -> tuple[list[IslandPublic], int]:
    q = select(Island).order_by(Island.id)
    if status:
        q = q.where(Island.status == status)
    rows, count = _page(session, q, offset=offset, limit=limit)
    stats = island_stats(session, [i.id for i in rows])
    return [island_public(i, stats[i.id]) for i in rows], count


def list_rounds(session: Session, run_id: int) -> list[RoundPublic]:
    if session.get(Run, run_id) is None:
        raise NotFound(f"run {run_id} does not exist")
    stats = {
        number: (n, loss)
        for number, n, loss in session.execute(
            select(Contribution.round, func.count(), func.avg(Contribution.train_loss))
            .where(Contribution.run_id == run_id, Contribution.status == ContributionStatus.ACCEPTED)
            .group_by(Contribution.round)
        )
    }
    out = []
    for r in session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.number)):
        n, loss = stats.get(r.number, (0, None))
        out.append(
            RoundPublic(
                run_id=run_id,
                number=r.number,
                status=r.status,
                contributions=n,
                mean_train_loss=float(loss) if loss is not None else None,
                opened_at=as_utc(r.opened_at),
                deadline=as_utc(r.deadline) if r.deadline else None,
                applied_at=as_utc(r.applied_at) if r.applied_at else None,
            )
        )
    return out


def list_contributions(
    session: Session, *, run_id: int | None, round_: int | None, offset: int, limit: int
) -> tuple[list[ContributionSummary], int]:
    q = (
        select(Contribution, Path.index, Lease.island_id)
        .join(Path, Path.id == Contribution.path_id)
        .join(Lease, Lease.id == Contribution.lease_id)
        .order_by(Contribution.run_id, Contribution.round, Path.index)
    )
    if run_id is not None:
        q = q.where(Contribution.run_id == run_id)
    if round_ is not None:
        q = q.where(Contribution.round == round_)
    count = session.scalar(select(func.count()).select_from(q.order_by(None).subquery())) or 0
    rows = session.execute(q.offset(offset).limit(limit)).all()
    parts: dict[int, list[ContributionModule]] = {c.id: [] for c, _, _ in rows}
    for contribution_id, module_id, norm, scale, note, base, staleness, rebased_at in session.execute(
        select(
            ContributionGrad.contribution_id,
            ContributionGrad.module_id,
            ContributionGrad.norm,
            ContributionGrad.scale,
            ContributionGrad.note,
            ContributionGrad.base_version,
            ContributionGrad.staleness,
            ContributionGrad.rebased_at,
        )
        .join(Module, Module.id == ContributionGrad.module_id)
        .where(ContributionGrad.contribution_id.in_(list(parts)))
        .order_by(ContributionGrad.contribution_id, Module.level_index)
    ):
        parts[contribution_id].append(
            ContributionModule(
                module_id=module_id,
                base_version=base,
                staleness=staleness,
                rebased_at=rebased_at,
                norm=norm,
                scale=scale,
                note=note,
            )
        )
    out = [
        ContributionSummary(
            id=c.id,
            lease_id=c.lease_id,
            run_id=c.run_id,
            round=c.round,
            path_index=path_index,
            island_id=island_id,
            tokens=c.tokens,
            train_loss=c.train_loss,
            heldout_loss=c.heldout_loss,
            status=c.status,
            created_at=as_utc(c.created_at),
            modules=parts[c.id],
            codec=c.codec,
            upload_bytes=c.upload_bytes,
        )
        for c, path_index, island_id in rows
    ]
    return out, count
