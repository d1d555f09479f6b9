"""Registering a path's shard, and its held-out slice: little-endian uint16 token files, validated, then stored
as blobs."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path as FilePath

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from coordinator.auth import Principal
from coordinator.blobstore import BlobStore
from coordinator.errors import Conflict, Invalid, NotFound
from coordinator.models import Run, Shard
from coordinator.services.registry import require_run_data
from coordinator.services.rounds import open_round
from coordinator.services.runs import get_run, tokens_per_lease
from coordinator.states import RunStatus
from coordinator.wakeups import WorkSignal


def register_shard(
    session: Session,
    blobs: BlobStore,
    *,
    run_id: int,
    path_index: int,
    body: FilePath,
    num_documents: int,
    now: datetime,
    wakeups: WorkSignal,
) -> Shard:
    """Store a path's shard; the last one starts the run (round 0 opens, islands waiting for work wake)."""
    run = get_run(session, run_id)
    if run.status != RunStatus.WAITING_FOR_SHARDS:
        raise Conflict(f"run {run_id} is {run.status}; shards can only be registered before training starts")
    if not 0 <= path_index < run.num_paths:
        raise NotFound(f"path {path_index} does not exist: run {run_id} has paths 0..{run.num_paths - 1}")
    if num_documents < 1:
        raise Invalid(f"num_documents must be >= 1, got {num_documents}")
    tokens = _token_file(body, run, what="shard")
    need = tokens_per_lease(run)
    if tokens.size < need:
        raise Invalid(
            f"shard for path {path_index} has {tokens.size} tokens; one round needs {need} "
            f"(inner_steps x batch_size x seq_len + 1)"
        )
    with body.open("rb") as f:
        digest, _ = blobs.put_stream(f)
    shard = session.scalar(select(Shard).where(Shard.run_id == run_id, Shard.path_index == path_index))
    if shard is None:
        shard = Shard(run_id=run_id, path_index=path_index)
        session.add(shard)
    shard.tokens_hash = digest
    shard.num_tokens = int(tokens.size)
    shard.num_documents = num_documents
    session.flush()
    registered = session.scalar(select(func.count()).select_from(Shard).where(Shard.run_id == run_id))
    started = registered == run.num_paths
    if started:
        run.status = RunStatus.RUNNING
        if run.schedule != "async":  # an all-async run has no rounds: its paths lease freely
            open_round(session, run, 0, now=now)
    session.commit()
    if started:
        wakeups.notify()
    return shard


def register_heldout(
    session: Session, blobs: BlobStore, *, run_id: int, path_index: int, body: FilePath, num_documents: int
) -> Shard:
    """Store a path's held-out slice next to its shard (registered first). Leases of the path carry it from then
    on: each island scores its start weights on up to the run's `heldout_tokens` of it and reports the loss with
    its upload. Registering again replaces the slice."""
    run = get_run(session, run_id)
    if not run.config.get("heldout_tokens", 0):
        raise Conflict(f"run {run_id} keeps no held-out slices (its heldout_tokens is 0)")
    if run.status not in (RunStatus.WAITING_FOR_SHARDS, RunStatus.RUNNING):
        raise Conflict(f"run {run_id} is {run.status}; held-out slices can only be registered before it ends")
    if not 0 <= path_index < run.num_paths:
        raise NotFound(f"path {path_index} does not exist: run {run_id} has paths 0..{run.num_paths - 1}")
    shard = session.scalar(select(Shard).where(Shard.run_id == run_id, Shard.path_index == path_index))
    if shard is None:
        raise Conflict(f"path {path_index} of run {run_id} has no shard yet: register its shard first")
    if num_documents < 1:
        raise Invalid(f"num_documents must be >= 1, got {num_documents}")
    tokens = _token_file(body, run, what="held-out slice")
    seq_len = run.config["model"]["seq_len"]
    if tokens.size < seq_len + 1:
        raise Invalid(
            f"held-out slice for path {path_index} has {tokens.size} tokens; scoring needs at least one window "
            f"of seq_len + 1 = {seq_len + 1}"
        )
    with body.open("rb") as f:
        digest, _ = blobs.put_stream(f)
    shard.heldout_hash = digest
    shard.heldout_tokens = int(tokens.size)
    shard.heldout_documents = num_documents
    session.commit()
    return shard


def _token_file(body: FilePath, run: Run, *, what: str) -> np.ndarray:
    """The body as uint16 tokens (memory-mapped), refused (422) unless whole tokens under the model's vocabulary."""
    size = body.stat().st_size
    if size % 2:
        raise Invalid(f"{what} body has {size} bytes; a token file holds 2-byte (uint16) tokens")
    if not size:
        return np.zeros(0, dtype="<u2")
    tokens = np.memmap(body, dtype="<u2", mode="r")
    vocab = run.config["model"]["vocab_size"]
    if int(tokens.max()) >= vocab:
        raise Invalid(f"{what} holds token id {int(tokens.max())}, the model's vocabulary is {vocab}")
    return tokens


def get_heldout(session: Session, shard_id: int, *, reader: Principal) -> tuple[str, int]:
    """A shard's held-out slice (hash, tokens), for the admin and the islands of its run."""
    shard = get_shard(session, shard_id, reader=reader)
    if shard.heldout_hash is None or shard.heldout_tokens is None:
        raise NotFound(f"shard {shard_id} has no held-out slice")
    return shard.heldout_hash, shard.heldout_tokens


def get_shard(session: Session, shard_id: int, *, reader: Principal) -> Shard:
    """A shard's row, for the admin and the islands of its run (`registry.require_run_data`)."""
    shard = session.get(Shard, shard_id)
    if shard is None:
        raise NotFound(f"shard {shard_id} does not exist")
    require_run_data(session, reader, shard.run_id, what="shard tokens")
    return shard
