"""Who is doing what now: leases as the registry holds them (`list_leases`), e.g. the active ones, so a watcher
can show each island's current run, round and path."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.models import Lease, Path
from coordinator.schemas import LeaseSummary
from coordinator.services.runs import get_run
from coordinator.states import LeaseStatus
from coordinator.timeutil import as_utc


def list_leases(
    session: Session,
    *,
    run_id: int | None,
    island_id: int | None,
    status: LeaseStatus | None,
    round_: int | None,
    offset: int,
    limit: int,
) -> tuple[list[LeaseSummary], int]:
    """Leases matching the filters, newest first (the current ones are what a watcher wants); 404 for a run that
    does not exist."""
    where = []
    if run_id is not None:
        get_run(session, run_id)
        where.append(Lease.run_id == run_id)
    if island_id is not None:
        where.append(Lease.island_id == island_id)
    if status is not None:
        where.append(Lease.status == status)
    if round_ is not None:
        where.append(Lease.round == round_)
    count = session.scalar(select(func.count()).select_from(Lease).where(*where)) or 0
    rows = session.execute(
        select(Lease, Path.index)
        .join(Path, Path.id == Lease.path_id)
        .where(*where)
        .order_by(Lease.id.desc())
        .offset(offset)
        .limit(limit)
    )
    return [
        LeaseSummary(
            id=lease.id,
            run_id=lease.run_id,
            island_id=lease.island_id,
            round=lease.round,
            path_index=path_index,
            status=lease.status,
            epoch=lease.epoch,
            token_start=lease.token_start,
            token_end=lease.token_end,
            issued_at=as_utc(lease.issued_at),
            expires_at=as_utc(lease.expires_at),
            inner_steps=lease.inner_steps,
            first_step=lease.first_step,
            shared=lease.shared,
            pending_modules=lease.pending_modules,
        )
        for lease, path_index in rows
    ], count
