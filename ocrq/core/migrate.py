"""`ocrq migrate`: create the database when it does not exist, then `alembic upgrade head`;
and the check workers run at start that the database is at that head."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import DBAPIError
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
                try:
                    conn.execute(text(f'CREATE DATABASE "{parsed.database}"'))
                except DBAPIError as exc:  # another migrate created it meanwhile: PostgreSQL
                    # says duplicate_database, or a unique violation when both ran at once
                    if getattr(exc.orig, "sqlstate", None) not in ("42P04", "23505"):
                        raise
    finally:
        admin.dispose()


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(url).replace("%", "%%"))
    return config


# pg_advisory_lock key held by `ocrq migrate` for its whole upgrade ("ocrq" + 2; retention's pass
# uses + 1). Why: some revisions commit part-way (CREATE INDEX CONCURRENTLY runs outside the
# upgrade's transaction), so without it a worker starting beside a migrate could read a revision
# in between and refuse to start (exit 78, which no supervisor retries); two migrates at once
# (replicas of a compose service) would also race. A starting worker takes it shared
# (check_at_head(wait_for_migrate=True)): it reads the revision once a running upgrade ended.
MIGRATE_LOCK_KEY = 0x6F637271_0002
LOCK_POLL_S = 0.25  # between two tries for it (see _take)


def _postgres(url: str) -> bool:
    return make_url(sqlalchemy_url(url)).drivername.startswith("postgresql")


def _take(conn: Connection, function: str) -> None:
    """Take MIGRATE_LOCK_KEY with `function` (a pg_try_advisory_lock* of the session), asking
    again until it is granted. Why not the blocking form: a session waiting for a lock sits in
    a transaction, and CREATE INDEX CONCURRENTLY in the running upgrade waits for every
    transaction of the database to end, so the two would wait on each other; each try here
    ends at once."""
    while not conn.execute(text(f"SELECT {function}(:k)"), {"k": MIGRATE_LOCK_KEY}).scalar():
        time.sleep(LOCK_POLL_S)


def upgrade(url: str) -> None:
    ensure_database(url)
    if not _postgres(url):
        command.upgrade(alembic_config(url), "head")
        return
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:  # a session lock, held while Alembic uses its own
            _take(conn, "pg_try_advisory_lock")
            try:
                command.upgrade(alembic_config(url), "head")
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
    finally:
        engine.dispose()


class SchemaNotAtHead(RuntimeError):
    """The database's Alembic revision is not the one this code was written for."""

    def __init__(self, current: Sequence[str], head: Sequence[str]) -> None:
        self.current = tuple(current)
        self.head = tuple(head)
        super().__init__(
            f"database at revision {', '.join(self.current) or 'none'}, ocrq needs "
            f"{', '.join(self.head)}: run `ocrq migrate`"
        )


    @property
    def behind(self) -> bool:
        """Unmigrated, or at revisions this code knows (older ones); not behind: a revision of
        a newer ocrq, which no `ocrq migrate` of this version mends. A property: it reads the
        scripts, and only a starting worker asks (a readiness probe only says the message)."""
        script = ScriptDirectory.from_config(alembic_config("sqlite://"))
        return all(_known(script, r) for r in self.current)


def head_revisions() -> tuple[str, ...]:
    """The newest revision(s) in migrations/, read from the script files (no database)."""
    return tuple(sorted(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads()))


def _known(script: ScriptDirectory, revision: str) -> bool:
    try:
        return script.get_revision(revision) is not None
    except Exception:  # alembic's error for a revision it has no script of
        return False


class MigrationRunning(RuntimeError):
    """`ocrq migrate` holds its lock: the revision read now could be one it is passing."""


def current_revisions(url: str, *, wait_for_migrate: bool | None = None) -> tuple[str, ...]:
    """The revision(s) stamped in the database's alembic_version table; () when unmigrated.

    On PostgreSQL, `wait_for_migrate` reads them in a transaction holding MIGRATE_LOCK_KEY
    shared: True waits for a running `ocrq migrate` to end, False raises MigrationRunning while
    one runs (a probe must answer at once); None reads without the lock. A transaction's lock,
    not a session's: through PgBouncer in transaction mode (docs/operations.md) only a
    transaction stays on one server connection, and a session lock could be left behind on one."""
    locked = wait_for_migrate is not None and _postgres(url)
    engine = create_engine(sqlalchemy_url(url), poolclass=NullPool)
    try:
        with engine.connect() as conn:
            while True:
                with conn.begin():
                    if not locked or conn.execute(
                        text("SELECT pg_try_advisory_xact_lock_shared(:k)"),
                        {"k": MIGRATE_LOCK_KEY},
                    ).scalar():
                        return tuple(sorted(MigrationContext.configure(conn).get_current_heads()))
                if not wait_for_migrate:
                    raise MigrationRunning("`ocrq migrate` is running")
                time.sleep(LOCK_POLL_S)  # each try a short transaction (see _take)
    finally:
        engine.dispose()


def check_at_head(url: str, *, wait_for_migrate: bool = False) -> None:
    """Raise SchemaNotAtHead unless the database is exactly at head (MigrationRunning while an
    `ocrq migrate` runs, unless `wait_for_migrate`: then its end is waited for).

    A worker on an older schema would fail every claim and ack the message with it (the job is
    lost); on a newer one it may write rows the schema no longer accepts. Either way it must not
    consume, so this runs before the worker connects to the broker.
    """
    current = current_revisions(url, wait_for_migrate=wait_for_migrate)
    head = head_revisions()
    if current != head:
        raise SchemaNotAtHead(current, head)
