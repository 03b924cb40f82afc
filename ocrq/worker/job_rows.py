"""The job and document tables as the job runner's stages use them: every call made through one
retry that waits out a database away.

While the database is down, results wait in the task thread (and the message stays unacked)
rather than being dropped or acked without a row. The stages (ocrq/worker/claiming.py,
preparing.py, completing.py, notices.py) share this one object instead of each building its own
retry or reaching into the runner's: it is all they hold of the tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from sqlalchemy.exc import DBAPIError
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from ocrq.core.documents_store import DocumentStore
from ocrq.core.store import JobStore
from ocrq.worker.outcome import JobOutcome

log = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


def db_unavailable(exc: BaseException) -> bool:
    """Connection-level failures are worth waiting out; constraint errors are not."""
    return isinstance(exc, DBAPIError) and (
        exc.connection_invalidated or type(exc.orig).__name__ in ("OperationalError",)
    )


@dataclass(frozen=True)
class JobRows:
    store: JobStore
    documents: DocumentStore
    retrying: Callable[[Callable[..., Any]], Callable[..., Any]]  # see `of`

    @classmethod
    def of(cls, store: JobStore, retry_s: float) -> JobRows:
        """The tables of `store`, each call waiting up to `retry_s` (OCRQ_DB_RETRY_S) for a
        database that went away."""
        retrying = retry(
            retry=retry_if_exception(db_unavailable),
            wait=wait_exponential(multiplier=0.5, max=5),
            stop=stop_after_delay(retry_s),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )
        return cls(store, DocumentStore(store.engine), retrying)

    def db(self, call: Callable[P, T]) -> Callable[P, T]:
        """`call`, tried again with backoff while the database is unavailable (only then)."""
        return self.retrying(call)

    def row(self, job_id: str) -> dict[str, Any] | None:
        return self.db(self.store.get)([job_id]).get(job_id)

    def as_stored(
        self, job_id: str, source: str, row: dict[str, Any], status: str
    ) -> JobOutcome:
        """The outcome another delivery stored, as that delivery reported it: a document's
        own job with its page count too."""
        pages = None
        if row.get("document_id") == job_id and row.get("page") is None:
            document = self.db(self.documents.get)([job_id]).get(job_id)
            pages = document["pages"] if document is not None else None
        return JobOutcome.of_row(job_id, source, row, status, pages)
