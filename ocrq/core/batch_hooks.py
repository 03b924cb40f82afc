"""A batch's webhook (`callback_url` on POST /jobs/batch): where it waits until the batch ends.

Kept in PostgreSQL (`ocr_batch_hooks`, migrations/0011), beside the rows it waits on. Until
that revision it lived in the broker's Redis, and a Redis that lost its data lost it while the
sweep re-sent the batch's lost jobs from their rows: the batch ended and no webhook came. The
api registers the URL before it sends the batch's jobs, so a batch cannot end before its
webhook is known. Workers fire it (ocrq/worker/batch_hooks.py): `take` deletes the row and
returns its URL in one statement, so of all the workers that find the batch final exactly one
gets the URL and sends it.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from ocrq.core.broker_scan import as_text
from ocrq.core.db import ocr_batch_hooks

if TYPE_CHECKING:
    import redis

# Where registrations lived before migrations/0011: a hash, batch name -> URL.
LEGACY_KEY = "ocrq:batch-callbacks"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _insert(engine: Engine, batch: str, url: str, at: dt.datetime) -> Any:
    """An INSERT of one registration, in the dialect that has ON CONFLICT for it."""
    insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
    return insert(ocr_batch_hooks).values(batch=batch, url=url, registered_at=at)


def register(engine: Engine, batch: str, url: str) -> tuple[str, dt.datetime] | None:
    """The batch's webhook: the last one registered for a batch name wins. Returns the
    registration it replaced (url, registered_at), for `withdraw` to put back."""
    with engine.begin() as conn:
        before = conn.execute(
            select(ocr_batch_hooks.c.url, ocr_batch_hooks.c.registered_at)
            .where(ocr_batch_hooks.c.batch == batch)
            .with_for_update()
        ).first()
        stmt = _insert(engine, batch, url, _now())
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=["batch"],
                set_={"url": stmt.excluded.url, "registered_at": stmt.excluded.registered_at},
            )
        )
    return None if before is None else (str(before[0]), before[1])


def withdraw(
    engine: Engine, batch: str, url: str, previous: tuple[str, dt.datetime] | None
) -> None:
    """Undo `register(batch, url)` for a request refused before any of its jobs was recorded
    (a reused job_id): the registration it replaced is put back, or none is left. A 409 had
    moved `batch.finished` to the refused caller's URL. Only while the row is still the
    refused one's: a registration made since stays."""
    ours = (ocr_batch_hooks.c.batch == batch) & (ocr_batch_hooks.c.url == url)
    if previous is None:
        stmt: Any = delete(ocr_batch_hooks).where(ours)
    else:
        stmt = (
            update(ocr_batch_hooks)
            .where(ours)
            .values(url=previous[0], registered_at=previous[1])
        )
    with engine.begin() as conn:
        conn.execute(stmt)


def waiting(engine: Engine, names: Collection[str]) -> set[str]:
    """Which of these batches have a webhook not sent yet (one primary-key lookup for all)."""
    if not names:
        return set()
    with engine.connect() as conn:
        found = conn.execute(
            select(ocr_batch_hooks.c.batch).where(ocr_batch_hooks.c.batch.in_(list(names)))
        )
        return {r[0] for r in found}


def take(engine: Engine, batch: str) -> str | None:
    """The batch's webhook, removed: for one caller only, however many ask at once."""
    stmt = (
        delete(ocr_batch_hooks)
        .where(ocr_batch_hooks.c.batch == batch)
        .returning(ocr_batch_hooks.c.url)
    )
    with engine.begin() as conn:
        row = conn.execute(stmt).first()
    return None if row is None else str(row[0])


def pending(engine: Engine, older_than_s: float, limit: int) -> list[str]:
    """The batches whose webhooks were registered more than `older_than_s` ago and are not
    sent yet, oldest first: what a worker's periodic look re-checks, so a batch whose last job
    ended in a worker that died before it looked still fires."""
    cutoff = _now() - dt.timedelta(seconds=older_than_s)
    stmt = (
        select(ocr_batch_hooks.c.batch)
        .where(ocr_batch_hooks.c.registered_at < cutoff)
        .order_by(ocr_batch_hooks.c.registered_at)
        .limit(limit)
    )
    with engine.connect() as conn:
        return [r[0] for r in conn.execute(stmt)]


def pending_page(
    engine: Engine, older_than_s: float, limit: int, after: tuple[dt.datetime, str] | None
) -> list[tuple[dt.datetime, str]]:
    """`pending`'s rows as (registered_at, batch), oldest first, from just after `after`: a
    sweep pages through them all, so registrations that never fire (batches with no job, or
    one never final) cannot hide a later one. With 105 such older ones, reading the 100 oldest
    only, a batch's webhook never came."""
    cutoff = _now() - dt.timedelta(seconds=older_than_s)
    c = ocr_batch_hooks.c
    stmt = select(c.registered_at, c.batch).where(c.registered_at < cutoff)
    if after is not None:
        at, batch = after
        stmt = stmt.where((c.registered_at > at) | ((c.registered_at == at) & (c.batch > batch)))
    stmt = stmt.order_by(c.registered_at, c.batch).limit(limit)
    with engine.connect() as conn:
        return [(r[0], r[1]) for r in conn.execute(stmt)]


# The registration time given to one moved out of Redis, which kept none: it was registered
# before the upgrade, so the workers' sweep (older ones only) looks at it at once.
LEGACY_REGISTERED_AT = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def adopt_legacy(client: redis.Redis, engine: Engine) -> int:
    """Move registrations an older ocrq left in the broker's Redis into the table; how many.
    One that the table already has for the batch is newer there, and is kept."""
    moved = 0
    for raw_batch, raw_url in client.hgetall(LEGACY_KEY).items():
        stmt = _insert(engine, as_text(raw_batch), as_text(raw_url), LEGACY_REGISTERED_AT)
        with engine.begin() as conn:
            conn.execute(stmt.on_conflict_do_nothing(index_elements=["batch"]))
        client.hdel(LEGACY_KEY, raw_batch)
        moved += 1
    return moved
