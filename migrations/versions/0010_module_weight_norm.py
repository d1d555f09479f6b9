"""a module's weight norm: the L2 norm of its current weights, written with every version (existing rows stay
NULL: not measured)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("modules", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "weight_norm",
                sa.Float(),
                nullable=True,
                comment="L2 norm of the current weights, all tensors together (fp32); NULL: not measured",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("modules", schema=None) as batch_op:
        batch_op.drop_column("weight_norm")
