"""`ocrq migrate`: create the database when it does not exist, then `alembic upgrade head`."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ocrq.db import sqlalchemy_url

MIGRATIONS = Path(__file__).resolve().parents[1] / "migrations"


def ensure_database(url: str) -> None:
    """PostgreSQL only: CREATE DATABASE if the target database is missing."""
    parsed = make_url(sqlalchemy_url(url))
    if not parsed.drivername.startswith("postgresql") or not parsed.database:
        return
    admin = create_engine(parsed.set(database="postgres"), isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            exists = conn.execute(
                text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": parsed.database}
            ).first()
            if not exists:
                conn.execute(text(f'CREATE DATABASE "{parsed.database}"'))
    finally:
        admin.dispose()


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return config


def upgrade(url: str) -> None:
    ensure_database(url)
    command.upgrade(alembic_config(url), "head")
