"""held-out slices: a path's held-out tokens next to its shard, and the held-out loss each contribution's island
scored its start weights at (existing rows stay NULL: no slice, not scored)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09 12:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "heldout_hash", sa.String(length=64), nullable=True, comment="The path's held-out slice (uint16 tokens)"
            )
        )
        batch_op.add_column(
            sa.Column("heldout_tokens", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True)
        )
        batch_op.add_column(
            sa.Column("heldout_documents", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True)
        )
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "heldout_loss",
                sa.Float(),
                nullable=True,
                comment="The lease's start weights scored on the path's held-out slice by the island; NULL: not scored",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.drop_column("heldout_loss")
    with op.batch_alter_table("shards", schema=None) as batch_op:
        batch_op.drop_column("heldout_documents")
        batch_op.drop_column("heldout_tokens")
        batch_op.drop_column("heldout_hash")
