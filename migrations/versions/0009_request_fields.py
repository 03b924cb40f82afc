"""ocr_jobs.max_new_tokens and ocr_jobs.priority: the rest of a job's request, kept for re-sends.

A re-sent job (the recovery sweep, `ocrq requeue`, `ocrq retry`) is rebuilt from its row. Before
this revision the row kept neither the job's own output cap nor its lane, so a re-sent job ran
with the worker's default cap and went to the bulk lane whatever the producer asked. NULL means
what it meant in the message: the worker's default cap, and the bulk lane.

Nullable columns without defaults: adding them rewrites no row and takes no long lock.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("max_new_tokens", sa.Integer, nullable=True))
    op.add_column("ocr_jobs", sa.Column("priority", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("ocr_jobs", "priority")
    op.drop_column("ocr_jobs", "max_new_tokens")
