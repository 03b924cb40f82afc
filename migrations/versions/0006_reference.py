"""ocr_jobs.reference: the image exactly as submitted, kept apart from its display name.

Re-sends (`ocrq requeue`, the stall sweep) rebuilt a job's message from its row's `source`,
which is a display name: URLs redacted (`token=***`), so a re-sent URL job fetched the wrong
URL and failed, and an inline job's producer-chosen `name` was taken for a path, so the job was
re-run as another file and stored that file's text (issue 31, item 6). `reference` holds the
path or the whole URL and the page; re-sends use it alone. NULL (inline images, and rows
written before this revision) means "cannot be rebuilt": such a job's own message in Redis is
its only copy. A nullable column without a default rewrites no row.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "ocr_jobs",
        sa.Column(
            "reference",
            sa.JSON(none_as_null=True).with_variant(
                postgresql.JSONB(none_as_null=True), "postgresql"
            ),
            nullable=True,
        ),
    )


def downgrade() -> None:
    op.drop_column("ocr_jobs", "reference")
