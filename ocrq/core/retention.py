"""Retention: delete what is old and finished, never what is in flight.

`ocrq prune --older-than 30d` and, with OCRQ_RETENTION_DAYS set, each worker's daily pass run
`prune`. Deleted: job rows in a final status (done, failed, cancelled, expired) that finished
before the cutoff, except page jobs of a document still running (its result is assembled from
them); document rows final before the cutoff with no page left in flight; and files in
OCRQ_UPLOAD_DIR older than the cutoff that no remaining row names; and batch webhooks
registered before the cutoff whose batch has no job in flight and none that finished after the
cutoff (its jobs were never sent, or it ended that long ago and the webhook could not be sent
since). Queued and running rows are never touched, whatever their age (`ocrq requeue` is for
those); nor is a job cancelled before it ever ran while its message may still wait in the
broker: with its row gone, a worker taking that message would see a new job and run it.

One pass at a time across workers: the daily pass takes a PostgreSQL advisory lock
(`pg_try_advisory_lock`) and a worker that does not get it skips that day's pass.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import (
    ColumnElement,
    Engine,
    Table,
    and_,
    delete,
    exists,
    false,
    func,
    not_,
    or_,
    select,
    text,
)
from sqlalchemy.exc import OperationalError

from ocrq.core.contract import PAGE_MARK
from ocrq.core.db import ocr_batch_hooks, ocr_documents, ocr_jobs
from ocrq.core.store import FINAL
from ocrq.core.upload_paths import upload_folder_of

if TYPE_CHECKING:
    from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

# Which of these job ids may still have a message in the broker (a superset is safe: those
# rows are kept for a later pass). `prune`'s argument; `queued_in_broker` makes one.
StillQueued = Callable[[Collection[str]], set[str]]

DOCUMENT_FINAL = ("done", "partial", "failed", "cancelled")
# pg_try_advisory_lock key for the daily pass: any fixed number no other code uses ("ocrq" + 1).
LOCK_KEY = 0x6F637271_0001


@dataclass(frozen=True)
class Pruned:
    jobs: int
    documents: int
    uploads: int
    batch_hooks: int = 0
    # Why old unreferenced uploads were left where they are (the folder read-only here), or
    # None: they stay unreferenced, and a prune where the folder is writable deletes them.
    uploads_left: str | None = None


def prune(
    db: Engine,
    cutoff: dt.datetime,
    upload_dir: Path | None = None,
    dry_run: bool = False,
    still_queued: StillQueued | None = None,
) -> Pruned:
    """Delete final rows and unreferenced uploads older than `cutoff` (see the module).

    `dry_run` (`ocrq prune --dry-run`): count what would be deleted, with the very predicates
    the deletes use, and delete nothing. Counting first is exact: each predicate excludes what
    another deletes (a job deleted is final and finished before the cutoff, which neither the
    documents' nor the webhooks' predicate looks for), so the order the deletes run in does
    not change what each finds; the uploads a dry run counts are those no row would still name
    after the deletes. Counts, not a rolled-back delete: no row is locked meanwhile.
    `still_queued` says which never-run cancelled jobs may still have a message; without it
    every such job is kept (nothing else can tell a late message from a new job).
    """
    spared = _spared(db, cutoff, still_queued)
    doomed = _doomed(cutoff, spared)
    with db.begin() as conn:
        if dry_run:
            jobs, documents, hooks = (
                conn.execute(select(func.count()).select_from(table).where(where)).scalar_one()
                for table, where in doomed
            )
        else:
            jobs, documents, hooks = (
                conn.execute(delete(table).where(where)).rowcount for table, where in doomed
            )
    uploads, left = (
        _prune_uploads(db, upload_dir, cutoff, doomed, dry_run)
        if upload_dir is not None
        else (0, None)
    )
    return Pruned(jobs, documents, uploads, hooks, left)


def _never_ran(cutoff: dt.datetime) -> ColumnElement[bool]:
    """Jobs cancelled before they ran: their message may still be queued (a cancel marks the
    row; the message stays in the broker until a worker takes and drops it)."""
    return and_(
        ocr_jobs.c.status == "cancelled",
        ocr_jobs.c.started_at.is_(None),
        ocr_jobs.c.finished_at < cutoff,
    )


def _spared(
    db: Engine, cutoff: dt.datetime, still_queued: StillQueued | None
) -> ColumnElement[bool]:
    """The never-run cancelled jobs a prune must keep: those whose message may be queued."""
    if still_queued is None:
        return _never_ran(cutoff)
    with db.connect() as conn:
        ids = list(conn.execute(select(ocr_jobs.c.id).where(_never_ran(cutoff))).scalars())
    if not ids:
        return false()
    try:
        waiting = still_queued(ids)
    except Exception as exc:  # the broker away: keep them all, a later pass looks again
        log.warning(
            "retention: cannot read the broker's queues (%s); never-run cancelled "
            "jobs are kept for a later pass",
            exc,
        )
        return _never_ran(cutoff)
    return ocr_jobs.c.id.in_(sorted(waiting)) if waiting else false()


def queued_in_broker(settings: Settings) -> StillQueued:
    """`prune`'s `still_queued` read from the broker's queue lists (every bound queue, both
    lanes); a broker that is not Redis cannot be read, and then every id may be queued."""
    from ocrq.core.broker_scan import broker_view
    from ocrq.core.requeue import producer_app, queue_of

    def still_queued(ids: Collection[str]) -> set[str]:
        app = producer_app(settings)
        try:
            with broker_view(app, queue_of(settings)) as view:
                if view is None:
                    return set(ids)
                found, whole = view.queued(ids, None)
                return found if whole else set(ids)
        finally:
            app.close()

    return still_queued


def _doomed(
    cutoff: dt.datetime, spared: ColumnElement[bool]
) -> list[tuple[Table, ColumnElement[bool]]]:
    """What `prune` deletes, table by table (jobs, documents, batch webhooks): one predicate
    each, shared by the deletes and the dry run's counts so the two cannot drift apart."""
    pages = ocr_jobs.alias("pages")
    docs_in_flight = select(ocr_documents.c.id).where(ocr_documents.c.status.not_in(DOCUMENT_FINAL))
    old_jobs = and_(
        ocr_jobs.c.status.in_(FINAL),
        ocr_jobs.c.finished_at < cutoff,
        or_(ocr_jobs.c.document_id.is_(None), ocr_jobs.c.document_id.not_in(docs_in_flight)),
        not_(spared),
    )
    old_documents = and_(
        ocr_documents.c.status.in_(DOCUMENT_FINAL),
        ocr_documents.c.finished_at < cutoff,
        ~exists().where(
            and_(pages.c.document_id == ocr_documents.c.id, pages.c.status.not_in(FINAL))
        ),
    )
    stale_hooks = and_(
        ocr_batch_hooks.c.registered_at < cutoff,
        ~exists().where(
            and_(
                ocr_jobs.c.batch == ocr_batch_hooks.c.batch,
                or_(ocr_jobs.c.status.not_in(FINAL), ocr_jobs.c.finished_at >= cutoff),
            )
        ),
    )
    return [(ocr_jobs, old_jobs), (ocr_documents, old_documents), (ocr_batch_hooks, stale_hooks)]


