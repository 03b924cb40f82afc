"""User re-runs of failed jobs (`ocrq retry`, `POST /jobs/retry`): rows back to `queued`.

A failed row is final for every redelivery and sweep (docs/faults.md): copies of its old
message must keep finding it failed. A re-run is the user's explicit new attempt, so it is
told apart by a generation: this UPDATE bumps the row's `retries` and the message sent again
carries it as `retry`; the claim refuses any message of an older generation
(ocrq/core/store.py). `attempts` keeps counting every claim, so the row says how many times the
job ran in all; `retry_attempts` marks where this re-run began, so the worker-death cap counts
only its own attempts.

Inline (b64) jobs are never re-run: their rows hold no bytes to send again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import Engine, and_, delete, select, update

from ocrq.core.contract import JobRequest
from ocrq.core.db import ocr_documents, ocr_jobs


@dataclass(frozen=True)
class Reopened:
    """A row put back to `queued`, and the job its message is rebuilt from (its whole row:
    `JobRequest.from_row`, so the re-run keeps its caps and lane)."""

    id: str
    batch: str | None
    retries: int
    request: JobRequest


def reopen_failed(
    engine: Engine, batch: str | None = None, job_ids: Sequence[str] | None = None
) -> list[Reopened]:
    """Put the failed rows (of `batch`, or of `job_ids`, or all) back to `queued` as a new
    re-run, in one transaction; a document one of whose pages is re-run is open again until
    that page is final. Concurrent calls re-run each row once (the UPDATE re-checks status)."""
    conditions = [
        ocr_jobs.c.status == "failed",
        # Only what can be rebuilt: an inline (b64) image, or a row from before its reference
        # was kept (migrations/0006), has nothing to send again.
        ocr_jobs.c.reference.is_not(None),
    ]
    if batch is not None:
        conditions.append(ocr_jobs.c.batch == batch)
    if job_ids is not None:
        conditions.append(ocr_jobs.c.id.in_(list(job_ids)))
    stmt = (
        update(ocr_jobs)
        .where(*conditions)
        .values(
            status="queued",
            retries=ocr_jobs.c.retries + 1,
            retry_attempts=ocr_jobs.c.attempts,
            error=None,
            text=None,
            lines=None,
            truncated=None,
            started_at=None,
            finished_at=None,
            worker=None,
            batch_id=None,
        )
        .returning(*ocr_jobs.c)
    )
    with engine.begin() as conn:
        rows = conn.execute(stmt).all()
        pages_of = {r.document_id for r in rows if r.page is not None and r.document_id}
        if pages_of:  # assembled again from its pages once the re-run page is final
            conn.execute(  # and its webhook sent again with the new outcome
                update(ocr_documents)
                .where(ocr_documents.c.id.in_(pages_of))
                .values(status="running", text=None, result=None, error=None, finished_at=None,
                        notified_at=None)
            )
        split = [r.id for r in rows if r.page is None and r.document_id == r.id]
        if split:
            # A document refused whole has no page rows: its row goes, and the re-run split
            # records it afresh (a document with page rows keeps them).
            has_pages = (
                select(ocr_jobs.c.id)
                .where(
                    and_(
                        ocr_jobs.c.document_id == ocr_documents.c.id,
                        ocr_jobs.c.page.is_not(None),
                    )
                )
                .exists()
            )
            conn.execute(
                delete(ocr_documents).where(ocr_documents.c.id.in_(split), ~has_pages)
            )
    return [Reopened(r.id, r.batch, r.retries, JobRequest.from_row(r._mapping)) for r in rows]


INLINE_NOT_KEPT = "an inline (b64) image: its bytes were not kept, so submit it again"


def not_rerun(
    engine: Engine, job_ids: Sequence[str], sent: Sequence[str], batch: str | None = None
) -> dict[str, str]:
    """Why each of `job_ids` not in `sent` was not run again, by job id (`batch`: the filter
    the re-run had besides). `ocrq retry` called a failed inline job "not failed", and
    `POST /jobs/retry` answered an empty list for a typo'd id, a done job and an inline one
    alike."""
    done = set(sent)
    left = [j for j in dict.fromkeys(job_ids) if j not in done]
    if not left:
        return {}
    with engine.connect() as conn:
        rows = {
            r.id: r
            for r in conn.execute(
                select(
                    ocr_jobs.c.id, ocr_jobs.c.status, ocr_jobs.c.reference, ocr_jobs.c.batch
                ).where(ocr_jobs.c.id.in_(left))
            )
        }
    reasons: dict[str, str] = {}
    for job_id in left:
        row = rows.get(job_id)
        if row is None:
            reasons[job_id] = "no such job"
        elif row.status != "failed":
            reasons[job_id] = f"{row.status}, not failed"
        elif row.reference is None:
            reasons[job_id] = INLINE_NOT_KEPT
        elif batch is not None and row.batch != batch:
            reasons[job_id] = f"not in batch {batch}"
        else:  # failed and rebuildable, yet not reopened: another re-run took it first
            reasons[job_id] = "re-run by another request at the same time"
    return reasons
