"""asynchronous and hybrid levels: a level's update mode, async modules' periods, each contribution part's base
version and staleness, per-path lease and step counters, a lease's own H (dynamic local updates)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "schedule",
                sa.String(length=8),
                server_default="round",
                nullable=False,
                comment="round: every level per round; async: every level async, no rounds; hybrid: both kinds",
            )
        )
    with op.batch_alter_table("levels", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "mode",
                sa.String(length=8),
                server_default="round",
                nullable=False,
                comment="round: stepped at round close; async: stepped every period of contributions",
            )
        )
    with op.batch_alter_table("modules", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("period", sa.Integer(), server_default="0", nullable=False, comment="Async: period now filling")
        )
        batch_op.add_column(
            sa.Column(
                "period_count",
                sa.Integer(),
                server_default="0",
                nullable=False,
                comment="Async: contributions in the period now filling",
            )
        )
        batch_op.add_column(
            sa.Column(
                "period_size",
                sa.Integer(),
                nullable=True,
                comment="Async: contributions per outer step; NULL on round levels",
            )
        )
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "step",
                sa.Integer(),
                nullable=True,
                comment="The module step this part is folded in: the round (round levels) or the period (async)",
            )
        )
        batch_op.add_column(
            sa.Column("base_version", sa.Integer(), nullable=True, comment="Module version the lease trained from")
        )
        batch_op.add_column(
            sa.Column(
                "staleness",
                sa.Integer(),
                server_default="0",
                nullable=False,
                comment="Module steps between the base version and the step it joins (0 on round levels)",
            )
        )
    op.execute(
        "UPDATE contribution_grads SET step = "
        "(SELECT contributions.round FROM contributions WHERE contributions.id = contribution_grads.contribution_id)"
    )
    op.create_index("ix_contribution_grads_module_id_step", "contribution_grads", ["module_id", "step"])
    with op.batch_alter_table("paths", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("leases_done", sa.Integer(), server_default="0", nullable=False, comment="Accepted leases")
        )
        batch_op.add_column(
            sa.Column(
                "steps_done", sa.Integer(), server_default="0", nullable=False, comment="Inner steps of accepted leases"
            )
        )
    op.execute(
        "UPDATE paths SET leases_done = "
        "(SELECT count(*) FROM contributions WHERE contributions.path_id = paths.id), "
        "steps_done = (SELECT count(*) FROM contributions WHERE contributions.path_id = paths.id) * "
        "(SELECT runs.inner_steps FROM runs WHERE runs.id = paths.run_id)"
    )
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("inner_steps", sa.Integer(), nullable=True, comment="H of this lease; NULL: the run's")
        )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("inner_steps")
    with op.batch_alter_table("paths", schema=None) as batch_op:
        batch_op.drop_column("steps_done")
        batch_op.drop_column("leases_done")
    op.drop_index("ix_contribution_grads_module_id_step", table_name="contribution_grads")
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.drop_column("staleness")
        batch_op.drop_column("base_version")
        batch_op.drop_column("step")
    with op.batch_alter_table("modules", schema=None) as batch_op:
        batch_op.drop_column("period_size")
        batch_op.drop_column("period_count")
        batch_op.drop_column("period")
    with op.batch_alter_table("levels", schema=None) as batch_op:
        batch_op.drop_column("mode")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("schedule")
