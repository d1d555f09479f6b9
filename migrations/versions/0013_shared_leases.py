"""shared leases: `leases.shared` marks a lease issued on a path another lease held (async path sharing, run
field `path_leases`), so an island's home path is that of its latest lease that is not shared (existing rows:
false); `leases.first_step` keeps an async lease's first global inner step (existing rows: NULL, as the step
was derived before)

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 08:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column(
                "first_step",
                sa.Integer(),
                nullable=True,
                comment="All-async runs: the path's inner steps before this lease's range; NULL: round x H",
            )
        )
        batch_op.add_column(
            sa.Column(
                "shared",
                sa.Boolean(),
                server_default=sa.false(),
                nullable=False,
                comment="Issued on a path another lease held (async path sharing): not its island's home path",
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("leases", schema=None) as batch_op:
        batch_op.drop_column("shared")
        batch_op.drop_column("first_step")
