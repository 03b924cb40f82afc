"""One job from request to stored row: the steps the Celery task and `ocrq run` share.

claim row -> fetch + decode (in the caller's thread: this is the prefetch) -> batcher -> store.
The caller's thread blocks on the batcher's future while the engine works on a whole batch.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import DBAPIError
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from models.base import Engine, PreparedImage
from ocrq.contract import TASKS, JobRequest
from ocrq.settings import Settings
from ocrq.store import JobStore
from worker import images, metrics
from worker.batcher import Batcher

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    source: str
    status: str  # done | failed
    text: str | None = None
    lines: list[dict[str, Any]] | None = None
    error: str | None = None
    already_done: bool = False

    def as_json(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "path": self.source,
            "status": self.status,
            "text": self.text,
            "lines": self.lines or [],
            "error": self.error,
        }


def _db_unavailable(exc: BaseException) -> bool:
    """Connection-level failures are worth waiting out; constraint errors are not."""
    return isinstance(exc, DBAPIError) and (
        exc.connection_invalidated or type(exc.orig).__name__ in ("OperationalError",)
    )


class JobRunner:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        batcher: Batcher,
        store: JobStore,
        worker_name: str,
        prefetch_images: int = 64,
        db_retry_s: float = 300.0,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.batcher = batcher
        self.store = store
        self.worker_name = worker_name
        # Caps decoded images held at once (prefetched + in the running batch): memory stays
        # bounded however many task threads there are.
        self._decoded = threading.BoundedSemaphore(prefetch_images)
        # While the database is down, results wait in this thread (and the message stays
        # unacked) rather than being dropped or acked without a row.
        self._db = retry(
            retry=retry_if_exception(_db_unavailable),
            wait=wait_exponential(multiplier=0.5, max=5),
            stop=stop_after_delay(db_retry_s),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )

    def process(self, request: JobRequest) -> JobOutcome:
        source = request.image.describe()
        task = request.task if request.task in TASKS else "custom"
        claim = self._db(self.store.claim)(request.job_id, request.task, source, self.worker_name)
        if not claim.run:
            row = claim.row or {}
            log.info("job %s already done; redelivery ignored", request.job_id)
            return JobOutcome(
                request.job_id,
                source,
                row.get("status", "done"),
                row.get("text"),
                row.get("lines"),
                row.get("error"),
                already_done=True,
            )
        # The semaphore bounds decoded images held at once (prefetched + in the running batch).
        with self._decoded:
            try:
                loaded = images.load(request.image, self.settings, self.engine.max_pixels)
                item = PreparedImage(
                    key=request.job_id,
                    image=loaded.image,
                    original_size=loaded.original_size,
                    task=task,
                    prompt=request.prompt,
                    max_pixels=request.max_pixels,
                )
                self.engine.prepare(item)  # CPU preprocessing, here in the prefetch thread
            except Exception as exc:  # bad image, or one the engine's preprocessing refuses
                message = (
                    str(exc)
                    if isinstance(exc, images.ImageError)
                    else f"{type(exc).__name__}: {exc}"
                )
                return self._fail(request.job_id, source, message)
            outcome = self.batcher.submit(item).result()
            del item
        common = {
            "sha256": loaded.sha256,
            "width": loaded.original_size[0],
            "height": loaded.original_size[1],
            "engine": outcome.engine,
            "batch_id": outcome.batch_id or None,
        }
        if outcome.error is not None or outcome.result is None:
            message = f"{type(outcome.error).__name__}: {outcome.error}"
            return self._fail(request.job_id, source, message, **common)
        lines = [line.as_json() for line in outcome.result.lines]
        self._db(self.store.finish)(
            request.job_id,
            status="done",
            text=outcome.result.text,
            lines=lines,
            error=None,
            truncated=outcome.result.truncated,
            **common,
        )
        metrics.JOBS.labels("done").inc()
        return JobOutcome(request.job_id, source, "done", outcome.result.text, lines)

    def reject(self, job_id: str | None, source: str, task: str, message: str) -> None:
        """Record a malformed request as a failed job, when it carries a valid job id."""
        try:
            uuid.UUID(str(job_id))
        except ValueError:
            log.warning("rejected a request without a valid job id: %s", message)
            return
        claim = self._db(self.store.claim)(str(job_id), str(task)[:4000], source, self.worker_name)
        if claim.run:
            self._fail(str(job_id), source, message)

    def _fail(self, job_id: str, source: str, message: str, **fields: Any) -> JobOutcome:
        log.warning("job %s failed: %s", job_id, message)
        self._db(self.store.finish)(job_id, status="failed", error=message, **fields)
        metrics.JOBS.labels("failed").inc()
        return JobOutcome(job_id, source, "failed", error=message)
