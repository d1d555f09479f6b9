"""Invariants of a finished run, read straight from the registry database and the blob store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.blobstore import BlobStore, LocalBlobStore
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion, PathModule, Round, Run
from coordinator.services.runs import run_schedule
from coordinator.services.staging import REFUSED
from coordinator.states import ContributionStatus, RoundStatus, RunStatus
from modules import (
    OuterConfig,
    RoundAccumulator,
    contribution_weight,
    decode,
    expand_rows,
    grad_norm,
    outlier_scales,
)
from modules.asynchrony import Damping, staleness_weight


def verify_run(database_url: str, blobs: Path | BlobStore, run_id: int) -> None:
    """Every round applied exactly once, and every module version equal to the outer round of the run's
    `OuterConfig` (`modules.RoundAccumulator`) over the outer gradients of the paths through that module,
    recomputed from the stored uploads. An async module: one version per period, each the fold of the parts
    that joined it (damped by their staleness), every part in exactly one period.

    `blobs`: the run's blob store (a local directory, or any `BlobStore`, e.g. an s3:// one); every upload must
    have its content name there (nothing left staged) and every staged name be gone."""
    blobs = LocalBlobStore(blobs) if isinstance(blobs, Path) else blobs
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.get_one(Run, run_id)
            outer = OuterConfig(**run.config["outer"])
            damping = run_schedule(run).damping
            rounds = session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.number)).all()
            assert run.status == RunStatus.FINISHED
            staged = session.scalars(select(Contribution.staged_key).where(Contribution.run_id == run_id)).all()
            assert staged == [None] * len(staged), staged  # every upload verified (or refused) by an executor
            if run.schedule == "async":  # no rounds
                assert run.current_round == 0 and rounds == []
            else:
                assert run.current_round == run.num_rounds
                applied = [(n, RoundStatus.APPLIED) for n in range(run.num_rounds)]
                assert [(r.number, r.status) for r in rounds] == applied
            check_parts_in_applied_steps(session, run_id)
            for module in session.scalars(select(Module).where(Module.run_id == run_id)):
                history = session.scalars(
                    select(ModuleVersion).where(ModuleVersion.module_id == module.id).order_by(ModuleVersion.version)
                ).all()
                # one version per applied round (async: per period): never applied twice, never skipped
                steps = module.period if module.period_size is not None else run.num_rounds
                assert module.period_count == 0, module.id  # the last partial period was stepped too
                assert [h.version for h in history] == list(range(steps + 1)), module.id
                assert [h.round for h in history] == [None, *range(steps)]
                assert history[-1].weights_hash == module.weights_hash and module.version == steps
                for rnd in range(steps):
                    step_outer = outer.for_async() if module.period_size is not None else outer
                    want, want_m = _recompute(session, blobs, step_outer, damping, module.id, rnd, history[rnd])
                    got = _weights(blobs, history[rnd + 1].weights_hash)
                    got_m = _momentum(blobs, history[rnd + 1])
                    assert (got_m is None) == (want_m is None)
                    for k in want:
                        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
                        if got_m is not None and want_m is not None:
                            torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=1e-6)
    finally:
        engine.dispose()


def check_parts_in_applied_steps(session: Session, run_id: int) -> None:
    """Every accepted contribution has one part per module of its path, and each part joined one module step that
    was applied: a round level's part its contribution's round (staleness 0), an async level's part a period at
    or after the version its lease trained from (staleness: the steps between). Refused uploads (409) leave no
    contribution; a part refused at verification or by the apply (scale 0) is still in its step."""
    applied = set(
        session.execute(
            select(ModuleVersion.module_id, ModuleVersion.round)
            .join(Module, Module.id == ModuleVersion.module_id)
            .where(Module.run_id == run_id, ModuleVersion.round.is_not(None))
        )
    )
    async_modules = set(
        session.scalars(select(Module.id).where(Module.run_id == run_id, Module.period_size.is_not(None)))
    )
    path_modules: dict[int, set[int]] = {}
    for path_id, module_id in session.execute(
        select(PathModule.path_id, PathModule.module_id)
        .join(Module, Module.id == PathModule.module_id)
        .where(Module.run_id == run_id)
    ):
        path_modules.setdefault(path_id, set()).add(module_id)
    parts: dict[int, set[int]] = {}
    for contribution, part in session.execute(
        select(Contribution, ContributionGrad)
        .join(ContributionGrad, ContributionGrad.contribution_id == Contribution.id)
        .where(Contribution.run_id == run_id, Contribution.status == ContributionStatus.ACCEPTED)
    ):
        where = f"contribution {contribution.id} module {part.module_id}"
        assert part.step is not None, f"{where}: the part joined no step"
        assert (part.module_id, part.step) in applied, f"{where}: the part joined step {part.step}, never applied"
        if part.module_id in async_modules:
            assert part.base_version is not None and part.staleness == part.step - part.base_version, where
        else:
            assert (part.step, part.staleness) == (contribution.round, 0), where
        parts.setdefault(contribution.id, set()).add(part.module_id)
    for contribution in session.scalars(
        select(Contribution).where(Contribution.run_id == run_id, Contribution.status == ContributionStatus.ACCEPTED)
    ):
        got, want = sorted(parts.get(contribution.id, set())), sorted(path_modules[contribution.path_id])
        assert got == want, f"contribution {contribution.id} has parts for modules {got}, its path uses {want}"


def _weights(blobs: BlobStore, digest: str) -> dict[str, torch.Tensor]:
    return decode(blobs.get_bytes(digest))


def _momentum(blobs: BlobStore, version: ModuleVersion) -> dict[str, torch.Tensor] | None:
    return decode(blobs.get_bytes(version.momentum_hash)) if version.momentum_hash else None


def _recompute(
    session: Session,
    blobs: BlobStore,
    outer: OuterConfig,
    damping: Damping,
    module_id: int,
    rnd: int,
    base: ModuleVersion,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
    """The module's step `rnd` (a round, or an async period), from the stored uploads: norms measured again,
    outlier factors as `outlier_scales` gives them (a part refused for a non-finite step must say so), damped
    by staleness, folded in path order, then arrival. Parts of uploads refused at verification (a direct upload
    that did not hash to its name, was gone or changed) have no blob and stay out, at scale 0."""
    rows = session.execute(
        select(ContributionGrad, Contribution.tokens)
        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
        .where(ContributionGrad.module_id == module_id, ContributionGrad.step == rnd)
        .order_by(Contribution.path_id, Contribution.id)
    ).all()
    refused = [row for row, _ in rows if (row.note or "").startswith(REFUSED)]
    assert all(row.scale == 0 for row in refused), (module_id, rnd)
    parts = [(row, tokens) for row, tokens in rows if row not in refused]
    assert parts, (module_id, rnd)
    params = _weights(blobs, base.weights_hash)
    # any codec; sparse rows scattered to the module's shapes (each row averaged over the parts that sent it)
    grads = [expand_rows(blobs.load_tensors(row.blob_hash, row.prefix, verified=set()), params) for row, _ in parts]
    norms = [grad_norm(g) for g in grads]
    for (row, _), norm in zip(parts, norms, strict=True):
        assert row.norm == pytest.approx(norm, rel=1e-4), (module_id, rnd)
    for (row, _), scale in zip(parts, outlier_scales(norms, outer), strict=True):
        non_finite_step = row.scale == 0 and (row.note or "").startswith("refused: the outer step")
        assert non_finite_step or row.scale == pytest.approx(scale, rel=1e-4), (module_id, rnd, row.note)
    acc = RoundAccumulator()
    for (row, tokens), grad in zip(parts, grads, strict=True):
        acc.add(grad, contribution_weight(outer, tokens), scale=row.scale * staleness_weight(row.staleness, damping))
    return acc.finish(params, _momentum(blobs, base), outer)
