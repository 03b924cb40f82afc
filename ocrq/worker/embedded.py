"""`ocrq run`: the service's job path in one process, fed from local files, no Redis/PostgreSQL.

Same JobRunner, batcher, planner, intake and engine as the worker; a thread pool plays the part
of Celery's task threads, and a SQLite file plays the part of PostgreSQL. A document's page jobs
go to a second pool instead of the broker, and its result is emitted once every page is stored.
"""

from __future__ import annotations

import os
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ocrq.core.contract import ImageRef, JobRequest
from ocrq.core.db import engine_for
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker.outcome import JobOutcome
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


@dataclass(frozen=True)
class Inputs:
    """What `ocrq run`/`submit` found for their path arguments, with what the folders held that
    is no image or PDF: a command that found nothing says why (a walkthrough's
    `ocrq run ocr-eval` printed `total: 0` and exited 0, its images all in subfolders)."""

    files: list[Path]
    # Files inside the folders that are no image or PDF, counted by suffix (not kept: a
    # folder may be a home directory).
    skipped: Counter[str] = field(default_factory=Counter)
    unreadable: int = 0  # folders beneath that could not be listed (permissions)
    # Where the files were found: the folders given, and the folder of each file given.
    roots: list[Path] = field(default_factory=list)


def find_inputs(paths: Sequence[Path]) -> Inputs:
    """Files as given (a typo or a `.txt` named on purpose still becomes a job that fails with
    its reason); a folder means the images and PDFs anywhere beneath it, in sorted path order
    so that a rerun lists them alike. Hidden files and folders (`.git`, `.DS_Store`) are left
    out, and symlinked folders are not entered (no loops)."""
    files: list[Path] = []
    skipped: Counter[str] = Counter()
    errors: list[OSError] = []
    roots: set[Path] = set()
    for p in paths:
        if not p.is_dir():
            files.append(p)
            roots.add(p.expanduser().resolve().parent)
            continue
        roots.add(p.expanduser().resolve())
        found: list[Path] = []
        for folder, dirs, names in os.walk(p, onerror=errors.append):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for name in names:
                child = Path(folder) / name
                if name.startswith(".") or not child.is_file():
                    continue
                suffix = child.suffix.lower()
                if suffix in IMAGE_SUFFIXES:
                    found.append(child)
                else:
                    skipped[suffix or "(none)"] += 1
        files.extend(sorted(found))
    return Inputs(files, skipped, len(errors), sorted(roots))


def run_paths(
    files: Sequence[Path],
    settings: Settings,
    db_url: str,
    on_result: Callable[[JobOutcome | DocumentOutcome], None],
    task: str = "text",
    on_progress: Callable[[int, int], None] | None = None,
    roots: Sequence[Path] | None = None,
) -> dict[str, int]:
    """OCR every file (`find_inputs`' list); results reach `on_result` in input order.
    Returns counts by status. `roots`: the folders the user named (`find_inputs`' roots), the
    files' own folders when not given; either way only these and the configured roots may be
    read (a root per subfolder of a large tree would be checked for every image).

    `on_progress(finished, more)` counts work as it ends, in no particular order, in units of
    images and document pages: each file starts as one unit, a document adds `more` once its
    page count is known and finishes page by page (a 12-page PDF's bar stood at 0/1 until its
    last page). It is called from worker threads.
    """
    progress = on_progress or (lambda finished, more: None)
    named = roots if roots is not None else {f.expanduser().resolve().parent for f in files}
    # The user named these: allow them (and the roots settings name).
    allowed = sorted(set(named) | set(settings.roots()))
    settings = settings.model_copy(update={"allowed_roots": allowed})
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
                    progress(1, 0)
                    return outcome
                with lock:
                    sent = pages.pop(request.job_id, [])
                if sent:  # its one unit becomes its pages
                    progress(0, len(sent) - 1)
                else:  # split into nothing: the document ends as its one unit
                    progress(1, 0)

                def page_done(page: JobRequest) -> JobOutcome:
                    try:
                        return runtime.runner.process(page)
                    finally:
                        progress(1, 0)

                futures = [page_pool.submit(page_done, page) for page in sent]
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
