"""The job and worker tables and engine construction, shared by workers (writes) and the api.

The schema itself is owned by Alembic (migrations/); this Table mirrors it for queries and for
the embedded SQLite file, which is created from it directly.
"""

from __future__ import annotations

from functools import lru_cache

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

# JSONB on PostgreSQL (queryable, compact), plain JSON on SQLite.
JsonType = JSON().with_variant(JSONB(), "postgresql")

ocr_jobs = Table(
    "ocr_jobs",
    metadata,
    Column("id", String(36), primary_key=True),
    Column("status", String(16), nullable=False),  # queued | running | done | failed
    Column("task", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("sha256", String(64)),
    Column("width", Integer),
    Column("height", Integer),
    Column("text", Text),
    Column("lines", JsonType),
    Column("error", Text),
    Column("truncated", String(16)),  # None | max_tokens | repetition (migrations/0003)
    Column("max_pixels", Integer),  # the job's own pixel cap, for re-sends (migrations/0005)
    Column("engine", String(32)),
    Column("attempts", Integer, nullable=False, server_default="0"),
    Column("worker", Text),
    Column("batch_id", String(36)),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("started_at", DateTime(timezone=True)),
    Column("finished_at", DateTime(timezone=True)),
)

# One row per live worker process (migrations/versions/0002): `name` is what claim() writes to
# ocr_jobs.worker; a stale `heartbeat_at` marks the process dead and its running jobs stalled.
ocr_workers = Table(
    "ocr_workers",
    metadata,
    Column("name", Text, primary_key=True),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("heartbeat_at", DateTime(timezone=True), nullable=False),
)


def sqlalchemy_url(url: str) -> str:
    """Accept the plain `postgresql://` form users paste and use psycopg 3 for it."""
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


@lru_cache(maxsize=8)
def get_engine(url: str) -> Engine:
    """One pooled engine per URL per process; pre_ping survives a database restart."""
    url = sqlalchemy_url(url)
    if url.startswith("sqlite"):
        return create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)
