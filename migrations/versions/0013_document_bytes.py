"""ocr_document_bytes: a URL or inline document's bytes, stored once for its page jobs.

Before this revision a URL or inline document was sent on page by page as one-page PDFs. A page
holds every resource it uses, so pages that share one image carried that image each: 40 pages
of a 1.06 MB file wrote 153.7 MB to Redis, 1,000 pages of a 422 KB file 742 MB (issue 52). The
splitting job now stores the document here once and its page messages name it
(`{"document": id, "page": n}`); the row goes with its document (ON DELETE CASCADE) and as
soon as the document is done or cancelled.

A document whose own job is cancelled while it is split is now `cancelled` itself (final): its
status check takes that value.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

OLD = "status IN ('running', 'done', 'partial', 'failed')"
NEW = "status IN ('running', 'done', 'partial', 'failed', 'cancelled')"


def _status_check(condition: str) -> None:
    op.drop_constraint("ocr_documents_status_check", "ocr_documents", type_="check")
    op.execute(
        "ALTER TABLE ocr_documents ADD CONSTRAINT ocr_documents_status_check "
        f"CHECK ({condition}) NOT VALID"
    )
    op.execute("ALTER TABLE ocr_documents VALIDATE CONSTRAINT ocr_documents_status_check")


def upgrade() -> None:
    _status_check(NEW)
    op.create_table(
        "ocr_document_bytes",
        sa.Column(
            "document_id",
            sa.String(36),
            sa.ForeignKey("ocr_documents.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("data", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ocr_document_bytes")
    op.execute(
        "UPDATE ocr_documents SET status = 'failed', error = 'cancelled' "
        "WHERE status = 'cancelled'"
    )
    _status_check(OLD)
