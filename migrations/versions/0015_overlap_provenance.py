"""overlap provenance: `leases.pending_modules` lists the modules an overlap lease was issued at a version a due
step will make (without weights); `contribution_grads.rebased_at` keeps, for such a module, the inner steps its
island trained from its own end weights of the path before it moved onto that version (existing rows: NULL, as
they trained from their base versions), so that every upload of an overlap run can be replayed

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06 18:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "pending_modules",
                sa.JSON(),
                nullable=True,
                comment="Overlap leases: ids of the modules issued at the version a due step will make, without "
                "weights",
            )
        )
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "rebased_at",
                sa.Integer(),
                nullable=True,
                comment="Overlap leases: inner steps trained from the island's own end weights before it moved onto "
                "the base version; NULL: trained from the base version",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("contribution_grads", schema=None) as batch_op:
        batch_op.drop_column("rebased_at")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("pending_modules")
