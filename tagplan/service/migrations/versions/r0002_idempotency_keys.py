"""idempotency_keys: a tenant's `Idempotency-Key`, the request's digest and the job or trace it made.

Revision ID: 0002
Revises: 0001
Create Date: 2026-01-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create the table (keyed by tenant and key, so a key is unique per tenant)."""
    op.create_table(
        "idempotency_keys",
        sa.Column("tenant_id", sa.Integer(), nullable=False),
        sa.Column("key", sa.String(length=200), nullable=False),
        sa.Column("route", sa.String(length=100), nullable=False),
        sa.Column("body_sha256", sa.String(length=64), nullable=False),
        sa.Column("job_id", sa.String(length=32), nullable=True),
        sa.Column("trace_id", sa.String(length=32), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"]),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"]),
        sa.ForeignKeyConstraint(["trace_id"], ["traces.id"]),
        sa.PrimaryKeyConstraint("tenant_id", "key"))


def downgrade() -> None:
    """Drop the table (retries are no longer recognised)."""
    op.drop_table("idempotency_keys")
