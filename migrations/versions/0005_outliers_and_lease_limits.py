"""robust aggregation and bounded leases: each module's part of an upload records its norm and what the apply
did with it; runs get a maximum lease lifetime

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 12:00:00

`contribution_grads.norm` is measured when the upload is validated (NULL for uploads accepted before this
revision: the apply treats an unknown norm as within every bound); `scale` is the factor the apply folded the
part in with (1 as sent, < 1 clipped to the run's bound, 0 refused) and `note` says why. `runs.max_lease_s` is
the longest a lease lives whatever its heartbeats (existing runs: 6 hours).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "max_lease_s",
                sa.Float(),
                server_default="21600",
                nullable=False,
                comment="Longest a lease lives, heartbeats or not",
            )
        )
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("norm", sa.Float(), nullable=True, comment="L2 norm of this part, measured at upload")
        )
        batch_op.add_column(
            sa.Column(
                "scale",
                sa.Float(),
                server_default="1",
                nullable=False,
                comment="Outlier factor of the apply: 1 as sent, <1 clipped, 0 refused",
            )
        )
        batch_op.add_column(
            sa.Column(
                "note", sa.String(length=300), nullable=True, comment="Why the apply clipped or refused this part"
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.drop_column("note")
        batch_op.drop_column("scale")
        batch_op.drop_column("norm")
    with op.batch_alter_table("runs", schema=None) as batch_op:
        batch_op.drop_column("max_lease_s")
