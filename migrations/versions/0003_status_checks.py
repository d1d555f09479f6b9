"""status columns take only their enum's values (CHECK constraints)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00

The statuses were free strings; the models now declare them as enums (coordinator/states.py). The values stored
do not change, so no data moves: each table gets a CHECK constraint `ck_<table>_status`. On SQLite, batch mode
rebuilds each table (foreign keys are off in the migration connection, so the rebuild cascades nothing).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The values as of this revision (a later change of coordinator/states.py needs a migration of its own).
STATES: dict[str, tuple[str, ...]] = {
    "runs": ("waiting_for_shards", "running", "finished"),
    "rounds": ("open", "applied"),
    "leases": ("offered", "active", "submitted", "expired", "released"),
    "contributions": ("accepted",),
    "islands": ("active", "left", "revoked"),
}


def _condition(values: tuple[str, ...]) -> str:
    return "status IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def upgrade() -> None:
    for table, values in STATES.items():
        bad = (
            op.get_bind()
            .execute(sa.text(f"SELECT DISTINCT status FROM {table} WHERE NOT ({_condition(values)})"))
            .scalars()
            .all()
        )
        if bad:
            raise RuntimeError(f"table {table} holds statuses {sorted(bad)} outside {list(values)}; fix them first")
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_check_constraint(op.f(f"ck_{table}_status"), _condition(values))


def downgrade() -> None:
    for table in reversed(list(STATES)):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f"ck_{table}_status"), type_="check")
