"""Registry tables (SQLAlchemy 2.0 typed ORM). Alembic (migrations/) is the only writer of the schema."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from coordinator.schemas import Codec
from coordinator.states import (
    ContributionStatus,
    EventKind,
    IslandStatus,
    LeaseStatus,
    RoundStatus,
    RunStatus,
    StepStatus,
)
from coordinator.timeutil import utcnow

# BIGINT on PostgreSQL; plain INTEGER on SQLite, where only "INTEGER PRIMARY KEY" auto-increments.
BigInt = BigInteger().with_variant(Integer(), "sqlite")

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def state_column(states: type[StrEnum], *, length: int) -> Enum:
    """A status column: the enum's values as VARCHAR(length) with a CHECK constraint (`ck_<table>_status`).

    Not a native PostgreSQL enum, so adding a state later is a constraint change, not an `ALTER TYPE`. Assigning
    a string that is not a value raises before anything reaches the database.
    """
    return Enum(
        states,
        name="status",
        native_enum=False,
        create_constraint=True,
        length=length,
        values_callable=lambda enum: [member.value for member in enum],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {datetime: DateTime(timezone=True), dict[str, Any]: JSON, int: BigInt}


class Run(Base):
    __tablename__ = "runs"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    status: Mapped[RunStatus] = mapped_column(state_column(RunStatus, length=32))
    layout: Mapped[str] = mapped_column(String(2000))
    config: Mapped[dict[str, Any]]
    num_paths: Mapped[int]
    inner_steps: Mapped[int]
    num_rounds: Mapped[int]
    current_round: Mapped[int] = mapped_column(default=0)
    seed: Mapped[int]
    lease_ttl_s: Mapped[float] = mapped_column(Float)
    max_lease_s: Mapped[float] = mapped_column(
        Float, server_default="21600", comment="Longest a lease lives, heartbeats or not"
    )
    quorum: Mapped[float] = mapped_column(Float, default=1.0)
    round_deadline_s: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    schedule: Mapped[str] = mapped_column(
        String(8),
        default="round",
        server_default="round",
        comment="round: every level per round; async: every level async, no rounds; hybrid: both kinds",
    )

    levels: Mapped[list[Level]] = relationship(back_populates="run", order_by="Level.index", lazy="raise")


class Level(Base):
    __tablename__ = "levels"
    __table_args__ = (UniqueConstraint("run_id", "index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(64))
    sharing: Mapped[str] = mapped_column(String(32))  # shared | routed | path_private
    num_modules: Mapped[int]
    mode: Mapped[str] = mapped_column(
        String(8),
        default="round",
        server_default="round",
        comment="round: stepped at round close; async: stepped every period of contributions",
    )

    run: Mapped[Run] = relationship(back_populates="levels", lazy="raise")


class Module(Base):
    __tablename__ = "modules"
    __table_args__ = (UniqueConstraint("run_id", "level_index", "index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    level_id: Mapped[int] = mapped_column(ForeignKey("levels.id", ondelete="CASCADE"))
    level_index: Mapped[int] = mapped_column(Integer)
    index: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(default=0)
    weights_hash: Mapped[str] = mapped_column(String(64))
    momentum_hash: Mapped[str | None] = mapped_column(String(64))
    num_params: Mapped[int]
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    period: Mapped[int] = mapped_column(Integer, default=0, server_default="0", comment="Async: period now filling")
    period_count: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", comment="Async: contributions in the period now filling"
    )
    period_size: Mapped[int | None] = mapped_column(
        Integer, comment="Async: contributions per outer step; NULL on round levels"
    )
    weight_norm: Mapped[float | None] = mapped_column(
        Float, comment="L2 norm of the current weights, all tensors together (fp32); NULL: not measured"
    )

    level: Mapped[Level] = relationship(lazy="raise")


class ModuleVersion(Base):
    """History: every version of every module, for rollback and evaluation."""

    __tablename__ = "module_versions"
    __table_args__ = (UniqueConstraint("module_id", "version"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    module_id: Mapped[int] = mapped_column(ForeignKey("modules.id", ondelete="CASCADE"))
    version: Mapped[int]
    weights_hash: Mapped[str] = mapped_column(String(64))
    momentum_hash: Mapped[str | None] = mapped_column(String(64))
    round: Mapped[int | None] = mapped_column(comment="Round whose outer step produced it; NULL for init")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Path(Base):
    __tablename__ = "paths"
    __table_args__ = (UniqueConstraint("run_id", "index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    index: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(default=0)
    token_offset: Mapped[int] = mapped_column(default=0)
    tokens_trained: Mapped[int] = mapped_column(default=0)
    last_train_loss: Mapped[float | None] = mapped_column(Float)
    last_island_id: Mapped[int | None] = mapped_column(ForeignKey("islands.id", ondelete="SET NULL"))
    leases_done: Mapped[int] = mapped_column(Integer, default=0, server_default="0", comment="Accepted leases")
    steps_done: Mapped[int] = mapped_column(
        Integer, default=0, server_default="0", comment="Inner steps of accepted leases"
    )

    modules: Mapped[list[PathModule]] = relationship(order_by="PathModule.level_index", lazy="raise")


class PathModule(Base):
    __tablename__ = "path_modules"
    path_id: Mapped[int] = mapped_column(ForeignKey("paths.id", ondelete="CASCADE"), primary_key=True)
    level_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    module_id: Mapped[int] = mapped_column(ForeignKey("modules.id", ondelete="CASCADE"), index=True)


class Shard(Base):
    __tablename__ = "shards"
    __table_args__ = (UniqueConstraint("run_id", "path_index"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    path_index: Mapped[int] = mapped_column(Integer)
    tokens_hash: Mapped[str] = mapped_column(String(64))
    num_tokens: Mapped[int]
    num_documents: Mapped[int]
    heldout_hash: Mapped[str | None] = mapped_column(String(64), comment="The path's held-out slice (uint16 tokens)")
    heldout_tokens: Mapped[int | None]
    heldout_documents: Mapped[int | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Island(Base):
    __tablename__ = "islands"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    site: Mapped[str] = mapped_column(String(200))
    capabilities: Mapped[dict[str, Any]]
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    status: Mapped[IslandStatus] = mapped_column(state_column(IslandStatus, length=16))
    last_heartbeat: Mapped[datetime | None]
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Lease(Base):
    __tablename__ = "leases"
    # lease requests look up the busy paths of one round; upload checks look for a path's lease in a round
    __table_args__ = (
        Index("ix_leases_run_id_round", "run_id", "round"),
        Index("ix_leases_path_id_round", "path_id", "round"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    island_id: Mapped[int] = mapped_column(ForeignKey("islands.id", ondelete="CASCADE"), index=True)
    path_id: Mapped[int] = mapped_column(ForeignKey("paths.id", ondelete="CASCADE"))
    round: Mapped[int]
    status: Mapped[LeaseStatus] = mapped_column(state_column(LeaseStatus, length=16), index=True)
    base_versions: Mapped[dict[str, Any]]  # {module_id: version}
    token_start: Mapped[int]
    token_end: Mapped[int]
    epoch: Mapped[int]
    issued_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime]
    inner_steps: Mapped[int | None] = mapped_column(Integer, comment="H of this lease; NULL: the run's")
    first_step: Mapped[int | None] = mapped_column(
        Integer, comment="All-async runs: the path's inner steps before this lease's range; NULL: round x H"
    )
    shared: Mapped[bool] = mapped_column(
        Boolean,
        default=False,
        server_default=false(),
        comment="Issued on a path another lease held (async path sharing): not its island's home path",
    )
    pending_modules: Mapped[list[int] | None] = mapped_column(
        JSON,
        comment="Overlap leases: ids of the modules issued at the version a due step will make, without weights",
    )


class Contribution(Base):
    __tablename__ = "contributions"
    # one contribution per lease, and per path and round (a second upload for a path is refused, even racing)
    __table_args__ = (
        UniqueConstraint("lease_id"),
        UniqueConstraint("path_id", "round"),
        Index("ix_contributions_run_id_round", "run_id", "round"),  # a round's count at every upload
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    lease_id: Mapped[int] = mapped_column(ForeignKey("leases.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int]
    path_id: Mapped[int] = mapped_column(ForeignKey("paths.id", ondelete="CASCADE"))
    tokens: Mapped[int]
    train_loss: Mapped[float] = mapped_column(Float)
    heldout_loss: Mapped[float | None] = mapped_column(
        Float, comment="The lease's start weights scored on the path's held-out slice by the island; NULL: not scored"
    )
    codec: Mapped[Codec] = mapped_column(String(8), server_default="fp32")
    upload_bytes: Mapped[int] = mapped_column(server_default="0")
    staged_key: Mapped[str | None] = mapped_column(
        String(300), comment="Upload still in the blob store's staging area, not yet verified by an apply executor"
    )
    status: Mapped[ContributionStatus] = mapped_column(state_column(ContributionStatus, length=16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)

    grads: Mapped[list[ContributionGrad]] = relationship(lazy="raise")


class ContributionGrad(Base):
    """One module's outer gradient inside a contribution: the tensors named `<prefix><param>` of the upload's
    safetensors blob (the upload is stored once, as received)."""

    __tablename__ = "contribution_grads"
    __table_args__ = (Index("ix_contribution_grads_module_id_step", "module_id", "step"),)
    contribution_id: Mapped[int] = mapped_column(ForeignKey("contributions.id", ondelete="CASCADE"), primary_key=True)
    module_id: Mapped[int] = mapped_column(ForeignKey("modules.id", ondelete="CASCADE"), primary_key=True)
    blob_hash: Mapped[str] = mapped_column(String(64))
    prefix: Mapped[str] = mapped_column(String(80))
    norm: Mapped[float | None] = mapped_column(Float, comment="L2 norm of this part, measured at upload")
    scale: Mapped[float] = mapped_column(
        Float, default=1.0, server_default="1", comment="Outlier factor of the apply: 1 as sent, <1 clipped, 0 refused"
    )
    note: Mapped[str | None] = mapped_column(String(300), comment="Why the apply clipped or refused this part")
    step: Mapped[int | None] = mapped_column(
        Integer, comment="The module step this part is folded in: the round (round levels) or the period (async)"
    )
    base_version: Mapped[int | None] = mapped_column(Integer, comment="Module version the lease trained from")
    staleness: Mapped[int] = mapped_column(
        Integer,
        default=0,
        server_default="0",
        comment="Module steps between the base version and the step it joins (0 on round levels)",
    )
    rebased_at: Mapped[int | None] = mapped_column(
        Integer,
        comment="Overlap leases: inner steps trained from the island's own end weights before it moved onto the base "
        "version; NULL: trained from the base version",
    )


class ModuleStep(Base):
    """One module's outer step of a closing round: the unit of work of the apply executors. Created when the round
    closes, for every module a contributing path uses; the round is applied when its last step is done."""

    __tablename__ = "module_steps"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "module_id"),
        Index("ix_module_steps_status", "status"),
    )
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    round: Mapped[int]
    module_id: Mapped[int] = mapped_column(ForeignKey("modules.id", ondelete="CASCADE"))
    status: Mapped[StepStatus] = mapped_column(state_column(StepStatus, length=16))
    claimed_by: Mapped[str | None] = mapped_column(String(200), comment="<host>-<pid>-<n> of the executor")
    claimed_at: Mapped[datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)
    done_at: Mapped[datetime | None]


class Round(Base):
    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "number"),)
    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int]
    status: Mapped[RoundStatus] = mapped_column(state_column(RoundStatus, length=16))
    opened_at: Mapped[datetime] = mapped_column(default=utcnow)
    deadline: Mapped[datetime | None] = mapped_column(comment="After it, quorum suffices to close the round")
    applied_at: Mapped[datetime | None]
    num_contributions: Mapped[int | None] = mapped_column(comment="Paths that contributed, set at apply")


class Event(Base):
    """Something an operator wants to see after the fact: a lease expiry, a refused upload, a revocation.

    A log, not a relation: no foreign keys, so an event may name a lease that never existed (an upload refused
    for an unknown lease id) and outlives nothing it names. Written in the transaction of what it records
    (expiry, revocation), or in a short one of its own when that transaction is rolled back (refused upload).
    """

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)  # a run's events after a cursor
    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[EventKind] = mapped_column(
        Enum(
            EventKind,
            name="kind",
            native_enum=False,
            create_constraint=True,
            length=32,
            values_callable=lambda enum: [member.value for member in enum],
            validate_strings=True,
        )
    )
    run_id: Mapped[int | None]
    island_id: Mapped[int | None]
    lease_id: Mapped[int | None]
    round: Mapped[int | None]
    path_index: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[str] = mapped_column(String(2000))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
