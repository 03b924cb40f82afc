"""Submit jobs and read results, as any producer would: a bare Celery app plus the job table.

Other apps need none of this: `Celery(broker=...).send_task("ocrq.recognize", kwargs=...,
queue="ocr")` is the whole contract. This module is what `ocrq submit` and the HTTP api use.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.api import document_status
from ocrq.core import requeue
from ocrq.core.contract import (
    DEFAULT_QUEUE,
    TASK_NAME,
    JobRequest,
    canonical_job_id,
    job_kwargs,
)
from ocrq.core.db import get_engine
from ocrq.core.documents_store import DocumentStore
from ocrq.core.requeue import producer_app
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore, NewJob, Page, full_view

FINAL = ("done", "failed", "partial")  # partial: a document some of whose pages failed
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """One job of a submit: `created` False when its id was already recorded for the same
    image and task (an idempotent retry), then nothing was sent and `status` is the row's."""

    job_id: str
    created: bool
    status: str


class NotSent(Exception):
    """The broker refused a message: the jobs in `sent` went out before it (they will run);
    the rest were not sent and their rows were deleted again, except `kept` (the database
    failed too: they stay `queued`, and `ocrq requeue` sends them later)."""

    def __init__(self, sent: Sequence[str], kept: Sequence[str], cause: BaseException) -> None:
        self.sent = list(sent)
        self.kept = list(kept)
        super().__init__(f"broker unavailable: {type(cause).__name__}: {cause}")


def image_ref(target: str) -> dict[str, str]:
    """A CLI argument -> the message's image reference (absolute path, or URL)."""
    if target.startswith(("http://", "https://")):
        return {"url": target}
    return {"path": str(Path(target).expanduser().resolve())}


class Client:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.app = producer_app(settings)
        self._store: JobStore | None = None

    @property
    def store(self) -> JobStore:
        if self._store is None:
            self._store = JobStore(get_engine(self.settings.database_url))
        return self._store

    def submit(
        self,
        image: dict[str, str],
        task: str = "text",
        record: bool = True,
        job_id: str | None = None,
        max_pixels: int | None = None,
    ) -> str:
        """Enqueue one job; with `record`, its row exists as `queued` before the message."""
        # Validated as the worker will (ValidationError, a ValueError: NUL bytes, lone
        # surrogates...), so nothing is enqueued that could not be stored.
        fields: dict[str, Any] = {"image": image, "task": task, "max_pixels": max_pixels}
        if job_id is not None:
            fields["job_id"] = job_id
        request = JobRequest.model_validate(fields)
        if not record:
            self._send(request)
            return request.job_id
        return self.submit_many([request])[0].job_id

    def submit_many(self, requests: Sequence[JobRequest]) -> list[Submitted]:
        """Record every job as `queued`, then send a message for each new one.

        Row first, message second: a worker's claim then always finds the row, and a message
        never exists for a job the producer was not told about. When the broker refuses a
        message, the rows of the jobs not sent are deleted again (only while still `queued` and
        unclaimed) and NotSent says which jobs did go out; a job id already recorded for the
        same image and task is not sent again (an idempotent retry); one recorded for another
        image raises JobIdReused and nothing is recorded or sent.
        """
        news = [NewJob(r.job_id, r.task, r.image.describe(), r.max_pixels) for r in requests]
        existing = self.store.enqueue_many(news)
        unique = list({r.job_id: r for r in requests}.values())
        to_send = [r for r in unique if existing[r.job_id] is None]
        sent: list[str] = []
        try:
            for request in to_send:
                self._send(request)
                sent.append(request.job_id)
        except Exception as exc:
            unsent = [r.job_id for r in to_send[len(sent) :]]
            kept: list[str] = []
            try:
                self.store.discard_queued(unsent)
            except Exception:
                log.exception("could not delete the rows of jobs never sent: %s", unsent)
                kept = unsent
            raise NotSent(sent, kept, exc) from exc
        return [
            Submitted(r.job_id, existing[r.job_id] is None, existing[r.job_id] or "queued")
            for r in unique
        ]

    def _send(self, request: JobRequest) -> None:
        self.app.send_task(
            TASK_NAME,
            kwargs=job_kwargs(
                request.image.model_dump(exclude_none=True),
                request.task,
                request.job_id,
                request.max_pixels,
            ),
            queue=self.settings.queue or DEFAULT_QUEUE,
            task_id=request.job_id,
        )

    def requeue(self, older_than_s: float) -> list[str]:
        """Send again every job still `queued` (never claimed by a worker) after `older_than_s`.

        The job table, not the broker, is the record of what was submitted: kombu's Redis
        transport pops a message and marks it unacked in two steps, so a Redis restart between
        them loses that message. A re-sent job that was not lost after all is harmless: the
        worker's claim finds its row done and skips it. Inline (b64) jobs cannot be re-sent.
        """
        from sqlalchemy import select

        from ocrq.core.db import ocr_jobs
        from ocrq.core.store import now

        cutoff = now().timestamp() - older_than_s
        with self.store.engine.connect() as conn:
            rows = conn.execute(
                select(
                    ocr_jobs.c.id,
                    ocr_jobs.c.task,
                    ocr_jobs.c.source,
                    ocr_jobs.c.created_at,
                    ocr_jobs.c.max_pixels,
                    ocr_jobs.c.page,
                ).where(ocr_jobs.c.status == "queued")
            ).all()
        sent = []
        for job_id, task, source, created, max_pixels, page in rows:
            if created.timestamp() > cutoff or source == "b64" or source.startswith("b64:"):
                continue
            requeue.resend(self.app, self.settings, job_id, task, source, max_pixels, page)
            sent.append(job_id)
        return sent

    def requeue_stalled(
        self, stalled_after_s: float | None = None, exclude_worker: str | None = None
    ) -> list[str]:
        """Send again the `running` jobs of workers whose heartbeat is older than
        `stalled_after_s` (default OCRQ_STALLED_AFTER_S): ocrq/core/requeue.py."""
        return requeue.requeue_stalled(
            self.store, self.app, self.settings, stalled_after_s, exclude_worker
        )

    def status(self, job_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Rows by job id, in any UUID spelling (`{...}`, `urn:uuid:`, upper case, no dashes)."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        rows = self.store.get(ids)
        shown = document_status.views(self.documents, rows, {j: full_view(rows[j]) for j in rows})
        return [shown.get(j, {"job_id": j, "status": "unknown"}) for j in ids]

    @property
    def documents(self) -> DocumentStore:
        return DocumentStore(self.store.engine)

    def page(
        self,
        statuses: Sequence[str] = (),
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
        limit: int = 50,
        after: tuple[dt.datetime, str] | None = None,
    ) -> Page:
        """Recent jobs, newest first (`ocrq jobs`, `GET /jobs`)."""
        return self.store.page(statuses, created_after, created_before, limit, after)

    def wait(
        self,
        job_ids: Iterable[str],
        timeout: float | None = None,
        poll_s: float = 0.25,
        on_progress: Any = None,
    ) -> list[dict[str, Any]]:
        """Poll the table until every job (a document: every page) is final or the timeout
        passes; `on_progress(finished, total)` counts pages for documents, one per image."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            rows = self.store.get(ids)
            units, total, final = document_status.progress(self.documents, ids, rows)
            if on_progress is not None:
                on_progress(units, total)
            if final == len(ids):
                break
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(poll_s)
        return self.status(ids)


def _canonical_or_none(job_id: str) -> str | None:
    try:
        return canonical_job_id(job_id)
    except ValueError:
        return None
