"""One job from request to stored row: the steps the Celery task and `ocrq run` share.

claim row -> fetch + decode (in the caller's thread: this is the prefetch) -> batcher -> store.
The caller's thread blocks on the batcher's future while the engine works on a whole batch.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy.exc import DBAPIError
from tenacity import (
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from ocrq.core import metrics
from ocrq.core.contract import (
    DOCUMENT_REFUSED,
    NAME_REFUSED,
    TASKS,
    JobRequest,
    canonical_job_id,
)
from ocrq.core.documents_store import FINAL as DOCUMENT_FINAL
from ocrq.core.documents_store import DocumentStore
from ocrq.core.pixel_budget import Stage
from ocrq.core.process import STATE
from ocrq.core.settings import Settings
from ocrq.core.store import Claim, JobStore, now, public_view
from ocrq.intake import documents, images, splitting
from ocrq.intake.stored import StoredDocuments
from ocrq.models.base import EngineFront, PreparedImage
from ocrq.scheduling.vocabulary import Batcher, Cancelled
from ocrq.worker.alone import RetryGate
from ocrq.worker.batch_hooks import BatchHooks
from ocrq.worker.cancels import CancelWatch
from ocrq.worker.envelope import safe_text
from ocrq.worker.webhooks import Webhooks

if TYPE_CHECKING:
    from ocrq.core.broker_scan import BrokerNotes

log = logging.getLogger(__name__)
T = TypeVar("T")


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


def db_unavailable(exc: BaseException) -> bool:
    """Connection-level failures are worth waiting out; constraint errors are not."""
    return isinstance(exc, DBAPIError) and (
        exc.connection_invalidated or type(exc.orig).__name__ in ("OperationalError",)
    )


def _timed_out(seconds: float) -> str:
    return f"timed out after {seconds:g} s (OCRQ_JOB_TIMEOUT_S)"


class RunningElsewhere(Exception):
    """A second copy of a job's message, met while another live worker runs the job and holds
    its own copy: this one is dropped unrun (the Celery task acks it and stores no result).
    Nothing is lost: that worker finishes the job, or dies holding its copy, which the sweep
    puts back (ocrq/core/requeue.py)."""

    def __init__(self, job_id: str, worker: str) -> None:
        super().__init__(f"job {job_id} is running on {worker}, which holds its message")
        self.job_id, self.worker = job_id, worker


class _IsDocument(Exception):
    """The job's bytes are a document: it is split into page jobs, not run as an image."""


