"""Invariants of a finished run, read straight from the registry database and the blob store."""

from __future__ import annotations

from pathlib import Path

import torch
from sqlalchemy import select

from coordinator.blobstore import LocalBlobStore
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion, Round, Run
from coordinator.states import RoundStatus, RunStatus
from modules import OuterConfig, RoundAccumulator, contribution_weight, decode


def verify_run(database_url: str, blob_dir: Path, run_id: int) -> None:
    """Every round applied exactly once, and every module version equal to the outer round of the run's
    `OuterConfig` (`modules.RoundAccumulator`) over the outer gradients of the paths through that module,
    recomputed from the stored uploads."""
    blobs = LocalBlobStore(blob_dir)
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.get_one(Run, run_id)
            outer = OuterConfig(**run.config["outer"])
            rounds = session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.number)).all()
            assert run.status == RunStatus.FINISHED and run.current_round == run.num_rounds
            assert [(r.number, r.status) for r in rounds] == [(n, RoundStatus.APPLIED) for n in range(run.num_rounds)]
            for module in session.scalars(select(Module).where(Module.run_id == run_id)):
                history = session.scalars(
                    select(ModuleVersion).where(ModuleVersion.module_id == module.id).order_by(ModuleVersion.version)
                ).all()
                # one version per applied round: never applied twice, never skipped
                assert [h.version for h in history] == list(range(run.num_rounds + 1)), module.id
                assert [h.round for h in history] == [None, *range(run.num_rounds)]
                assert history[-1].weights_hash == module.weights_hash and module.version == run.num_rounds
                for rnd in range(run.num_rounds):
                    contributions = session.execute(
                        select(ContributionGrad.blob_hash, ContributionGrad.prefix, Contribution.tokens)
                        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
                        .where(ContributionGrad.module_id == module.id, Contribution.round == rnd)
                        .order_by(Contribution.path_id)
                    ).all()
                    assert contributions, (module.id, rnd)
                    acc = RoundAccumulator()
                    for digest, prefix, tokens in contributions:
                        tensors = decode(blobs.get_bytes(digest))
                        grad = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
                        acc.add(grad, contribution_weight(outer, tokens))
                    want, want_m = acc.finish(
                        _weights(blobs, history[rnd].weights_hash), _momentum(blobs, history[rnd]), outer
                    )
                    got = _weights(blobs, history[rnd + 1].weights_hash)
                    got_m = _momentum(blobs, history[rnd + 1])
                    assert (got_m is None) == (want_m is None)
                    for k in want:
                        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
                        if got_m is not None and want_m is not None:
                            torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=1e-6)
    finally:
        engine.dispose()


def _weights(blobs: LocalBlobStore, digest: str) -> dict[str, torch.Tensor]:
    return decode(blobs.get_bytes(digest))


def _momentum(blobs: LocalBlobStore, version: ModuleVersion) -> dict[str, torch.Tensor] | None:
    return decode(blobs.get_bytes(version.momentum_hash)) if version.momentum_hash else None
