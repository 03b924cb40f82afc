"""The job and worker tables and engine construction, shared by workers (writes) and the api.

The schema itself is owned by Alembic (migrations/); this Table mirrors it for queries and for
the embedded SQLite file, which is created from it directly.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    JSON,
    Column,
    DateTime,
    Engine,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
)
from sqlalchemy.dialects.postgresql import JSONB

if TYPE_CHECKING:
    from ocrq.core.settings import Settings


def shown_database(url: str) -> str:
    """Where a database URL points, as logs show it: `host:port/dbname` (a SQLite file: its
    path), never its user or password."""
    from sqlalchemy.engine import make_url

    try:
        parts = make_url(url)
    except Exception:  # not a URL SQLAlchemy reads: show nothing of it rather than a secret
        return "(unparseable URL)"
    if not parts.host:
        return f"{parts.get_backend_name()}:{parts.database or ''}"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.host}{port}/{parts.database or ''}"


metadata = MetaData()

# JSONB on PostgreSQL (queryable, compact), plain JSON on SQLite.
JsonType = JSON().with_variant(JSONB(), "postgresql")
# The same, with Python None stored as SQL NULL (not JSON null), so `IS NULL` finds it.
NullableJson = JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")

ocr_jobs = Table(
    "ocr_jobs",
    metadata,
    Column("id", String(36), primary_key=True),
    # queued | running | done | failed | cancelled | expired (migrations/0007_deadlines)
    Column("status", String(16), nullable=False),
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
    # A page job's document and its page number, 1-based (migrations/0004); NULL for images.
    # The splitting job of a document has document_id = its own id and no page.
    Column("document_id", String(36), index=True),
    Column("page", Integer),
    # The image exactly as submitted, for re-sends (migrations/0006): {"path"|"url": ..,
    # "page"?: n}, a URL with its credentials (never shown: `source` is the display, redacted,
    # or a document page's name). NULL for inline images and rows from before 0006: a re-send
    # never rebuilds those from `source`, which is only a display name.
    Column("reference", NullableJson),
    # The job's deadline and its webhook (migrations/0007); NULL: none.
    Column("expires_at", DateTime(timezone=True)),
    Column("callback_url", Text),
    # The producer's grouping of jobs (migrations/0008); `batch_id` above is the engine batch.
    Column("batch", String(128), index=True),
    # User re-runs of a failed job (`ocrq retry`): the generation its message carries, and
    # `attempts` when the last one began (the worker-death cap counts from there).
    Column("retries", Integer, nullable=False, server_default="0"),
    Column("retry_attempts", Integer, nullable=False, server_default="0"),
    # The job's own output cap and lane (migrations/0009), so a re-send keeps them; NULL: the
    # worker's default cap, the bulk lane.
    Column("max_new_tokens", Integer),
    Column("priority", String(16)),
    # An upload's file name on the producer's side, for display only (migrations/0012).
    Column("file_name", String(255)),
)

# One row per document (PDF, multi-page TIFF; migrations/0004). Its pages are the ocr_jobs rows
# with its id in document_id; `status` becomes final (done | partial | failed) only when every
# page row is final, decided from those rows (ocrq/core/documents_store.py).
ocr_documents = Table(
    "ocr_documents",
    metadata,
    Column("id", String(36), primary_key=True),  # the job id the document was submitted under
    Column("status", String(16), nullable=False),  # running|done|partial|failed|cancelled
    Column("task", Text, nullable=False),
    Column("source", Text, nullable=False),
    Column("sha256", String(64)),
    Column("pages", Integer),  # page count; NULL when the document could not be opened
    Column("text", Text),  # the pages' text in order, joined by a blank line
    Column("result", JsonType),  # per page: page, job_id, status, size, text, lines, error
    Column("error", Text),  # why it failed, or which pages failed (partial)
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True)),
    # When a worker took the document's webhook to send (migrations/0010): set once, by the
    # one call that finds it NULL, so two page jobs ending together send it once.
    Column("notified_at", DateTime(timezone=True)),
)

# The bytes of a URL or inline document, stored once when it is split (migrations/0013;
# ocrq/core/documents_store.py): its page jobs name it instead of each carrying the document.
# Deleted with its document (the foreign key), and as soon as the document is done or cancelled.
ocr_document_bytes = Table(
    "ocr_document_bytes",
    metadata,
    Column(
        "document_id",
        String(36),
        ForeignKey("ocr_documents.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("data", LargeBinary, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)

# A batch's webhook until a worker sends it (migrations/0011; ocrq/core/batch_hooks.py): one row
# per batch name, deleted by the one worker that takes it.
ocr_batch_hooks = Table(
    "ocr_batch_hooks",
    metadata,
    Column("batch", String(128), primary_key=True),
    Column("url", Text, nullable=False),
    Column("registered_at", DateTime(timezone=True), nullable=False),
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
def get_engine(
    url: str,
    prepared_statements: bool = True,
    pool_size: int = 10,
    max_overflow: int = 0,
) -> Engine:
    """One pooled engine per URL and options per process; pre_ping survives a database restart.

    `prepared_statements=False` stops psycopg from preparing a statement after its fifth use on
    a connection (`prepare_threshold=None`): through PgBouncer in transaction mode (< 1.21, or
    without `max_prepared_statements`) consecutive transactions land on different server
    connections, where that prepared statement does not exist or already does.
    The pool's defaults (10, no overflow) come from bench/control_plane.py: an overflow
    connection is closed when returned while the pool is full, so overflow meant a new
    PostgreSQL session every few jobs (half its CPU) and up to 30 connections a worker.
    """
    url = sqlalchemy_url(url)
    if url.startswith("sqlite"):
        return create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
    connect_args: dict[str, Any] = {} if prepared_statements else {"prepare_threshold": None}
    return create_engine(
        url,
        pool_pre_ping=True,
        pool_size=pool_size,
        max_overflow=max_overflow,
        connect_args=connect_args,
    )


def engine_for(settings: Settings) -> Engine:
    """The job database's engine as OCRQ_DATABASE_* configure it."""
    return get_engine(
        settings.database_url,
        settings.database_prepared_statements,
        settings.database_pool_size,
        settings.database_max_overflow,
    )