@dataclass
class _Running:
    """A job a task thread of this process is running: what it names, and when it is done."""

    named: tuple[str, str]  # source, task
    finished: threading.Event = field(default_factory=threading.Event)


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
        # The broker's notes (ocrq/core/broker_scan.py): whether a worker holds a job's message
        # now, asked when a claim finds the job running under another worker; and which jobs
        # were given back with their rows claimed. None (`ocrq run`): such a job is taken over
        # as before, and there is no broker to give a job back to.
        self._broker = broker
        # Where a document's page jobs go (ocrq/intake/splitting.py): the broker, or `ocrq run`'s
        # own threads; built on first use, so image-only runs never connect for it.
        self._send_page = send_page
        self.documents = DocumentStore(store.engine)
        # The bytes of URL and inline documents, which their page jobs name (stored once when
        # they were split): read once a document, kept for its next pages.
        self._stored = StoredDocuments(
            self._read_stored, max_bytes=2 * settings.max_image_bytes
        )
        self.engine = engine
        self.batcher = batcher
        self.store = store
        self.worker_name = worker_name
        # Caps decoded images held at once (prefetched + in the running batch): memory stays
        # bounded however many task threads there are.
        self.prefetch_images = prefetch_images
        self._decoded = threading.BoundedSemaphore(prefetch_images)
        # While the database is down, results wait in this thread (and the message stays
        # unacked) rather than being dropped or acked without a row.
        self._db = retry(
            retry=retry_if_exception(db_unavailable),
            wait=wait_exponential(multiplier=0.5, max=5),
            stop=stop_after_delay(settings.db_retry_s),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        )
        # Jobs a task thread of this process is running now. A second delivery of one of them
        # (the same id in another spelling, a producer's retry, a visibility-timeout
        # redelivery) is not a retry of a dead attempt: claimed again, it ran the job once more
        # and, with enough copies, failed a healthy job as "the worker died" (issue 16's probe).
        self._in_flight: dict[str, _Running] = {}
        self._in_flight_lock = threading.Lock()
        self._gate = RetryGate()
        self._webhooks: Webhooks | None = None  # started by the first job with a callback_url
        self._cancels: CancelWatch | None = None  # started by the first job (worker/cancels.py)
        self._batches: BatchHooks | None = None  # batch webhooks (worker/batch_hooks.py)

    def close(self) -> None:
        """At shutdown, after the batcher: webhooks still retrying give up."""
        if self._cancels is not None:
            self._cancels.stop()
        if self._batches is not None:
            self._batches.close()
        if self._webhooks is not None:
            self._webhooks.close()

    def watch_batches(self) -> None:
        """Start the batch webhooks' thread now (a Celery worker), not at the first job of a
        batch: its sweep fires the webhook of a batch whose last job ended in a worker that
        died before it looked, also when no job of that batch comes here."""
        self._batch_hooks.start()

    def _in_flight_ids(self) -> list[str]:
        with self._in_flight_lock:
            return list(self._in_flight)

    def _watch_cancels(self) -> None:
        if self._cancels is None:
            with self._in_flight_lock:
                if self._cancels is None:
                    self._cancels = CancelWatch(
                        self.store, self.batcher, self._in_flight_ids
                    ).start()

    def process(self, request: JobRequest) -> JobOutcome:
        self._watch_cancels()
        if request.image.name is not None or request.image.document is not None:
            page = self._db(self._as_recorded_page)(request)
            if page is None:
                return self._refuse_name(request)
            request = page
        source = request.image.describe()
        named = (source, request.task)
        with self._in_flight_lock:
            running = self._in_flight.get(request.job_id)
            owner = running is None
            if running is None:
                running = self._in_flight[request.job_id] = _Running(named)
        if not owner and running.named == named:
            return self._await_running(request.job_id, source, running)
        try:
            # Another image under a running job's id goes on to the claim, which refuses it.
            outcome = self._process(request, source)
            if request.image.page is not None:
                # Also on a redelivery that finds the page done: its first delivery may have
                # died between storing the page and completing the document.
                ended = self._db(self._complete_document)(request.job_id)
                if ended is not None:
                    self._document_webhook(*ended)
            self._batch_hooks.job_ended(request.batch)
            return outcome
        finally:
            if owner:
                with self._in_flight_lock:
                    del self._in_flight[request.job_id]
                running.finished.set()

    def _as_recorded_page(self, request: JobRequest) -> JobRequest | None:
        """The job as its document's split recorded its page row, or None when it names what
        that row does not: only ocrq's own page jobs may name their image (a producer's name
        was taken for a path by re-sends, and ran the job as another file) or a stored
        document (another document's bytes). A stored document's page re-sent from its row
        (the recovery sweep, `ocrq retry`) comes without its name, which the row gives back."""
        row = self.store.get([request.job_id]).get(request.job_id)
        if row is None or row.get("document_id") is None:
            return None
        image = request.image
        if image.document is not None:
            if (row["document_id"], row.get("page")) != (image.document, image.page):
                return None
            if image.name is None:
                named = image.model_copy(update={"name": row.get("source")})
                return request.model_copy(update={"image": named})
        return request if row.get("source") == image.describe() else None

    def _refuse_name(self, request: JobRequest) -> JobOutcome:
        """A producer-named job fails, recorded under what its image really is."""
        source = request.image.unnamed().describe()
        message = NAME_REFUSED if request.image.document is None else DOCUMENT_REFUSED
        self.reject(request.job_id, source, request.task, message)
        return JobOutcome(request.job_id, source, "failed", error=message)

    def _read_stored(self, document_id: str) -> bytes | None:
        return self._db(self.documents.stored_bytes)(document_id)

    def _await_running(self, job_id: str, source: str, running: _Running) -> JobOutcome:
        """A copy of a job running in this process: report its outcome once it is stored.

        The copy's message is acked only after that: a message redelivered to this very process
        shares the running one's delivery tag, so acking it early could drop the job if the
        process then died.
        """
        log.info("job %s is running in this worker already; this delivery waits for it", job_id)
        running.finished.wait(self.settings.job_timeout_s + 60)
        row = self._db(self.store.get)([job_id]).get(job_id) or {}
        return self._as_stored(job_id, source, row, "running")

    def _as_stored(self, job_id: str, source: str, row: dict[str, Any], status: str) -> JobOutcome:
        """The outcome another delivery stored, as that delivery reported it: a document's
        own job with its page count too."""
        pages = None
        if row.get("document_id") == job_id and row.get("page") is None:
            document = self._db(self.documents.get)([job_id]).get(job_id)
            pages = document["pages"] if document is not None else None
        return JobOutcome.of_row(job_id, source, row, status, pages)

    def _process(self, request: JobRequest, source: str) -> JobOutcome:
        task = request.task if request.task in TASKS else "custom"
        started = now()
        claim = self._claim(request, source, take_running=self._broker is None)
        if claim.elsewhere is not None:
            # Running under another worker: a second copy of its message (a producer that
            # sent it twice, a sweep's re-send beside a message still on its way). Taken
            # over, the job ran twice, the second time alone as if its worker had died.
            if self._held_elsewhere(claim.elsewhere, request.job_id):
                log.info(
                    "job %s runs on %s, which holds its message: this copy is dropped",
                    request.job_id, claim.elsewhere,
                )
                raise RunningElsewhere(request.job_id, claim.elsewhere)
            claim = self._claim(request, source, take_running=True)  # its worker let it go
        if not claim.run:
            if claim.expired_now:
                self._expired_webhook(claim.row or {})
            return self._not_run(request.job_id, source, claim)
        try:
            outcome = self._run_claimed(request, source, claim, task, started)
        except DBAPIError as exc:
            if db_unavailable(exc):  # the task gives the message back (ocrq/worker/tasks.py)
                self._note_given_back(request.job_id)
            raise
        # A document split into pages sends its webhook once it is assembled, not now.
        split = outcome.pages is not None and outcome.status == "done"
        if claim.callback_url and not split:  # the row is committed; sent from its own threads
            self._webhook().send(claim.callback_url, outcome.as_json())
        elif claim.callback_url:  # every page may have failed at the split: final already
            document = self._db(self.documents.get)([request.job_id]).get(request.job_id)
            if document is not None and document["status"] in DOCUMENT_FINAL:
                self._document_webhook(request.job_id, document["status"])
        return outcome

    def _claim(self, request: JobRequest, source: str, take_running: bool) -> Claim:
        return self._db(self.store.claim)(
            request.job_id,
            request.task,
            source,
            self.worker_name,
            max_attempts=self.settings.max_attempts,
            page=request.image.page,
            reference=request.image.reference(),
            batch=request.batch,
            rerun=request.retry,
            columns=request.columns(),
            take_running=take_running,
        )

    def _held_elsewhere(self, worker: str, job_id: str) -> bool:
        """Whether `worker` holds the job's message; when the broker cannot say, False: the job
        is taken over as it was before this check (run twice at worst, never lost)."""
        assert self._broker is not None
        broker = self._broker
        return self._ask_broker(
            job_id, f"ask the broker whether {worker} holds it (running it)",
            lambda: broker.holds(worker, job_id) is True, False,
        )

    def _note_given_back(self, job_id: str) -> None:
        """Tell the broker that this claimed job's message goes back to the queue with the
        database away: the row stays `running` under this live worker, which the next claim
        would take for a worker that died mid-run. Without the note (no broker, or it failed)
        the job still runs again, alone and charged an attempt, as before."""
        if self._broker is not None:
            broker = self._broker
            self._ask_broker(job_id, "note its message given back",
                             lambda: broker.gave_back(job_id, self.worker_name), None)

    def _given_back(self, job_id: str) -> str | None:
        if self._broker is None:
            return None
        broker = self._broker
        return self._ask_broker(job_id, "ask the broker whether it was given back",
                                lambda: broker.given_back(job_id), None)

    def _ask_broker(self, job_id: str, what: str, call: Callable[[], T], unanswered: T) -> T:
        """The broker's answer, or `unanswered` when it cannot give one: each question is
        asked on a rare path, and the job goes on as it did before the question existed."""
        try:
            return call()
        except Exception as exc:
            log.warning("job %s: could not %s (%s: %s)", job_id, what, type(exc).__name__, exc)
            return unanswered

    def _webhook(self) -> Webhooks:
        if self._webhooks is None:
            self._webhooks = Webhooks(self.settings)
        return self._webhooks

    @property
    def _batch_hooks(self) -> BatchHooks:
        if self._batches is None:
            self._batches = BatchHooks(self.settings, self.store.engine, self._webhook)
        return self._batches

    def expire(self, job_id: str, task: str, source: str, when: dt.datetime) -> bool:
        """A job Celery discarded past its `expires`: its row `expired` and, when this made it
        so, its webhooks (job, document, batch) as for any other final job; before, an expired
        job fired none."""
        if not self.store.expire(job_id, task, source, when):
            return False
        row = self._db(self.store.get)([job_id]).get(job_id) or {}
        self._expired_webhook(row)
        if row.get("page") is not None:
            ended = self._db(self._complete_document)(job_id)
            if ended is not None:
                self._document_webhook(*ended)
        self._batch_hooks.job_ended(row.get("batch"))
        return True

    def _expired_webhook(self, row: dict[str, Any]) -> None:
        """job.finished for a job that expired unrun (a page's webhook is its document's)."""
        if row.get("callback_url") and row.get("page") is None and row.get("id"):
            outcome = JobOutcome.of_row(row["id"], row.get("source", ""), row, "expired")
            self._webhook().send(row["callback_url"], outcome.as_json())

    def _document_webhook(self, document_id: str, status: str) -> None:
        """The document's own job's webhook, with the document's outcome (document.finished),
        sent by the first page job to find it final and claim it (`claim_notice`): once per
        document, also when two pages end together or a copy of a page is redelivered."""
        row = self._db(self.store.get)([document_id]).get(document_id)
        if row is None or not row.get("callback_url"):
            return
        if not self._db(self.documents.claim_notice)(document_id):
            return
        document = self._db(self.documents.get)([document_id]).get(document_id) or {}
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

    def _run_claimed(
        self, request: JobRequest, source: str, claim: Claim, task: str, started: dt.datetime
    ) -> JobOutcome:
        """A claimed job: a first run beside the others, a retry alone (ocrq/worker/alone.py)."""
        if claim.created_at is not None:  # the producer's row: when the job was enqueued
            metrics.observe_stage("queue_wait", (started - claim.created_at).total_seconds())
        if claim.retry:
            # Running already, with an attempt made: its worker died mid-run, unless that worker
            # gave the message back because the database went away (`_note_given_back`). Then
            # the run resumes beside the others and is not charged as a retry.
            gave_back = self._given_back(request.job_id)
            if gave_back is not None:
                log.info(
                    "job %s: %s gave its message back while the database was away; running "
                    "it again (not a retry)", request.job_id, gave_back,
                )
                claim = replace(claim, retry=False)
        if not claim.retry:
            with self._gate.shared():
                return self._run(request, source, task, claim.created_at)
        with self._gate.alone():  # see ocrq/worker/alone.py
            if not self._db(self.store.count_retry)(request.job_id):
                row = self._db(self.store.get)([request.job_id]).get(request.job_id) or {}
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
        """A claimed job: fetch, decode, batch, store."""
        # One deadline for the whole wait: a slot for the decoded image, then the batch. The
        # fetch is bounded by the intake's own deadline. Celery's task time limits do not work
        # with the threads pool, so this is the task time limit.
        timeout = self.settings.job_timeout_s
        deadline = time.monotonic() + timeout
        if not self._decoded.acquire(timeout=timeout):
            return self._fail(request.job_id, source, _timed_out(timeout))
        metrics.IN_FLIGHT.inc()
        release_slot = True
        try:
            document: documents.Document | None = None
            try:
                with metrics.stage_timer("fetch_decode"):
                    # The one budget of this image's pixels (ocrq/core/pixel_budget.py): the
                    # intake asks it here, the engine and the planner ask it of the item.
                    budget = replace(
                        self.engine.pixel_budget(task, request.max_pixels),
                        intake_limit=self.settings.max_image_pixels,
                    )
                    if request.image.page is not None:  # a page job: render its page here
                        loaded = documents.load_page(
                            request.image, self.settings, budget, self._stored.get
                        )
                    else:
                        taken = documents.take(request.image, self.settings)
                        if isinstance(taken, documents.Document):
                            document = taken
                            raise _IsDocument
                        keep = budget.at(Stage.DECODE)
                        loaded = images.decode(taken, self.settings, source, keep)
                item = PreparedImage(
                    key=request.job_id,
                    image=loaded.image,
                    original_size=loaded.original_size,
                    task=task,
                    prompt=request.prompt,
                    job_cap=request.max_pixels,
                    max_new_tokens=request.max_new_tokens,
                    priority=request.priority,
                )
                if self.engine.prepares_here:  # else timed in the engine process
                    with metrics.stage_timer("preprocess"):
                        self.engine.prepare(item)  # CPU preprocessing, in the prefetch thread
            except _IsDocument:
                assert document is not None
                return self._split(request, source, document)
            except Exception as exc:  # bad image, or one the engine's preprocessing refuses
                message = (
                    str(exc)
                    if isinstance(exc, images.ImageError)
                    else f"{type(exc).__name__}: {exc}"
                )
                return self._fail(request.job_id, source, message)
            image_fields = {
                "sha256": loaded.sha256,
                "width": loaded.original_size[0],
                "height": loaded.original_size[1],
            }
            del loaded  # the decoded pixels: the item holds the ones the model will see
            future = self.batcher.submit(item)
            del item
            try:
                outcome = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                # The batch goes on and its result is dropped; the image still counts against
                # the decoded-image cap until the batcher lets go of it.
                future.add_done_callback(lambda _: self._release_slot())
                release_slot = False
                return self._fail(request.job_id, source, _timed_out(timeout), **image_fields)
        finally:
            if release_slot:
                self._release_slot()
        metrics.observe_stage("batch_wait", outcome.waited_s)
        metrics.observe_stage("gpu", outcome.run_s)
        waited = outcome.waited_s
        if enqueued is not None:  # from the enqueue: the broker's queue included
            waited = (now() - enqueued).total_seconds() - outcome.run_s
        metrics.observe_lane(request.priority, waited, outcome.run_s)
        batch = {"batch_id": outcome.batch_id or None, "batch_wait_s": round(outcome.waited_s, 4)}
        common = {
            **image_fields,
            "engine": outcome.engine,
            "batch_id": outcome.batch_id or None,
        }
        if isinstance(outcome.error, Cancelled):  # dropped by the batcher: the row says why
            return replace(self._final_row(request.job_id, source), **batch)
        if outcome.error is not None or outcome.result is None:
            message = f"{type(outcome.error).__name__}: {outcome.error}"
            failed = self._fail(request.job_id, source, message, **common)
            return replace(failed, **batch)
        lines = [line.as_json() for line in outcome.result.lines]
        try:
            with metrics.stage_timer("store"):
                stored = self._db(self.store.finish)(
                    request.job_id,
                    worker=self.worker_name,
                    status="done",
                    text=outcome.result.text,
                    lines=lines,
                    error=None,
                    truncated=outcome.result.truncated,
                    **common,
                )
        except Exception as exc:
            if db_unavailable(exc):  # down for the whole retry window: no row can be written
                raise
            # A result the row cannot hold (the store cleans text, but a result is the engine's
            # to shape): the job fails with why, instead of its row staying `running` while its
            # message is acked.
            log.exception("job %s: its result could not be stored", request.job_id)
            message = f"result could not be stored: {type(exc).__name__}: {exc}"[:2000]
            failed = self._fail(request.job_id, source, message, **common)
            return replace(failed, **batch)
        if not stored:  # cancelled while it ran: the result is dropped, the row stands
            return self._final_row(request.job_id, source)
        self._count("done")
        STATE.timeline.log_first_result()  # once: the end of the start (ocrq/core/startup.py)
        return JobOutcome(
            request.job_id,
            source,
            "done",
            outcome.result.text,
            lines,
            truncated=outcome.result.truncated,
            **batch,
        )

    def _count(self, status: str) -> None:
        """One finished job in `ocrq_jobs_total`: every call site passes both labels through
        here, since a label missing at one of them (a document's split) raised ValueError after
        the row was stored and failed its Celery task and `ocrq run` (issue 27)."""
        metrics.JOBS.labels(status, self.engine.name).inc()

    def _release_slot(self) -> None:
        self._decoded.release()
        metrics.IN_FLIGHT.dec()

    def _split(self, request: JobRequest, source: str, document: documents.Document) -> JobOutcome:
        """A document's own job: its page jobs made and sent, then its row done; or, cancelled
        meanwhile (its row final: `finish` stores nothing over it), the document cancelled
        with it, however far the split got."""
        if self._send_page is None:
            self._send_page = splitting.celery_sender(self.settings)
        try:
            with document:
                pages = self._db(splitting.split)(
                    request, document, self.settings, self.documents, self.store, self._send_page
                )
        except documents.DocumentError as exc:
            return self._fail(request.job_id, source, str(exc))
        stored = self._db(self.store.finish)(
            request.job_id, status="done", error=None, worker=self.worker_name
        )
        if not stored:  # final already: cancelled after the split's last look, its pages
            # go with it (finished by another copy of the split: left as that copy left it)
            if self._db(self.store.cancelled_among)([request.job_id]):
                self._db(self.documents.cancel)(request.job_id)
            return self._final_row(request.job_id, source)
        self._count("done")
        return JobOutcome(request.job_id, source, "done", pages=pages)

    def _complete_document(self, job_id: str) -> tuple[str, str] | None:
        """The page's document assembled if this was its last page: (its id, its status) when
        it is final (assembled by this call, another page job or the api), else None. Which
        caller sends its webhook is decided by `_document_webhook`'s claim, not here."""
        row = self.store.get([job_id]).get(job_id)
        if row is not None and row.get("document_id") and row.get("page") is not None:
            status, now_final = self.documents.assemble(row["document_id"])
            if status is not None and now_final:
                log.info("document %s %s", row["document_id"], status)
            if status is not None:
                return row["document_id"], status
        return None

    def _not_run(self, job_id: str, source: str, claim: Claim) -> JobOutcome:
        """A claim that said no: already final, the id taken by another image, or out of tries."""
        row = claim.row or {}
        if claim.error is None:  # final: the stored outcome stands, this copy is acked
            status = row.get("status", "done")
            if status in ("cancelled", "expired"):
                log.info("job %s is %s: not run (%s)", job_id, status, row.get("error"))
            else:
                log.info("job %s already %s; redelivery ignored", job_id, status)
            return self._as_stored(job_id, source, row, "done")
        # Nothing is written: a reused id's row belongs to its first image, and a job out of
        # attempts was failed by the claim itself.
        log.warning("job %s refused: %s", job_id, claim.error)
        self._count("failed")
        return JobOutcome(job_id, source, "failed", error=claim.error)

    def reject(
        self, job_id: Any, source: str, task: str, message: str, task_id: Any = None
    ) -> None:
        """Record a malformed request as a failed job: under its job id, or, when that is not
        usable, under its Celery task id (the id send_task returned to the producer).

        `source` and `task` must already be storable (see `storable_text`). With neither id
        usable there is no row to write: the log line, and Flower's failed task, are the record.
        """
        try:
            job_id = canonical_job_id(job_id)
        except ValueError:
            try:
                fallback: str | None = canonical_job_id(task_id)
            except ValueError:
                fallback = None
            log.warning(
                "rejected a request without a valid job id (%s): %s%s",
                safe_text(repr(job_id), 80),
                safe_text(message, 300),
                f"; its failure is stored under the task id {fallback}" if fallback else "",
            )
            if fallback is None:
                return
            job_id = fallback
        claim = self._db(self.store.claim)(
            job_id, task, source, self.worker_name, max_attempts=self.settings.max_attempts
        )
        if claim.run:
            self._fail(job_id, source, message)
        elif claim.error is not None:
            self._not_run(job_id, source, claim)

    def _fail(self, job_id: str, source: str, message: str, **fields: Any) -> JobOutcome:
        log.warning("job %s failed: %s", job_id, message)
        with metrics.stage_timer("store"):
            # The finisher's name: a job whose message had two copies about (one re-sent after
            # a kill) can be claimed again by a second worker while the first still runs it;
            # finish() stores whichever ends first, and the row then names that worker, the
            # one whose ocrq_jobs_total counted it, not the last to claim it.
            stored = self._db(self.store.finish)(
                job_id, status="failed", error=message, worker=self.worker_name, **fields
            )
        if not stored:  # cancelled (or finished by another delivery) meanwhile: the row stands
            return self._final_row(job_id, source)
        self._count("failed")
        return JobOutcome(job_id, source, "failed", error=message)

    def _final_row(self, job_id: str, source: str) -> JobOutcome:
        """The outcome a row already final says, when this attempt's could not be stored over
        it: a job cancelled while it ran reports `cancelled`, not the result it dropped."""
        row = self._db(self.store.get)([job_id]).get(job_id) or {}
        log.info("job %s is %s already; this attempt's outcome dropped", job_id, row.get("status"))
        return self._as_stored(job_id, source, row, "failed")
