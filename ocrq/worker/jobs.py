"""One job from request to stored row: the steps the Celery task and `ocrq run` share.

claim (ocrq/worker/claiming.py) -> prepare: fetch + decode, in the caller's thread, which is the
prefetch (preparing.py) -> run: the batcher -> complete: store and report (completing.py). The
caller's thread blocks on the batcher's future while the engine works on a whole batch. Beside
the stages, not in their way: the webhooks (notices.py) and the cancel watch (cancels.py).

`JobRunner` only orders the stages and holds what spans them: the decoded-image slots (taken
before the fetch, given back when the batcher lets go of the image), the retry gate
(ocrq/worker/alone.py) and the job's deadline. Each stage gets what it needs passed in (the
tables through one `JobRows`, the broker's notes to the claim alone) and hands the next a plain
value: a `Claim`, a `Prepared` image or a document, an `ItemOutcome`, a `JobOutcome`. It was one
class of ~30 methods in 737 lines (issue 49) whose parts shared its private state.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import DBAPIError

from ocrq.core import metrics
from ocrq.core.contract import TASKS, JobRequest
from ocrq.core.settings import Settings
from ocrq.core.store import Claim, JobStore, now
from ocrq.intake import documents, splitting
from ocrq.models.base import EngineFront
from ocrq.scheduling.vocabulary import Batcher
from ocrq.worker.alone import RetryGate
from ocrq.worker.cancels import CancelWatch
from ocrq.worker.claiming import Claiming
from ocrq.worker.completing import Completing
from ocrq.worker.job_rows import JobRows, db_unavailable
from ocrq.worker.notices import Notices
from ocrq.worker.outcome import JobOutcome
from ocrq.worker.preparing import Preparing, Refused

if TYPE_CHECKING:
    from ocrq.core.broker_scan import BrokerNotes

log = logging.getLogger(__name__)


def _timed_out(seconds: float) -> str:
    return f"timed out after {seconds:g} s (OCRQ_JOB_TIMEOUT_S)"


class JobRunner:
    def __init__(
        self,
        settings: Settings,
        engine: EngineFront,
        batcher: Batcher,
        store: JobStore,
        worker_name: str,
        prefetch_images: int = 64,
        send_page: splitting.SendPage | None = None,
        broker: BrokerNotes | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.batcher = batcher
        self.store = store
        self.worker_name = worker_name
        rows = JobRows.of(store, settings.db_retry_s)
        self.documents = rows.documents
        # The stages, and beside them the webhooks and the cancel watch (module docstring).
        # `broker`: the broker's notes (ocrq/core/broker_scan.py), the claim's alone; None for
        # `ocrq run`. `send_page`: where a document's page jobs go (None: the broker's queue).
        self._rows = rows
        self._claiming = Claiming(
            rows, worker_name, settings.max_attempts, settings.job_timeout_s, broker
        )
        self._preparing = Preparing(settings, engine, rows, send_page)
        self._completing = Completing(rows, worker_name, engine.name, settings.max_attempts)
        self._notices = Notices(settings, rows)
        self._cancels = CancelWatch(store, batcher, self._claiming.in_flight.ids)
        # Caps decoded images held at once (prefetched + in the running batch): memory stays
        # bounded however many task threads there are.
        self.prefetch_images = prefetch_images
        self._decoded = threading.BoundedSemaphore(prefetch_images)
        self._gate = RetryGate()

    def close(self) -> None:
        """At shutdown, after the batcher: webhooks still retrying give up."""
        self._cancels.stop()
        self._notices.close()

    def watch_batches(self) -> None:
        """Start the batch webhooks' thread now (a Celery worker): ocrq/worker/notices.py."""
        self._notices.watch_batches()

    def process(self, request: JobRequest) -> JobOutcome:
        self._cancels.start()  # at the first job (ocrq/worker/cancels.py)
        if request.image.name is not None or request.image.document is not None:
            page = self._claiming.as_recorded_page(request)
            if page is None:
                return self._completing.refuse_name(request)
            request = page
        source = request.image.describe()
        named = (source, request.task)
        in_flight = self._claiming.in_flight
        running, owner = in_flight.enter(request.job_id, named)
        if not owner and running.named == named:
            return self._claiming.await_running(request.job_id, source, running)
        try:
            # Another image under a running job's id goes on to the claim, which refuses it.
            outcome = self._process(request, source)
            if request.image.page is not None:
                # Also on a redelivery that finds the page done: its first delivery may have
                # died between storing the page and completing the document.
                self._page_ended(request.job_id)
            self._notices.job_ended(request.batch)
            return outcome
        finally:
            if owner:
                in_flight.leave(request.job_id, running)

    def expire(self, job_id: str, task: str, source: str, when: dt.datetime) -> bool:
        """A job Celery discarded past its `expires`: its row `expired` and, when this made it
        so, its webhooks (job, document, batch) as for any other final job; before, an expired
        job fired none."""
        if not self.store.expire(job_id, task, source, when):
            return False
        row = self._rows.row(job_id) or {}
        self._notices.expired(row)
        if row.get("page") is not None:
            self._page_ended(job_id)
        self._notices.job_ended(row.get("batch"))
        return True

    def reject(
        self, job_id: Any, source: str, task: str, message: str, task_id: Any = None
    ) -> None:
        """Record a malformed request as a failed job (ocrq/worker/completing.py `reject`)."""
        self._completing.reject(job_id, source, task, message, task_id)

    def _process(self, request: JobRequest, source: str) -> JobOutcome:
        """Claim, then run, then the job's webhook."""
        task = request.task if request.task in TASKS else "custom"
        started = now()
        claim = self._claiming.claim(request, source)  # raises RunningElsewhere
        if not claim.run:
            if claim.expired_now:
                self._notices.expired(claim.row or {})
            return self._completing.not_run(request.job_id, source, claim)
        try:
            outcome = self._run_claimed(request, source, claim, task, started)
        except DBAPIError as exc:
            if db_unavailable(exc):  # the task gives the message back (ocrq/worker/tasks.py)
                self._claiming.note_given_back(request.job_id)
            raise
        # The row is committed; sent from its own threads.
        self._notices.job_finished(request.job_id, claim.callback_url, outcome)
        return outcome

    def _page_ended(self, job_id: str) -> None:
        """A page job ended: its document completed if it was the last, and then its webhook."""
        ended = self._completing.complete_document(job_id)
        if ended is not None:
            self._notices.document_finished(*ended)

    def _run_claimed(
        self, request: JobRequest, source: str, claim: Claim, task: str, started: dt.datetime
    ) -> JobOutcome:
        """A claimed job: a first run beside the others, a retry alone (ocrq/worker/alone.py)."""
        if claim.created_at is not None:  # the producer's row: when the job was enqueued
            metrics.observe_stage("queue_wait", (started - claim.created_at).total_seconds())
        claim = self._claiming.resumed(request.job_id, claim)
        if not claim.retry:
            with self._gate.shared():
                return self._run(request, source, task, claim.created_at)
        with self._gate.alone():  # see ocrq/worker/alone.py
            if not self._claiming.count_retry(request.job_id):
                row = self._rows.row(request.job_id) or {}
                return JobOutcome.of_row(request.job_id, source, row, "running")
            log.warning(
                "job %s: its last run died with its worker; running it alone", request.job_id
            )
            return self._run(request, source, task, claim.created_at)

    def _run(
        self,
        request: JobRequest,
        source: str,
        task: str,
        enqueued: dt.datetime | None = None,
    ) -> JobOutcome:
        """A claimed job: prepared (or split), run by the batcher, completed."""
        # One deadline for the whole wait: a slot for the decoded image, then the batch. The
        # fetch is bounded by the intake's own deadline. Celery's task time limits do not work
        # with the threads pool, so this is the task time limit.
        timeout = self.settings.job_timeout_s
        deadline = time.monotonic() + timeout
        if not self._decoded.acquire(timeout=timeout):
            return self._completing.fail(request.job_id, source, _timed_out(timeout))
        metrics.IN_FLIGHT.inc()
        release_slot = True
        try:
            prepared = self._preparing.prepare(request, source, task)
            if isinstance(prepared, documents.Document):
                return self._split(request, source, prepared)
            if isinstance(prepared, Refused):
                return self._completing.fail(request.job_id, source, prepared.error)
            facts, future = prepared.facts, self.batcher.submit(prepared.item)
            del prepared  # the item holds the pixels the model will see: the batcher's now
            try:
                outcome = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                # The batch goes on and its result is dropped; the image still counts against
                # the decoded-image cap until the batcher lets go of it.
                future.add_done_callback(lambda _: self._release_slot())
                release_slot = False
                return self._completing.fail(
                    request.job_id, source, _timed_out(timeout), **facts.fields()
                )
        finally:
            if release_slot:
                self._release_slot()
        return self._completing.stored(request, source, facts, outcome, enqueued)

    def _split(self, request: JobRequest, source: str, document: documents.Document) -> JobOutcome:
        """A document's own job: split into page jobs (its slot held meanwhile), then done."""
        pages = self._preparing.split(request, document)
        if isinstance(pages, Refused):
            return self._completing.fail(request.job_id, source, pages.error)
        return self._completing.split_done(request.job_id, source, pages)

    def _release_slot(self) -> None:
        self._decoded.release()
        metrics.IN_FLIGHT.dec()
