"""Invariants of a finished run, read straight from the registry database and the blob store."""

from __future__ import annotations

from pathlib import Path

import torch
from sqlalchemy import select

from coordinator.blobstore import LocalBlobStore
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Contribution, ContributionGrad, Module, ModuleVersion, Round, Run
from modules import OuterConfig, decode, nesterov_step


def verify_run(database_url: str, blob_dir: Path, run_id: int) -> None:
    """Every round applied exactly once, and every module version equal to one Nesterov step on the mean of the
    outer gradients of the paths through that module (recomputed from the stored uploads)."""
    blobs = LocalBlobStore(blob_dir)
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.get_one(Run, run_id)
            outer = OuterConfig(**run.config["outer"])
            rounds = session.scalars(select(Round).where(Round.run_id == run_id).order_by(Round.number)).all()
            assert run.status == "finished" and run.current_round == run.num_rounds
            assert [(r.number, r.status) for r in rounds] == [(n, "applied") for n in range(run.num_rounds)]
            for module in session.scalars(select(Module).where(Module.run_id == run_id)):
                history = session.scalars(
                    select(ModuleVersion).where(ModuleVersion.module_id == module.id).order_by(ModuleVersion.version)
                ).all()
                # one version per applied round: never applied twice, never skipped
                assert [h.version for h in history] == list(range(run.num_rounds + 1)), module.id
                assert [h.round for h in history] == [None, *range(run.num_rounds)]
                assert history[-1].weights_hash == module.weights_hash and module.version == run.num_rounds
                for rnd in range(run.num_rounds):
                    grad_hashes = session.execute(
                        select(ContributionGrad.blob_hash, ContributionGrad.prefix)
                        .join(Contribution, Contribution.id == ContributionGrad.contribution_id)
                        .where(ContributionGrad.module_id == module.id, Contribution.round == rnd)
                    ).all()
                    assert grad_hashes, (module.id, rnd)
                    grads = [
                        {k[len(prefix) :]: v for k, v in decode(blobs.get_bytes(h)).items() if k.startswith(prefix)}
                        for h, prefix in grad_hashes
                    ]
                    mean = {k: torch.stack([g[k] for g in grads]).mean(0) for k in grads[0]}
                    base = decode(blobs.get_bytes(history[rnd].weights_hash))
                    momentum = (
                        decode(blobs.get_bytes(history[rnd].momentum_hash)) if history[rnd].momentum_hash else None
                    )
                    want, want_m = nesterov_step(base, mean, momentum, outer)
                    got = decode(blobs.get_bytes(history[rnd + 1].weights_hash))
                    got_m = decode(blobs.get_bytes(history[rnd + 1].momentum_hash or ""))
                    for k in base:
                        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-6)
                        torch.testing.assert_close(got_m[k], want_m[k], rtol=0, atol=1e-6)
    finally:
        engine.dispose()
