"""ocr_jobs.max_pixels, and an index for listing jobs newest first.

max_pixels: a job's own cap on the pixels the model sees travels in its message; a job sent
again from its row (`ocrq requeue`, the stalled sweep) must carry it too, so the producer
records it. NULL: the engine's per-task default, as before. A nullable column without a default
rewrites no row.

ix_ocr_jobs_created_at: `GET /jobs` and `ocrq jobs` page through jobs by (created_at, id),
newest first; without it each page sorts the whole table. Built CONCURRENTLY on PostgreSQL (out
of the migration's transaction), so producers and workers keep writing while it builds.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-20
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("max_pixels", sa.Integer, nullable=True))
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_ocr_jobs_created_at",
            "ocr_jobs",
            ["created_at", "id"],
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    op.drop_index("ix_ocr_jobs_created_at", table_name="ocr_jobs")
    op.drop_column("ocr_jobs", "max_pixels")
