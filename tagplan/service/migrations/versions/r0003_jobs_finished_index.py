"""jobs(status, finished_at): the index `JobStore.purge` reads finished jobs past their retention by.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the index (the table's rows are untouched)."""
    op.create_index("ix_jobs_status_finished", "jobs", ["status", "finished_at"], unique=False)


def downgrade() -> None:
    """Drop the index."""
    op.drop_index("ix_jobs_status_finished", table_name="jobs")
