"""Deadlines, cancel and webhooks: two final statuses and two columns on ocr_jobs.

`cancelled` (DELETE /jobs/{id}, `ocrq cancel`) and `expired` (past the job's deadline before it
ran) are final like done and failed: no claim runs such a row and no finish overwrites it. The
status CHECK constraint is rebuilt to allow them (NOT VALID, then VALIDATE: the new constraint
only widens the old one, and validating takes no lock that blocks writers).

expires_at: the job's deadline, recorded by the producer, so a re-send from the row (`ocrq
requeue`, the stalled sweep) still carries it and a claim after it refuses the job.
callback_url: where the worker POSTs the job's signed outcome once its row is final.
Both nullable without a default: adding them rewrites no row.

ix_ocr_jobs_finished_at: retention (`ocrq prune`) deletes final rows by finished_at.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

OLD = "status IN ('queued', 'running', 'done', 'failed')"
NEW = "status IN ('queued', 'running', 'done', 'failed', 'cancelled', 'expired')"


def _status_check(condition: str) -> None:
    op.drop_constraint("ocr_jobs_status_check", "ocr_jobs", type_="check")
    op.execute(
        f"ALTER TABLE ocr_jobs ADD CONSTRAINT ocr_jobs_status_check CHECK ({condition}) NOT VALID"
    )
    op.execute("ALTER TABLE ocr_jobs VALIDATE CONSTRAINT ocr_jobs_status_check")


def upgrade() -> None:
    _status_check(NEW)
    op.add_column("ocr_jobs", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("ocr_jobs", sa.Column("callback_url", sa.Text, nullable=True))
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_ocr_jobs_finished_at",
            "ocr_jobs",
            ["finished_at"],
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_ocr_jobs_finished_at", table_name="ocr_jobs")
    op.drop_column("ocr_jobs", "callback_url")
    op.drop_column("ocr_jobs", "expires_at")
    op.execute(
        "UPDATE ocr_jobs SET status = 'failed', error = status WHERE status IN "
        "('cancelled', 'expired')"
    )
    _status_check(OLD)
