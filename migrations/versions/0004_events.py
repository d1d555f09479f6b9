"""events: lease expiries, refused uploads and revocations, for the dashboard

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 09:00:00

A log table with no foreign keys (an event may name a lease that never existed, e.g. an upload refused for an
unknown lease id). `kind` takes coordinator.states.EventKind's values (CHECK constraint `ck_events_kind`); the
index serves "a run's events after id N", the dashboard's poll.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The values as of this revision (a later kind needs a migration of its own, as 0003 says for statuses).
KINDS = ("lease_expired", "upload_refused", "island_revoked")
BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("id", BigInt, nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("run_id", BigInt, nullable=True),
        sa.Column("island_id", BigInt, nullable=True),
        sa.Column("lease_id", BigInt, nullable=True),
        sa.Column("round", BigInt, nullable=True),
        sa.Column("path_index", sa.Integer(), nullable=True),
        sa.Column("detail", sa.String(length=2000), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
        sa.CheckConstraint("kind IN (" + ", ".join(f"'{k}'" for k in KINDS) + ")", name=op.f("ck_events_kind")),
    )
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.create_index("ix_events_run_id_id", ["run_id", "id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_index("ix_events_run_id_id")
    op.drop_table("events")
