"""Alembic environment: the URL comes from ocrq's Settings (OCRQ_DATABASE_URL), not alembic.ini."""

from alembic import context

from ocrq.core.db import get_engine, metadata, sqlalchemy_url

config = context.config
url = sqlalchemy_url(config.get_main_option("sqlalchemy.url") or "")

if context.is_offline_mode():
    context.configure(url=url, target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    with get_engine(url).connect() as connection:
        context.configure(connection=connection, target_metadata=metadata)
        with context.begin_transaction():
            context.run_migrations()
