"""staged uploads: `contributions.staged_key` now also names an upload sent through the coordinator with its
sha256, staged in a local blob directory until an apply executor has hashed it (only the column's comment
changes)

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = "Direct upload still in the bucket's staging area, its values not verified yet"
NEW = "Upload still in the blob store's staging area, not yet verified by an apply executor"


def upgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.alter_column(
            "staged_key", existing_type=sa.String(length=300), existing_nullable=True, comment=NEW, existing_comment=OLD
        )


def downgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.alter_column(
            "staged_key", existing_type=sa.String(length=300), existing_nullable=True, comment=OLD, existing_comment=NEW
        )
