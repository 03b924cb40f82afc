"""ocr_documents.notified_at: which worker sends a document's webhook, decided in the database.

Before this revision a page job that found its document final sent the document's webhook when
it assembled the document or when it had itself run a page; two page jobs finishing together
could both qualify (one assembled, the other found it final), and the producer got
`document.finished` twice. Now a worker sends it only after setting this column from NULL.

Documents already final are marked notified (their webhook went under the old rule), so a page
redelivered after the upgrade does not send it again. A nullable column without a default:
adding it rewrites no row and takes no long lock; the backfill touches final rows only.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_documents", sa.Column("notified_at", sa.DateTime(timezone=True)))
    op.execute(
        "UPDATE ocr_documents SET notified_at = finished_at WHERE finished_at IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_column("ocr_documents", "notified_at")
