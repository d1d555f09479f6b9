"""codecs on the wire: each contribution records the codec it was encoded with and its size as received

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 14:00:00

Uploads accepted before this revision were fp32 (the only codec then); their size is unknown (0).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("codec", sa.String(length=8), server_default="fp32", nullable=False))
        batch_op.add_column(sa.Column("upload_bytes", BigInt, server_default="0", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("contributions", schema=None) as batch_op:
        batch_op.drop_column("upload_bytes")
        batch_op.drop_column("codec")
