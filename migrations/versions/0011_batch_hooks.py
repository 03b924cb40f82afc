"""ocr_batch_hooks: a batch's webhook, kept where the batch's rows are.

Before this revision the api kept a batch's `callback_url` in the broker's Redis (a hash
`ocrq:batch-callbacks`). A Redis that lost its data (no persistence, a failover before the
replica had it) lost the registration, while the sweep re-sent the batch's lost jobs from their
rows: the batch ran to the end and its webhook never came. A row here is the registration;
the worker that finds the batch final deletes it (DELETE ... RETURNING: one taker) and sends.
Registrations still in Redis at the upgrade are moved here by the first worker that starts
(ocrq/worker/batch_hooks.py).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "ocr_batch_hooks",
        sa.Column("batch", sa.String(128), primary_key=True),
        sa.Column("url", sa.Text, nullable=False),
        sa.Column("registered_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("ocr_batch_hooks")
