"""`ocrq run`: the service's job path in one process, fed from local files, no Redis/PostgreSQL.

Same JobRunner, batcher, planner, intake and engine as the worker; a thread pool plays the part
of Celery's task threads, and a SQLite file plays the part of PostgreSQL. A document's page jobs
go to a second pool instead of the broker, and its result is emitted once every page is stored.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ocrq.core.contract import ImageRef, JobRequest
from ocrq.core.db import engine_for
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker.jobs import JobOutcome
from ocrq.worker.runtime import build_runtime

IMAGE_SUFFIXES = {
    ".jpg",
    ".jpeg",
    ".png",
    ".tif",
    ".tiff",
    ".bmp",
    ".webp",
    ".gif",
    ".pbm",
    ".pgm",
    ".ppm",
    ".pdf",  # a document: one page job per page, one result for the whole
}


@dataclass(frozen=True)
class DocumentOutcome:
    """A document's result in `ocrq run`: the view `ocrq status` shows for it."""

    view: dict[str, Any]

    @property
    def status(self) -> str:
        return str(self.view["status"])

    def as_json(self) -> dict[str, Any]:
        return dict(self.view)


def expand(paths: Sequence[Path]) -> list[Path]:
    """Files as given; a directory means the image files directly inside it, sorted."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            out.extend(
                sorted(c for c in p.iterdir() if c.is_file() and c.suffix.lower() in IMAGE_SUFFIXES)
            )
        else:
            out.append(p)
    return out


def run_paths(
    paths: Sequence[Path],
    settings: Settings,
    db_url: str,
    on_result: Callable[[JobOutcome | DocumentOutcome], None],
    task: str = "text",
) -> dict[str, int]:
    """OCR every path; results reach `on_result` in input order. Returns counts by status."""
    files = expand(paths)
    # The user named these files: allow their folders (and the roots settings name).
    roots = sorted({f.expanduser().resolve().parent for f in files} | set(settings.roots()))
    settings = settings.model_copy(update={"allowed_roots": roots})
    store = JobStore(engine_for(settings.model_copy(update={"database_url": db_url})))
    store.create_tables()
    pages: dict[str, list[JobRequest]] = {}
    lock = threading.Lock()

    def send_page(document_id: str, page_job: JobRequest) -> None:
        with lock:
            pages.setdefault(document_id, []).append(page_job)

    runtime = build_runtime(settings, store=store, worker_name="embedded", send_page=send_page)
    documents = DocumentStore(store.engine)
    counts = {"done": 0, "failed": 0}
    try:
        threads = runtime.task_threads
        with (
            ThreadPoolExecutor(threads, thread_name_prefix="ocrq-fetch") as pool,
            ThreadPoolExecutor(threads, thread_name_prefix="ocrq-page") as page_pool,
        ):

            def process(request: JobRequest) -> JobOutcome | DocumentOutcome:
                outcome = runtime.runner.process(request)
                if outcome.pages is None:
                    return outcome
                with lock:
                    sent = pages.pop(request.job_id, [])
                futures = [page_pool.submit(runtime.runner.process, page) for page in sent]
                for future in futures:
                    future.result()
                view = documents.view(request.job_id)
                return DocumentOutcome(view) if view is not None else outcome

            for outcome in _in_order(pool, files, process, task, threads):
                counts[outcome.status] = counts.get(outcome.status, 0) + 1
                on_result(outcome)
    finally:
        runtime.close()
    return counts


def _in_order(
    pool: ThreadPoolExecutor,
    files: Sequence[Path],
    process: Callable[[JobRequest], JobOutcome | DocumentOutcome],
    task: str,
    window: int,
) -> Iterator[JobOutcome | DocumentOutcome]:
    """Keep `window` jobs in flight (bounded memory) and yield them in submission order."""
    pending: deque[Future[JobOutcome | DocumentOutcome]] = deque()
    for f in files:
        request = JobRequest(image=ImageRef(path=str(f)), task=task)
        pending.append(pool.submit(process, request))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
