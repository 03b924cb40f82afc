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
from ocrq.core import batch_hooks, batches, requeue, rerun
from ocrq.core.contract import (
    NAME_REFUSED,
    JobRequest,
    canonical_job_id,
)
from ocrq.core.db import engine_for
from ocrq.core.documents_store import DocumentStore
from ocrq.core.requeue import producer_app
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore, NewJob, Page, full_view

# partial: a document some of whose pages failed; cancelled and expired: never run.
FINAL = ("done", "failed", "partial", "cancelled", "expired")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """One job of a submit: `created` False when its id was already recorded for the same
    image and task (an idempotent retry), then nothing was sent and `status` is the row's."""

    job_id: str
    created: bool
    status: str


@dataclass(frozen=True)
class Delivery:
    """What a job asks of its delivery beyond the message's kwargs: a deadline (sent as
    Celery's `expires`, and recorded so a claim after it refuses the job) and a webhook."""

    expires_at: dt.datetime | None = None
    callback_url: str | None = None
    file_name: str | None = None  # an upload's own name, display only (uploads.display_name)


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
            self._store = JobStore(engine_for(self.settings))
        return self._store

    def submit(
        self,
        image: dict[str, str],
        task: str = "text",
        record: bool = True,
        job_id: str | None = None,
        **fields: Any,
    ) -> str:
        """Enqueue one job; with `record`, its row exists as `queued` before the message.
        `fields`: the job's others (JobRequest: `max_pixels`, `max_new_tokens`, `priority`
        ("interactive": ahead of the bulk backlog), `batch`); None is the field's default."""
        # Validated as the worker will (ValidationError, a ValueError: NUL bytes, lone
        # surrogates...), so nothing is enqueued that could not be stored.
        given = {k: v for k, v in {**fields, "job_id": job_id}.items() if v is not None}
        request = JobRequest.model_validate({"image": image, "task": task, **given})
        if not record:
            self._send(request)
            return request.job_id
        return self.submit_many([request])[0].job_id

    def submit_many(
        self, requests: Sequence[JobRequest], deliveries: Sequence[Delivery] | None = None
    ) -> list[Submitted]:
        """Record every job as `queued`, then send a message for each new one.

        Row first, message second: a worker's claim then always finds the row, and a message
        never exists for a job the producer was not told about. When the broker refuses a
        message, the rows of the jobs not sent are deleted again (only while still `queued` and
        unclaimed) and NotSent says which jobs did go out; a job id already recorded for the
        same image and task is not sent again (an idempotent retry); one recorded for another
        image raises JobIdReused and nothing is recorded or sent.
        """
        if any(r.image.name is not None for r in requests):
            raise ValueError(NAME_REFUSED)  # the worker would refuse it: say so now
        asked = list(deliveries) if deliveries is not None else [Delivery()] * len(requests)
        news = [
            NewJob.of(r, d.expires_at, d.callback_url, d.file_name)
            for r, d in zip(requests, asked, strict=True)
        ]
        existing = self.store.enqueue_many(news)
        delivery = {r.job_id: d for r, d in zip(requests, asked, strict=True)}
        unique = list({r.job_id: r for r in requests}.values())
        to_send = [r for r in unique if existing[r.job_id] is None]
        sent: list[str] = []
        try:
            for request in to_send:
                self._send(request, delivery[request.job_id].expires_at)
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

    def _send(self, request: JobRequest, expires_at: dt.datetime | None = None) -> None:
        requeue.send_job(self.app, self.settings, request, expires_at)

    def cancel(self, job_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Cancel jobs not final yet (store.cancel says what that does to a running one); each
        id's row afterwards, with `cancelled` True for the ones cancelled by this call."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        done = set(self.store.cancel([j for j in ids if _canonical_or_none(j)]))
        return [{**row, "cancelled": row["job_id"] in done} for row in self.status(ids)]

    def register_batch_webhook(self, batch: str, url: str) -> tuple[str, dt.datetime] | None:
        """The batch's webhook, sent by a worker once the batch is final (core/batch_hooks.py);
        the registration it replaced, for `withdraw_batch_webhook`."""
        return batch_hooks.register(self.store.engine, batch, url)

    def withdraw_batch_webhook(
        self, batch: str, url: str, previous: tuple[str, dt.datetime] | None
    ) -> None:
        """Undo a registration whose request recorded no job (batch_hooks.withdraw)."""
        batch_hooks.withdraw(self.store.engine, batch, url, previous)

    def cancel_batch(self, batch: str) -> tuple[list[str], batches.BatchSummary | None]:
        """Cancel every job of the batch not final yet (store.cancel_batch); the ids cancelled
        and the batch's summary afterwards (None: no job names the batch)."""
        cancelled = self.store.cancel_batch(batch)
        return cancelled, self.batch(batch)

    def requeue(self, older_than_s: float) -> list[str]:
        """Send again every job still `queued` (never claimed by a worker) after `older_than_s`
        whose message is in neither the queue nor a worker's hands: ocrq/core/requeue.py.

        The job table, not the broker, is the record of what was submitted: kombu's Redis
        transport pops a message and marks it unacked in two steps, so a worker killed (or a
        Redis restart) between them loses that message. A job is sent as its row's `reference`
        says (the image exactly as submitted); one without (inline bytes, a row from before
        migrations/0006) cannot be rebuilt and is skipped: its own message is its only copy.
        """
        return requeue.requeue_queued(self.store, self.app, self.settings, older_than_s)

    def retry_failed(
        self, batch: str | None = None, job_ids: Sequence[str] | None = None
    ) -> list[str]:
        """Re-run failed jobs (of `batch`, or `job_ids`, or all): their rows go back to
        `queued` as a new re-run (ocrq/core/rerun.py), then each is sent again. Should the
        broker fail part-way, the rows not sent stay `queued` and `ocrq requeue` sends them."""
        ids = None if job_ids is None else [_canonical_or_none(j) or j for j in job_ids]
        reopened = rerun.reopen_failed(self.store.engine, batch, ids)
        for job in reopened:
            requeue.resend(self.app, self.settings, job.request)
        return [job.id for job in reopened]

    def not_rerun(
        self, job_ids: Sequence[str], sent: Sequence[str], batch: str | None = None
    ) -> dict[str, str]:
        """Why each named job not in `sent` was not run again (ocrq/core/rerun.py)."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        return rerun.not_rerun(self.store.engine, ids, sent, batch)

    def batch(self, name: str) -> batches.BatchSummary | None:
        """The batch's counts, times and ETA (`GET /batches/{id}`); None when unknown."""
        return batches.summary(self.store.engine, name)

    def known_batches(self, names: Sequence[str]) -> set[str]:
        return batches.known(self.store.engine, list(names))

    def requeue_stalled(
        self, stalled_after_s: float | None = None, exclude_worker: str | None = None
    ) -> requeue.StalledRequeue:
        """Send again the `running` jobs of workers whose heartbeat is older than
        `stalled_after_s` (default OCRQ_STALLED_AFTER_S), and put back the messages dead
        workers held: ocrq/core/requeue.py."""
        return requeue.requeue_stalled(
            self.store, self.app, self.settings, stalled_after_s, exclude_worker
        )

    def status(self, job_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Rows by job id, in any UUID spelling (`{...}`, `urn:uuid:`, upper case, no dashes)."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        rows = self.store.get([j for j in ids if _canonical_or_none(j)])  # no row for others
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
        batch: str | None = None,
    ) -> Page:
        """Recent jobs, newest first (`ocrq jobs`, `GET /jobs`)."""
        return self.store.page(statuses, created_after, created_before, limit, after, batch)

    def listing(
        self,
        statuses: Sequence[str] = (),
        created_after: dt.datetime | None = None,
        limit: int = 50,
        after: tuple[dt.datetime, str] | None = None,
        batch: str | None = None,
    ) -> tuple[list[dict[str, Any]], tuple[dt.datetime, str] | None]:
        """Recent jobs as `ocrq jobs` lists them (documents with their status and pages), and
        where the next page starts (None: no more rows)."""
        page = self.page(statuses, created_after, limit=limit, after=after, batch=batch)
        return document_status.listed(self.documents, page.rows), page.next_after

    def progress(self, job_ids: Sequence[str]) -> tuple[int, int, int]:
        """(finished units, all units, finished jobs) of these jobs: a document counts as
        its pages."""
        ids = [_canonical_or_none(j) or j for j in job_ids]
        return document_status.progress(self.documents, ids, self.store.get(ids))

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
