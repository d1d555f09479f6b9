"""indexes for the per-round lookups of lease requests and uploads

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:00:00
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.create_index("ix_leases_run_id_round", ["run_id", "round"], unique=False)
        batch_op.create_index("ix_leases_path_id_round", ["path_id", "round"], unique=False)
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.create_index("ix_contributions_run_id_round", ["run_id", "round"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.drop_index("ix_contributions_run_id_round")
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_index("ix_leases_path_id_round")
        batch_op.drop_index("ix_leases_run_id_round")
