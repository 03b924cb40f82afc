"""A document's own job: count its pages, record it and its page jobs, send one message a page.

The splitting job renders nothing. Each page job is an ordinary `ocrq.recognize` task (Flower
shows every page) whose image is `{"path": ..., "page": n}` for a path document, so the page
job opens the file itself and renders its page; a URL or inline document, which the page jobs
could not read again without fetching or carrying all of it, is sent on page by page as
one-page documents (`{"b64": ..., "page": 1, "name": "<source>#page=n"}`): the messages
together weigh about what the document does, and none holds more than its page.

Page job ids are derived from the document's id and the page number, so a redelivered split
finds the same rows and sends only the pages still queued; nothing is made twice.
"""

from __future__ import annotations

import base64
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

# send(document_id, page job): enqueue one page job (a Celery message, or a local thread).
SendPage = Callable[[str, JobRequest], None]
# failed(page job id, error): a page that failed while its document was split, sent to no one.
FailedPage = Callable[[str, str], None]


def page_job_id(document_id: str, page: int) -> str:
    return str(uuid.uuid5(PAGE_IDS, f"{document_id}/{page}"))


def split(
    request: JobRequest,
    document: Document,
    settings: Settings,
    docs: DocumentStore,
    jobs: JobStore,
    send: SendPage,
    failed: FailedPage | None = None,
) -> int:
    """Record `document` and send its page jobs; returns the page count. A document refused
    whole gets its failed row here and raises DocumentError (the job's row is the caller's)."""
    source = request.image.describe()
    sha256 = documents.digest(document)
    try:
        pages = documents.count_pages(document, settings)
    except DocumentError as exc:
        docs.fail(request.job_id, request.task, source, str(exc), sha256=sha256)
        raise
    page_jobs = [
        (page_job_id(request.job_id, n), n, f"{source}{PAGE_MARK}{n}") for n in range(1, pages + 1)
    ]
    # What a re-send of a page names: the document's own path or URL and the page (an inline
    # document's pages have none: they cannot be rebuilt from a row).
    whole = request.image.reference()
    references = {job_id: {**whole, "page": n} for job_id, n, _ in page_jobs if whole is not None}
    to_send = docs.open(
        request.job_id,
        request.task,
        source,
        sha256,
        pages,
        page_jobs,
        references,
        batch=request.batch,
        columns=request.columns(),
    )
    inline = request.image.path is None
    for n in to_send:
        job_id, _, name = page_jobs[n - 1]
        if inline:
            try:
                data = documents.one_page(document, n, settings)
            except DocumentError as exc:  # this page alone: fail its row, send nothing
                log.warning("document %s page %d failed: %s", request.job_id, n, exc)
                jobs.finish(job_id, status="failed", error=str(exc))
                if failed is not None:
                    failed(job_id, str(exc))
                continue
            image: dict[str, Any] = {
                "b64": base64.b64encode(data).decode("ascii"),
                "page": 1,
                "name": name,
            }
        else:
            image = {"path": request.image.path, "page": n}
        # A copy of its document's request: every field (caps, lane, batch) but the image and
        # the id; a new page row is a first run, whatever re-run its document is on.
        page_job = request.model_copy(
            update={"image": ImageRef(**image), "job_id": job_id, "retry": 0}
        )
        send(request.job_id, page_job)
    log.info(
        "document %s: %d pages, %d page jobs sent (%s)", request.job_id, pages, len(to_send), source
    )
    docs.complete(request.job_id)  # every page may have failed here already
    return pages


def celery_sender(settings: Settings) -> SendPage:
    """Page jobs sent through the broker, as any producer sends a job (task id = job id)."""
    from ocrq.core.requeue import producer_app, send_job

    app = producer_app(settings)

    def send(_document_id: str, page_job: JobRequest) -> None:
        send_job(app, settings, page_job)

    return send
