"""The purge reads through partial indexes of what still holds users' content (a
result, arguments, error text, a stored answer, a note), one per thing it removes, and
in batches that each commit: the hourly purge costs what is left to purge, not the
history.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

#: What the purge looks for, by table (schema.PURGEABLE as of this revision).
PURGEABLE = {
    "operations": "result IS NOT NULL OR payload IS NOT NULL OR error IS NOT NULL",
    "waiting": "completed_at IS NULL AND payload IS NOT NULL",
    "side_effects": "result IS NOT NULL",
    "attempts": "note IS NOT NULL OR answer IS NOT NULL",
}

INDEXES = (
    ("ix_attempts_purgeable", "attempts", "resolved_at", PURGEABLE["attempts"]),
    ("ix_operations_purgeable", "operations", "completed_at", PURGEABLE["operations"]),
    ("ix_operations_waiting_payload", "operations", "updated_at", PURGEABLE["waiting"]),
    ("ix_side_effects_purgeable", "side_effects", "completed_at", PURGEABLE["side_effects"]),
)


def upgrade() -> None:
    for name, table, column, where in INDEXES:
        op.create_index(
            name,
            table,
            [column],
            postgresql_where=sa.text(where),
            sqlite_where=sa.text(where),
        )


def downgrade() -> None:
    for name, table, _, _ in INDEXES:
        op.drop_index(name, table_name=table)
