"""Who is told when a job ends: its webhook, its document's, its batch's.

Beside the job runner's stages, not one of them: each is sent once the row it reports is final
and committed, from threads of its own (ocrq/worker/webhooks.py signs, sends and retries;
ocrq/worker/batch_hooks.py looks at batches), so a task thread only hands it over.

- A job's (`job.finished`): its outcome, when its row is final (`job_finished`), also when it
  expired unrun (`expired`). A page job has none of its own.
- A document's (`document.finished`): the document's own job's `callback_url`, sent with the
  document's outcome once it is assembled, by the first page job to find it final and claim
  its notice (`document_finished`); a document whose every page failed at the split is final
  at once, and its own job sends it (`job_finished`).
- A batch's (`batch.finished`): a job of the batch that ends here notes the batch
  (`job_ended`); the batch hooks' thread sends it once every unit of the batch is final.

The senders start on first use (a worker whose jobs name no webhook starts no thread), except
the batch hooks' thread, which a Celery worker starts at once (`watch_batches`). First use comes
from many task threads at once, so it is made under a lock: two senders made side by side would
each keep their own retries, and `close` would see only one of them (the other's deliveries
neither sent at a warm shutdown nor logged as dropped).
"""

from __future__ import annotations

import threading
from typing import Any

from ocrq.core.documents_store import FINAL as DOCUMENT_FINAL
from ocrq.core.settings import Settings
from ocrq.worker.batch_hooks import BatchHooks
from ocrq.worker.job_rows import JobRows
from ocrq.worker.outcome import JobOutcome
from ocrq.worker.webhooks import Webhooks


class Notices:
    def __init__(self, settings: Settings, rows: JobRows) -> None:
        self.settings = settings
        self.rows = rows
        self._webhooks: Webhooks | None = None  # started by the first job with a callback_url
        self._batches: BatchHooks | None = None  # batch webhooks (worker/batch_hooks.py)
        # The first use of either, from any task thread; re-entrant, as the batch hooks are
        # made with the webhook sender's factory in hand.
        self._making = threading.RLock()

    def watch_batches(self) -> None:
        """Start the batch webhooks' thread now (a Celery worker), not at the first job of a
        batch: its sweep fires the webhook of a batch whose last job ended in a worker that
        died before it looked, also when no job of that batch comes here."""
        self._batch_hooks.start()

    def job_ended(self, batch: str | None) -> None:
        """A job of `batch` ended here (or was found final): its batch looked at soon."""
        self._batch_hooks.job_ended(batch)

    def job_finished(self, job_id: str, callback_url: str | None, outcome: JobOutcome) -> None:
        """The job's webhook, once its row is committed. A document split into pages sends its
        webhook once it is assembled, not now, unless every page failed at the split (final
        already)."""
        if not callback_url:
            return
        if not (outcome.pages is not None and outcome.status == "done"):
            self._webhook().send(callback_url, outcome.as_json())
            return
        document = self.rows.db(self.rows.documents.get)([job_id]).get(job_id)
        if document is not None and document["status"] in DOCUMENT_FINAL:
            self.document_finished(job_id, document["status"])

    def expired(self, row: dict[str, Any]) -> None:
        """job.finished for a job that expired unrun (a page's webhook is its document's)."""
        if row.get("callback_url") and row.get("page") is None and row.get("id"):
            outcome = JobOutcome.of_row(row["id"], row.get("source", ""), row, "expired")
            self._webhook().send(row["callback_url"], outcome.as_json())

    def document_finished(self, document_id: str, status: str) -> None:
        """The document's own job's webhook, with the document's outcome (document.finished),
        sent by the first page job to find it final and claim it (`claim_notice`): once per
        document, also when two pages end together or a copy of a page is redelivered."""
        row = self.rows.row(document_id)
        if row is None or not row.get("callback_url"):
            return
        if not self.rows.db(self.rows.documents.claim_notice)(document_id):
            return
        document = self.rows.db(self.rows.documents.get)([document_id]).get(document_id) or {}
        body = {
            "job_id": document_id,
            "document_id": document_id,
            "path": row.get("source"),
            "status": status,
            "pages": document.get("pages"),
            "text": document.get("text"),
            "error": document.get("error"),
            "batch": row.get("batch"),
            "page_results": document.get("result"),
        }
        self._webhook().send(
            row["callback_url"], body, event="document.finished", key=f"document {document_id}"
        )

    def close(self) -> None:
        """At shutdown: the batch hooks stop looking, webhooks still retrying give up."""
        if self._batches is not None:
            self._batches.close()
        if self._webhooks is not None:
            self._webhooks.close()

    def _webhook(self) -> Webhooks:
        if self._webhooks is None:
            with self._making:
                if self._webhooks is None:
                    self._webhooks = Webhooks(self.settings)
        return self._webhooks

    @property
    def _batch_hooks(self) -> BatchHooks:
        if self._batches is None:
            with self._making:
                if self._batches is None:
                    self._batches = BatchHooks(self.settings, self.rows.store.engine,
                                               self._webhook)
        return self._batches
