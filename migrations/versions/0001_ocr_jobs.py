"""ocr_jobs: one row per job id.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ocr_jobs",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("sha256", sa.String(64)),
        sa.Column("width", sa.Integer),
        sa.Column("height", sa.Integer),
        sa.Column("text", sa.Text),
        sa.Column("lines", sa.JSON().with_variant(postgresql.JSONB(), "postgresql")),
        sa.Column("error", sa.Text),
        sa.Column("engine", sa.String(32)),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("worker", sa.Text),
        sa.Column("batch_id", sa.String(36)),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True)),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'done', 'failed')", name="ocr_jobs_status_check"
        ),
    )
    op.create_index("ix_ocr_jobs_status", "ocr_jobs", ["status"])
    op.create_index("ix_ocr_jobs_sha256", "ocr_jobs", ["sha256"])


def downgrade() -> None:
    op.drop_table("ocr_jobs")