def _prune_uploads(
    db: Engine,
    folder: Path,
    cutoff: dt.datetime,
    doomed: list[tuple[Table, ColumnElement[bool]]],
    dry_run: bool = False,
) -> tuple[int, str | None]:
    """Files with an upload's shape under `folder`, older than `cutoff` (mtime: the api
    writes a file again when the same bytes are uploaded), named by no row that outlives this
    prune; how many were deleted (`dry_run`: how many would be), and why the rest were not when
    the folder cannot be written here (the shipped workers mount it read-only: the first
    refusal ends the pass over the files).

    References are read without the rows the prune deletes, so a dry run (rows still there)
    counts what the real run deletes. An upload re-used while the pass runs is kept: the api
    writes the file anew before it records the job's row, so a file is first moved aside
    (atomically), then deleted only if what was moved is still old; otherwise it goes back."""
    root = folder  # as the api spells it in the rows it writes (not resolved: a symlinked
    # folder resolved would match no row, and every upload would look unreferenced)
    candidates = [
        p for p in root.glob("??/*") if upload_folder_of(str(p)) == root and _old(p, cutoff)
    ]
    if not candidates:
        return 0, None
    named = {str(p) for p in candidates}
    referenced: set[str] = set()
    with db.connect() as conn:
        for table, where in doomed[:2]:  # jobs, documents
            query = select(table.c.source).where(table.c.source.like(f"{root}/%"), not_(where))
            referenced.update(s.split(PAGE_MARK, 1)[0] for s in conn.execute(query).scalars())
    if dry_run:
        return len(named - referenced), None
    removed = 0
    for path in sorted(named - referenced):
        aside = f"{path}.pruning-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, aside)
            if not _old(Path(aside), cutoff):  # uploaded again meanwhile: the same bytes
                os.replace(aside, path)
                continue
            os.unlink(aside)
            removed += 1
        except FileNotFoundError:
            continue
        except OSError as exc:  # read-only here (EROFS), or not ours to delete (EACCES)
            if os.path.exists(aside):
                os.replace(aside, path)
            return removed, (
                f"uploads in {root} cannot be deleted here ({exc.strerror or exc}); run "
                "`ocrq prune` where the folder is writable (where the api runs), or expire "
                "them with the storage's lifecycle rule"
            )
    return removed, None


def _old(path: Path, cutoff: dt.datetime) -> bool:
    try:
        return path.is_file() and dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC) < cutoff
    except FileNotFoundError:
        return False


def prune_once_locked(
    db: Engine,
    cutoff: dt.datetime,
    upload_dir: Path | None,
    still_queued: StillQueued | None = None,
) -> Pruned | None:
    """`prune`, unless another process holds the retention lock (then None). PostgreSQL only.

    The lock is a session's, taken and released inside one transaction on this connection, left
    open for the pass: through PgBouncer in transaction mode (docs/operations.md) a transaction
    keeps its server connection, so the unlock reaches the session that holds the lock, where
    a commit between them could send it to another one and leave the lock held. The price:
    idle in that transaction, the session keeps a snapshot's horizon (its catalog snapshot),
    which holds VACUUM back while the pass runs, once a day; and a server's
    `idle_in_transaction_session_timeout` would end it mid-pass, so the transaction sets it
    off for itself (`SET LOCAL`). An unlock that fails after the pass (the session gone, and
    the lock with it) is logged, not raised over the pass's result."""
    with db.connect() as conn:
        conn.execute(text("SET LOCAL idle_in_transaction_session_timeout = 0"))
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar():
            conn.rollback()
            return None
        try:
            pruned = prune(db, cutoff, upload_dir, still_queued=still_queued)
        finally:
            try:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": LOCK_KEY})
                conn.commit()
            except OperationalError as exc:
                log.warning("retention: the lock's session ended before its unlock: %s", exc)
        return pruned
