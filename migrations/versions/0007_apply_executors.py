"""outer-apply executors: rounds close into per-module steps that executors claim and commit exactly once

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 16:00:00

A round that is ready is no longer applied inside the request that completed it: it becomes `closing` and gets
one `module_steps` row per module a contributing path uses; apply executors (`dipaco coordinator apply-worker`,
or the threads `serve --apply-workers N` runs) claim the steps, and the last one committed applies the round.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
ROUND_STATES_BEFORE = ("open", "applied")
ROUND_STATES = ("open", "closing", "applied")
STEP_STATES = ("pending", "running", "done")


def _condition(values: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def upgrade() -> None:
    op.create_table(
        "module_steps",
        sa.Column("id", BigInt, nullable=False),
        sa.Column("run_id", BigInt, nullable=False),
        sa.Column("round", BigInt, nullable=False),
        sa.Column("module_id", BigInt, nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("claimed_by", sa.String(length=200), nullable=True, comment="<host>-<pid>-<n> of the executor"),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", BigInt, nullable=False),
        sa.Column("done_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(_condition(STEP_STATES), name=op.f("ck_module_steps_status")),
        sa.ForeignKeyConstraint(
            ["module_id"], ["modules.id"], name=op.f("fk_module_steps_module_id_modules"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name=op.f("fk_module_steps_run_id_runs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_module_steps")),
        sa.UniqueConstraint("run_id", "round", "module_id", name=op.f("uq_module_steps_run_id_round_module_id")),
    )
    with op.batch_alter_table("module_steps", schema=None) as batch_op:
        batch_op.create_index("ix_module_steps_status", ["status"], unique=False)
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_rounds_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_rounds_status"), _condition(ROUND_STATES))


def downgrade() -> None:
    closing = op.get_bind().execute(sa.text("SELECT COUNT(*) FROM rounds WHERE status = 'closing'")).scalar()
    if closing:
        raise RuntimeError(f"{closing} round(s) are closing: let the executors apply them before downgrading")
    with op.batch_alter_table("rounds", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_rounds_status"), type_="check")
        batch_op.create_check_constraint(op.f("ck_rounds_status"), _condition(ROUND_STATES_BEFORE))
    with op.batch_alter_table("module_steps", schema=None) as batch_op:
        batch_op.drop_index("ix_module_steps_status")
    op.drop_table("module_steps")
