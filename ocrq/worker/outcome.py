"""What one job came to, as the Celery task returns it and `ocrq run` reports it.

Its own module because every stage of the job runner (ocrq/worker/jobs.py) makes one: the
claim (a copy of a job another delivery ran), the completion (stored, failed, not run) and the
job webhooks (an expired job's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ocrq.core.store import public_view


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    source: str
    status: str  # done | failed, or the row's cancelled | expired when not run
    text: str | None = None
    lines: list[dict[str, Any]] | None = None
    error: str | None = None
    already_done: bool = False
    truncated: str | None = None  # why the text ended early: "max_tokens", "repetition"
    batch_id: str | None = None  # the batch that ran it (Flower shows it in the task result)
    batch_wait_s: float | None = None  # how long it waited for that batch to start
    pages: int | None = None  # a document's splitting job: the page jobs it made
    # Of those, (id, error) of each that failed while the document was split and was sent to
    # no one: its Celery result is the task's to store (ocrq/worker/tasks.py), or none comes.
    split_failures: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of_row(
        cls,
        job_id: str,
        source: str,
        row: dict[str, Any],
        status: str,
        pages: int | None = None,
    ) -> JobOutcome:
        """A job another delivery ran: its stored row (`status` while it has none), with the
        batch that ran it, so the copy's task result names it as the first one's did (Flower
        lost the batch when a redelivery was ignored). How long that batch was waited for is
        not stored: `batch_wait_s` is None, as this delivery waited for no batch."""
        return cls(
            job_id,
            source,
            row.get("status", status),
            row.get("text"),
            row.get("lines"),
            row.get("error"),
            already_done=True,
            truncated=row.get("truncated"),
            batch_id=row.get("batch_id"),
            pages=pages,
        )

    def as_json(self) -> dict[str, Any]:
        """The same JSON object `ocrq status` and the api show for the stored row."""
        return public_view(
            {
                "id": self.job_id,
                "source": self.source,
                "status": self.status,
                "text": self.text,
                "lines": self.lines,
                "error": self.error,
                "truncated": self.truncated,
            }
        )
