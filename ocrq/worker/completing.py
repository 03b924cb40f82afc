"""The job runner's last stage: what a job came to, written to its row and reported.

Every way a job ends goes through here: its result stored (`stored`), failed (`fail`), a
document's own job done once split (`split_done`), not run because the claim said no
(`not_run`), a malformed request recorded as failed (`reject`), and, when this attempt's
outcome cannot be written over a row already final (cancelled while it ran, or finished by
another copy), the row's own outcome (`final_row`). A page job's end may complete its document
(`complete_document`). Each writes through `JobRows` and hands back a `JobOutcome`; sending the
webhooks that follow is ocrq/worker/notices.py's.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import replace
from typing import Any

from ocrq.core import metrics
from ocrq.core.contract import DOCUMENT_REFUSED, NAME_REFUSED, JobRequest, canonical_job_id
from ocrq.core.process import STATE
from ocrq.core.store import Claim, now
from ocrq.scheduling.vocabulary import Cancelled, ItemOutcome
from ocrq.worker.envelope import safe_text
from ocrq.worker.job_rows import JobRows, db_unavailable
from ocrq.worker.outcome import JobOutcome
from ocrq.worker.preparing import ImageFacts

log = logging.getLogger(__name__)


class Completing:
    def __init__(
        self, rows: JobRows, worker_name: str, engine_name: str, max_attempts: int
    ) -> None:
        self.rows = rows
        # The finisher's name: a job whose message had two copies about (one re-sent after a
        # kill) can be claimed again by a second worker while the first still runs it;
        # finish() stores whichever ends first, and the row then names that worker, the one
        # whose ocrq_jobs_total counted it, not the last to claim it.
        self.worker_name = worker_name
        self.engine_name = engine_name
        self.max_attempts = max_attempts

    def stored(
        self,
        request: JobRequest,
        source: str,
        facts: ImageFacts,
        outcome: ItemOutcome,
        enqueued: dt.datetime | None,
    ) -> JobOutcome:
        """The batcher's outcome of a job's image, stored: done with its text, failed with the
        engine's error, or (cancelled meanwhile) the row's own outcome."""
        metrics.observe_stage("batch_wait", outcome.waited_s)
        metrics.observe_stage("gpu", outcome.run_s)
        waited = outcome.waited_s
        if enqueued is not None:  # from the enqueue: the broker's queue included
            waited = (now() - enqueued).total_seconds() - outcome.run_s
        metrics.observe_lane(request.priority, waited, outcome.run_s)
        batch = {"batch_id": outcome.batch_id or None, "batch_wait_s": round(outcome.waited_s, 4)}
        common = {
            **facts.fields(),
            "engine": outcome.engine,
            "batch_id": outcome.batch_id or None,
        }
        if isinstance(outcome.error, Cancelled):  # dropped by the batcher: the row says why
            return replace(self.final_row(request.job_id, source), **batch)
        if outcome.error is not None or outcome.result is None:
            message = f"{type(outcome.error).__name__}: {outcome.error}"
            failed = self.fail(request.job_id, source, message, **common)
            return replace(failed, **batch)
        lines = [line.as_json() for line in outcome.result.lines]
        try:
            with metrics.stage_timer("store"):
                stored = self.rows.db(self.rows.store.finish)(
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
            failed = self.fail(request.job_id, source, message, **common)
            return replace(failed, **batch)
        if not stored:  # cancelled while it ran: the result is dropped, the row stands
            return self.final_row(request.job_id, source)
        self.count("done")
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

    def fail(self, job_id: str, source: str, message: str, **fields: Any) -> JobOutcome:
        log.warning("job %s failed: %s", job_id, message)
        with metrics.stage_timer("store"):
            stored = self.rows.db(self.rows.store.finish)(
                job_id, status="failed", error=message, worker=self.worker_name, **fields
            )
        if not stored:  # cancelled (or finished by another delivery) meanwhile: the row stands
            return self.final_row(job_id, source)
        self.count("failed")
        return JobOutcome(job_id, source, "failed", error=message)

    def split_done(self, job_id: str, source: str, pages: int) -> JobOutcome:
        """A document's own job once its page jobs were made and sent: its row done; or,
        cancelled meanwhile (its row final: `finish` stores nothing over it), the document
        cancelled with it, however far the split got."""
        stored = self.rows.db(self.rows.store.finish)(
            job_id, status="done", error=None, worker=self.worker_name
        )
        if not stored:  # final already: cancelled after the split's last look, its pages
            # go with it (finished by another copy of the split: left as that copy left it)
            if self.rows.db(self.rows.store.cancelled_among)([job_id]):
                self.rows.db(self.rows.documents.cancel)(job_id)
            return self.final_row(job_id, source)
        self.count("done")
        return JobOutcome(job_id, source, "done", pages=pages)

    def complete_document(self, job_id: str) -> tuple[str, str] | None:
        """The page's document assembled if this was its last page: (its id, its status) when
        it is final (assembled by this call, another page job or the api), else None. Which
        caller sends its webhook is decided by the document notice's claim
        (ocrq/worker/notices.py), not here."""
        return self.rows.db(self._complete_document)(job_id)  # retried whole

    def _complete_document(self, job_id: str) -> tuple[str, str] | None:
        row = self.rows.store.get([job_id]).get(job_id)
        if row is not None and row.get("document_id") and row.get("page") is not None:
            status, now_final = self.rows.documents.assemble(row["document_id"])
            if status is not None and now_final:
                log.info("document %s %s", row["document_id"], status)
            if status is not None:
                return row["document_id"], status
        return None

    def not_run(self, job_id: str, source: str, claim: Claim) -> JobOutcome:
        """A claim that said no: already final, the id taken by another image, or out of tries."""
        row = claim.row or {}
        if claim.error is None:  # final: the stored outcome stands, this copy is acked
            status = row.get("status", "done")
            if status in ("cancelled", "expired"):
                log.info("job %s is %s: not run (%s)", job_id, status, row.get("error"))
            else:
                log.info("job %s already %s; redelivery ignored", job_id, status)
            return self.rows.as_stored(job_id, source, row, "done")
        # Nothing is written: a reused id's row belongs to its first image, and a job out of
        # attempts was failed by the claim itself.
        log.warning("job %s refused: %s", job_id, claim.error)
        self.count("failed")
        return JobOutcome(job_id, source, "failed", error=claim.error)

    def final_row(self, job_id: str, source: str) -> JobOutcome:
        """The outcome a row already final says, when this attempt's could not be stored over
        it: a job cancelled while it ran reports `cancelled`, not the result it dropped."""
        row = self.rows.row(job_id) or {}
        log.info("job %s is %s already; this attempt's outcome dropped", job_id, row.get("status"))
        return self.rows.as_stored(job_id, source, row, "failed")

    def refuse_name(self, request: JobRequest) -> JobOutcome:
        """A producer-named job fails, recorded under what its image really is."""
        source = request.image.unnamed().describe()
        message = NAME_REFUSED if request.image.document is None else DOCUMENT_REFUSED
        self.reject(request.job_id, source, request.task, message)
        return JobOutcome(request.job_id, source, "failed", error=message)

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
        claim = self.rows.db(self.rows.store.claim)(
            job_id, task, source, self.worker_name, max_attempts=self.max_attempts
        )
        if claim.run:
            self.fail(job_id, source, message)
        elif claim.error is not None:
            self.not_run(job_id, source, claim)

    def count(self, status: str) -> None:
        """One finished job in `ocrq_jobs_total`: every call site passes both labels through
        here, since a label missing at one of them (a document's split) raised ValueError after
        the row was stored and failed its Celery task and `ocrq run` (issue 27)."""
        metrics.JOBS.labels(status, self.engine_name).inc()
