"""events of kind `apply_failed`: a module step that failed in an apply executor is recorded (the error, the
attempt, when it is tried again) and retried after a growing delay, instead of silently waiting out its claim

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 19:00:00

Only the CHECK constraint of `events.kind` changes (on SQLite, batch mode rebuilds the table). A downgrade
refuses while such events exist: delete them first (they are a log, nothing refers to them).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS_BEFORE = ("lease_expired", "upload_refused", "island_revoked")
KINDS = (*KINDS_BEFORE, "apply_failed")


def _condition(values: tuple[str, ...]) -> str:
    return "kind IN (" + ", ".join(f"'{v}'" for v in values) + ")"


def _set_kinds(values: tuple[str, ...]) -> None:
    with op.batch_alter_table("events", schema=None) as batch_op:
        batch_op.drop_constraint(op.f("ck_events_kind"), type_="check")
        batch_op.create_check_constraint(op.f("ck_events_kind"), _condition(values))


def upgrade() -> None:
    _set_kinds(KINDS)


def downgrade() -> None:
    failed = op.get_bind().execute(sa.text("SELECT COUNT(*) FROM events WHERE kind = 'apply_failed'")).scalar()
    if failed:
        raise RuntimeError(f"{failed} apply_failed event(s) exist: delete them before downgrading")
    _set_kinds(KINDS_BEFORE)
