"""`ocrq migrate`: create the database when it does not exist, then `alembic upgrade head`;
and the check workers run at start that the database is at that head."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from ocrq.core.db import sqlalchemy_url


def migrations_dir() -> Path:
    """The Alembic scripts: `ocrq/_migrations` in an installed wheel (setup.py maps the
    checkout's top-level `migrations/` there), else `migrations/` at the top of the checkout."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "_migrations", package.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        f"ocrq's migrations are missing (looked in {package / '_migrations'} and "
        f"{package.parent / 'migrations'}): reinstall ocrq"
    )


MIGRATIONS = migrations_dir()


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


class SchemaNotAtHead(RuntimeError):
    """The database's Alembic revision is not the one this code was written for."""

    def __init__(self, current: Sequence[str], head: Sequence[str]) -> None:
        self.current = tuple(current)
        self.head = tuple(head)
        super().__init__(
            f"database at revision {', '.join(self.current) or 'none'}, ocrq needs "
            f"{', '.join(self.head)}: run `ocrq migrate`"
        )


def head_revisions() -> tuple[str, ...]:
    """The newest revision(s) in migrations/, read from the script files (no database)."""
    return tuple(sorted(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()))


def current_revisions(url: str) -> tuple[str, ...]:
    """The revision(s) stamped in the database's alembic_version table; () when unmigrated."""
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return tuple(sorted(MigrationContext.configure(conn).get_current_heads()))
    finally:
        engine.dispose()


def check_at_head(url: str) -> None:
    """Raise SchemaNotAtHead unless the database is exactly at head.

    A worker on an older schema would fail every claim and ack the message with it (the job is
    lost); on a newer one it may write rows the schema no longer accepts. Either way it must not
    consume, so this runs before the worker connects to the broker.
    """
    current, head = current_revisions(url), head_revisions()
    if current != head:
        raise SchemaNotAtHead(current, head)
