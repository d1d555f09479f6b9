"""direct transfers: a contribution PUT by its island into the bucket waits in a staging area until an apply
executor has verified its values

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "staged_key",
                sa.String(length=300),
                nullable=True,
                comment="Direct upload still in the bucket's staging area, its values not verified yet",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.drop_column("staged_key")
