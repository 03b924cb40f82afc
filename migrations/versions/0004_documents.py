"""Documents: ocr_documents, and each page job's document and page number on ocr_jobs.

A document (PDF, multi-page TIFF) is split into one ordinary job per page; the page rows point
at their document (`document_id`, `page`, both nullable: NULL for image jobs, so adding them
rewrites no row). The document's row holds what belongs to the whole: source, hash, page count,
status and the assembled result. Its status is decided from its page rows when the last one is
stored (never from a counter, which a redelivered page would make drift).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-14
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("document_id", sa.String(36), nullable=True))
    op.add_column("ocr_jobs", sa.Column("page", sa.Integer, nullable=True))
    # A document's completion check reads its page rows by document_id.
    op.create_index("ix_ocr_jobs_document_id", "ocr_jobs", ["document_id"])
    op.create_table(
        "ocr_documents",
        sa.Column("id", sa.String(36), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("task", sa.Text, nullable=False),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("sha256", sa.String(64)),
        sa.Column("pages", sa.Integer),
        sa.Column("text", sa.Text),
        sa.Column("result", sa.JSON().with_variant(postgresql.JSONB(), "postgresql")),
        sa.Column("error", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.CheckConstraint(
            "status IN ('running', 'done', 'partial', 'failed')",
            name="ocr_documents_status_check",
        ),
    )


def downgrade() -> None:
    op.drop_table("ocr_documents")
    op.drop_index("ix_ocr_jobs_document_id", "ocr_jobs")
    op.drop_column("ocr_jobs", "page")
    op.drop_column("ocr_jobs", "document_id")
