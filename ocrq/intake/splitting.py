"""A document's own job: count its pages, record it and its page jobs, send one message a page.

The splitting job renders nothing. Each page job is an ordinary `ocrq.recognize` task (Flower
shows every page) whose image is `{"path": ..., "page": n}` for a path document, so the page
job opens the file itself and renders its page. A URL or inline document, which the page jobs
could not read again without fetching or carrying all of it, is stored once in the database
(ocrq/core/documents_store.py) and its pages name it: `{"document": <its id>, "page": n,
"name": "<source>#page=n"}`. Sent on as one-page PDFs instead, pages sharing one image each
carried that image: 40 pages of a 1.06 MB file wrote 153.7 MB to Redis (issue 52).

Page rows are made a few at a time, each group just before its messages are sent, with a look
at the document's own row in between: a row never waits `queued` for a message that is not
sent yet (the recovery sweep took such rows for lost and sent them again), and a document
cancelled while it is split sends no more pages.

Page job ids are derived from the document's id and the page number, so a redelivered split
finds the same rows and sends only the pages still queued or not made; nothing is made twice.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from ocrq.core.contract import PAGE_MARK, ImageRef, JobRequest
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.intake import documents
from ocrq.intake.documents import Document, DocumentError

log = logging.getLogger(__name__)

# Namespace of page job ids: uuid5(namespace, "<document id>/<page>").
PAGE_IDS = uuid.UUID("6f1d2a8e-5a0b-4c57-9d0e-0c2f3e7b9a41")
# Page rows made (and messages sent) per step; the document's cancel is looked for between
# steps. A step is sent in milliseconds, far below OCRQ_STALLED_AFTER_S.
STEP = 64

# send(document_id, page job): enqueue one page job (a Celery message, or a local thread).
SendPage = Callable[[str, JobRequest], None]


def page_job_id(document_id: str, page: int) -> str:
    return str(uuid.uuid5(PAGE_IDS, f"{document_id}/{page}"))


def split(
    request: JobRequest,
    document: Document,
    settings: Settings,
    docs: DocumentStore,
    jobs: JobStore,
    send: SendPage,
) -> int:
    """Record `document` and send its page jobs; returns the page count. A document refused
    whole gets its failed row here and raises DocumentError (the job's row is the caller's).
    A document whose own job is cancelled meanwhile stops here, cancelled (DocumentStore.cancel)."""
    source = request.image.describe()
    sha256 = documents.digest(document)
    try:
        pages = documents.count_pages(document, settings)
    except DocumentError as exc:
        docs.fail(request.job_id, request.task, source, str(exc), sha256=sha256)
        raise
    stored = request.image.path is None  # a URL or inline document: kept once, for its pages
    data = document.data if stored and isinstance(document.data, bytes) else None
    to_send = docs.open(request.job_id, request.task, source, sha256, pages, data)
    sent = 0
    for first in range(0, len(to_send), STEP):
        if jobs.cancelled_among([request.job_id]):
            docs.cancel(request.job_id)
            log.info(
                "document %s cancelled while it was split: %d of %d pages sent",
                request.job_id, sent, len(to_send),
            )  # fmt: skip
            return pages
        step = to_send[first : first + STEP]
        page_jobs = [_page_job(request, n, source, stored) for n in step]
        docs.add_pages(
            request.job_id,
            request.task,
            [(p.job_id, n, p.image.describe()) for p, n in zip(page_jobs, step, strict=True)],
            # What a re-send of the page names: its document's path, or its stored copy.
            {p.job_id: p.image.reference() for p in page_jobs},
            batch=request.batch,
            columns=request.columns(),
        )
        for page_job in page_jobs:
            send(request.job_id, page_job)
        sent += len(page_jobs)
    log.info("document %s: %d pages, %d page jobs sent (%s)", request.job_id, pages, sent, source)
    docs.complete(request.job_id)  # a redelivered split may find every page final already
    return pages


def _page_job(request: JobRequest, page: int, source: str, stored: bool) -> JobRequest:
    """A copy of its document's request: every field (caps, lane, batch) but the image and
    the id; a new page row is a first run, whatever re-run its document is on."""
    image: dict[str, Any] = (
        {"document": request.job_id, "page": page, "name": f"{source}{PAGE_MARK}{page}"}
        if stored
        else {"path": request.image.path, "page": page}
    )
    return request.model_copy(
        update={
            "image": ImageRef(**image),
            "job_id": page_job_id(request.job_id, page),
            "retry": 0,
        }
    )


def celery_sender(settings: Settings) -> SendPage:
    """Page jobs sent through the broker, as any producer sends a job (task id = job id)."""
    from ocrq.core.requeue import producer_app, send_job

    app = producer_app(settings)

    def send(_document_id: str, page_job: JobRequest) -> None:
        send_job(app, settings, page_job)

    return send
