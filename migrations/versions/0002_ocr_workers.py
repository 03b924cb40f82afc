"""ocr_workers: one row per live worker process, its heartbeat refreshed every few seconds.

A per-worker row rather than a heartbeat column on ocr_jobs: a worker beats with one UPDATE
every OCRQ_HEARTBEAT_S whatever its job count, where a per-job column would rewrite every
running row of ocr_jobs (and its indexes) on each beat. A job is stalled when the worker named
in its `worker` column has stopped beating.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ocr_workers",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("hostname", sa.Text, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
    )
    # The stalled-job sweep looks up running rows by their worker.
    op.create_index(
        "ix_ocr_jobs_running_worker",
        "ocr_jobs",
        ["worker"],
        postgresql_where=sa.text("status = 'running'"),
        sqlite_where=sa.text("status = 'running'"),
    )


def downgrade() -> None:
    op.drop_index("ix_ocr_jobs_running_worker", table_name="ocr_jobs")
    op.drop_table("ocr_workers")
