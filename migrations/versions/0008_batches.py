"""ocr_jobs.batch, and the retry generation of a job a user re-ran.

batch: the producer's own grouping of jobs (`ocrq submit --batch`, `"batch"` in a message or an
api request; the api gives one to a batch request that names none). Not `batch_id`, which is
the engine batch that ran the job. Indexed: `GET /batches/{id}`, `ocrq wait BATCH` and
`ocrq export --batch` read a batch's rows by it. Built CONCURRENTLY on PostgreSQL, so producers
and workers keep writing while it builds.

retries, retry_attempts: `ocrq retry` (POST /jobs/retry) puts a failed row back to `queued`
and sends it again as an explicit new attempt: `retries` counts those re-runs and is the
generation the re-sent message carries, so a claim tells the new attempt from a late copy of an
old message (a failed row stays final for those); `retry_attempts` is `attempts` when the last
re-run began, so the worker-death cap (OCRQ_MAX_ATTEMPTS) counts the current run's attempts
while `attempts` keeps counting all of them. Columns with constant defaults rewrite no row.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("batch", sa.String(128), nullable=True))
    op.add_column(
        "ocr_jobs", sa.Column("retries", sa.Integer, nullable=False, server_default="0")
    )
    op.add_column(
        "ocr_jobs", sa.Column("retry_attempts", sa.Integer, nullable=False, server_default="0")
    )
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_ocr_jobs_batch",
            "ocr_jobs",
            ["batch"],
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_ocr_jobs_batch", table_name="ocr_jobs")
    op.drop_column("ocr_jobs", "retry_attempts")
    op.drop_column("ocr_jobs", "retries")
    op.drop_column("ocr_jobs", "batch")
