"""ocr_jobs.file_name: the name an uploaded file had on the producer's side, for display only.

Uploads are stored under their SHA-256 (ocrq/api/uploads.py), so a job, `ocrq status`, an
export and the viewer showed only `.../ab/abcdef...`; a user could not tell which of their
files a job was. The api keeps the client's file name here (directory parts dropped, control
characters removed, at most 255 characters): shown beside the path, never used to store, read
or name anything on disk. NULL for jobs that named their image by path, URL or b64.

A nullable column without a default: adding it rewrites no row and takes no long lock.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("file_name", sa.String(255), nullable=True))


def downgrade() -> None:
    op.drop_column("ocr_jobs", "file_name")
