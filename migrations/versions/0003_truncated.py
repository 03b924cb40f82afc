"""ocr_jobs.truncated: why a done job's text may be incomplete.

NULL when the model finished its answer; "max_tokens" when the generation cap cut it;
"repetition" when the engine stopped a row whose output had fallen into a loop (the text then
keeps one copy of the repeated part). A nullable column without a default: adding it rewrites no
row, and rows written before it read as NULL (nothing known to be cut).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-12
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("ocr_jobs", sa.Column("truncated", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("ocr_jobs", "truncated")
