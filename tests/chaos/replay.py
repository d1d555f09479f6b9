"""Replay every accepted lease of a finished run in-process, with the state each island really had.

Why: a chaos run (islands killed, the coordinator restarted, a lossy link) must train exactly what a calm run
trains, except where an island died and what it kept between leases died with it: the inner AdamW state and the
codec's error-feedback residual, one per (run, path), kept after acceptance only (`island/optimizer_state.py`,
`island/worker.py`), in process memory. The replay makes that claim checkable: lease by lease, in round and path
order, it rebuilds the path from the module versions the lease was based on, trains the lease's token range with
the state its island had kept, encodes the outer gradient with the run's codec and that island's residual, and
compares the mean train loss and the decoded outer gradient with what was uploaded. Where the island had no state
for a path that had trained before, the replay starts afresh and says so (`restarts`). It also checks that each
path's data cursor moved exactly one lease per round (no token range lost or trained twice) and that each lease
was based on the module versions of its round.

`verify_run` (tests/integration/checks.py) checks the other half: the module versions are the outer steps of
exactly these uploads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from sqlalchemy import select
from sqlalchemy.orm import Session

from coordinator.blobstore import LocalBlobStore
from coordinator.db import make_engine, make_sessionmaker
from coordinator.models import Contribution, ContributionGrad, Lease, ModuleVersion, PathModule, Run, Shard
from coordinator.models import Path as PathRow
from island.optimizer_state import InnerStates
from modules import (
    ErrorFeedback,
    InnerConfig,
    ModelConfig,
    batches_from_tokens,
    build_path,
    decode,
    decode_grad,
    encode_grad,
    make_optimizer,
    pseudo_gradient,
    train_steps,
)
from modules.simulate import next_range

OPTIMIZER_CACHE = 4
"""`dipaco island join --optimizer-cache` default: paths an island keeps state for (the chaos runs use it)."""


@dataclass(frozen=True, slots=True)
class Restart:
    """A lease that started from a fresh inner AdamW (and no codec residual) although its path had trained before."""

    round: int
    path: int
    island_id: int


@dataclass(slots=True)
class Replay:
    codec: str
    """The run's outer-gradient codec (replayed with each island's error feedback)."""
    losses: list[list[float]] = field(default_factory=list)
    """losses[round][path]: the train loss the service recorded (the replay's is compared with it)."""
    restarts: list[Restart] = field(default_factory=list)
    max_loss_diff: float = 0.0
    """Largest |recorded - replayed| mean train loss over all leases."""
    max_grad_diff: float = 0.0
    """Largest |uploaded - replayed| outer-gradient element (both decoded) over all leases."""

    @property
    def final_loss(self) -> float:
        """Mean over paths of the last round's train loss."""
        return sum(self.losses[-1]) / len(self.losses[-1])


@dataclass(slots=True)
class _IslandMemory:
    """What one island process keeps between leases; gone when the process dies."""

    adamw: InnerStates = field(default_factory=lambda: InnerStates(OPTIMIZER_CACHE))
    residuals: InnerStates = field(default_factory=lambda: InnerStates(OPTIMIZER_CACHE))


@dataclass(frozen=True, slots=True)
class _RunData:
    cfg: ModelConfig
    inner: InnerConfig
    codec: str
    steps: int
    path_index: dict[int, int]
    """path id -> index"""
    modules_of: dict[int, list[int]]
    """path id -> module ids in level order"""
    tokens: dict[int, torch.Tensor]
    """path index -> its shard"""
    weights_hash: dict[tuple[int, int], str]
    """(module id, version) -> weights blob"""


def replay_run(database_url: str, blob_dir: Path, run_id: int) -> Replay:
    """Replay run `run_id` (finished); raises AssertionError on a data-cursor or base-version mismatch and returns
    the loss and gradient differences for the caller to bound."""
    blobs = LocalBlobStore(blob_dir)
    engine = make_engine(database_url)
    # One thread, as the islands run (OMP_NUM_THREADS=1): the key biases' gradient is zero up to rounding (softmax
    # ignores a constant added to every key), and AdamW turns that rounding noise into lr-sized steps, so another
    # reduction order gives other key biases (up to ~2e-4 here) with the same losses.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with make_sessionmaker(engine)() as session:
            run = session.get_one(Run, run_id)
            data = _load(session, blobs, run)
            rows = session.execute(
                select(Contribution, Lease)
                .join(Lease, Lease.id == Contribution.lease_id)
                .where(Contribution.run_id == run_id)
                .order_by(Contribution.round, Contribution.path_id)
            ).all()
            parts = {
                (g.contribution_id, g.module_id): g
                for g in session.scalars(
                    select(ContributionGrad).where(ContributionGrad.contribution_id.in_([c.id for c, _ in rows]))
                )
            }
            out = Replay(
                codec=data.codec, losses=[[float("nan")] * len(data.path_index) for _ in range(run.num_rounds)]
            )
            cursor = dict.fromkeys(data.path_index.values(), 0)
            memory: dict[int, _IslandMemory] = {}
            trained: set[int] = set()
            for contribution, lease in rows:
                r, p = contribution.round, data.path_index[contribution.path_id]
                start, cursor[p] = next_range(
                    cursor[p],
                    length=data.tokens[p].numel(),
                    steps=data.steps,
                    batch_size=data.inner.batch_size,
                    seq_len=data.cfg.seq_len,
                )
                assert (lease.token_start, lease.token_end) == (start, cursor[p] + 1), (r, p, "token range")
                module_ids = data.modules_of[contribution.path_id]
                assert {int(k): v for k, v in lease.base_versions.items()} == dict.fromkeys(module_ids, r), (r, p)
                island = memory.setdefault(lease.island_id, _IslandMemory())
                key = (run_id, contribution.path_id)
                if key not in island.adamw and contribution.path_id in trained:
                    out.restarts.append(Restart(round=r, path=p, island_id=lease.island_id))
                loss, sent = _replay_lease(
                    data, blobs, island, key, lease, [parts[(contribution.id, m)] for m in module_ids]
                )
                out.losses[r][p] = contribution.train_loss
                out.max_loss_diff = max(out.max_loss_diff, abs(loss - contribution.train_loss))
                verified: set[str] = set()
                for m in module_ids:
                    part = parts[(contribution.id, m)]
                    for name, got in blobs.load_tensors(part.blob_hash, part.prefix, verified=verified).items():
                        out.max_grad_diff = max(out.max_grad_diff, float((got - sent[part.prefix + name]).abs().max()))
                trained.add(contribution.path_id)
            return out
    finally:
        torch.set_num_threads(threads)
        engine.dispose()


def _load(session: Session, blobs: LocalBlobStore, run: Run) -> _RunData:
    paths = session.scalars(select(PathRow).where(PathRow.run_id == run.id).order_by(PathRow.index)).all()
    modules_of = {
        p.id: list(
            session.scalars(
                select(PathModule.module_id).where(PathModule.path_id == p.id).order_by(PathModule.level_index)
            )
        )
        for p in paths
    }
    shards = {s.path_index: s for s in session.scalars(select(Shard).where(Shard.run_id == run.id))}
    tokens = {
        p.index: torch.from_numpy(np.frombuffer(blobs.get_bytes(shards[p.index].tokens_hash), "<u2").astype(np.int64))
        for p in paths
    }
    module_ids = [m for ms in modules_of.values() for m in ms]
    versions = session.scalars(select(ModuleVersion).where(ModuleVersion.module_id.in_(module_ids)))
    return _RunData(
        cfg=ModelConfig.from_dict(run.config["model"]),
        inner=InnerConfig(**run.config["inner"]),
        codec=run.config.get("codec", "fp32"),
        steps=run.inner_steps,
        path_index={p.id: p.index for p in paths},
        modules_of=modules_of,
        tokens=tokens,
        weights_hash={(v.module_id, v.version): v.weights_hash for v in versions},
    )


def _replay_lease(
    data: _RunData,
    blobs: LocalBlobStore,
    island: _IslandMemory,
    key: tuple[int, int],
    lease: Lease,
    parts: list[ContributionGrad],
) -> tuple[float, dict[str, torch.Tensor]]:
    """Train one lease as its island did; returns its mean train loss and the outer gradient as the coordinator
    decodes it (named `<level>/<param>`), and keeps the island's new state as the island does on acceptance."""
    base = [decode(blobs.get_bytes(data.weights_hash[(part.module_id, lease.round)])) for part in parts]
    model = build_path(data.cfg, base)
    optimizer = make_optimizer(model, data.inner)
    saved = island.adamw.get(key)
    if saved is not None:
        optimizer.load_state_dict(saved)
    # no torch.manual_seed: an inner step draws no random numbers (contiguous batches, no dropout)
    batches = batches_from_tokens(
        data.tokens[data.path_index[key[1]]][lease.token_start : lease.token_end],
        batch_size=data.inner.batch_size,
        seq_len=data.cfg.seq_len,
        steps=data.steps,
    )
    losses = train_steps(model, optimizer, batches, data.inner, first_step=lease.round * data.steps)
    trained = {name: t.detach() for name, t in model.state_dict().items()}
    flat = {
        part.prefix + name: t
        for part, weights in zip(parts, base, strict=True)
        for name, t in pseudo_gradient(weights, {name: trained[name] for name in weights}).items()
    }
    feedback = None
    if data.codec != "fp32":  # the island's error feedback: its residual for the path, if it kept one
        feedback = ErrorFeedback()
        feedback.residual = island.residuals.get(key) or {}
    sent = decode_grad(encode_grad(flat, data.codec, error_feedback=feedback))  # type: ignore[arg-type]
    island.adamw.accept(key, lease.id, optimizer.state_dict())
    if feedback is not None and feedback.residual:
        island.residuals.accept(key, lease.id, feedback.residual)
    return sum(losses) / len(losses), sent
