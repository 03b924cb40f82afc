"""The job runner's first stage: whether this delivery of a job runs it, and on what terms.

Before a job is fetched, the worker decides whether this copy of its message is the one that
runs it: a page job must name what its document's split recorded; a copy of a job that a task
thread of this same process runs waits for that one (`InFlight`); the row is claimed
(ocrq/core/store.py `JobStore.claim`), and a row `running` under another live worker that
holds its message is left to that worker (`RunningElsewhere`). The broker's notes
(ocrq/core/broker_scan.py) answer the two questions a claim cannot: whether another worker
holds a job's message now, and whether a job's message was given back with its row claimed
(the database away), which makes the next run a resumption, not a retry.

The stage hands back a `Claim` and asks nothing of the stages after it (ocrq/worker/jobs.py
runs them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, TypeVar

from ocrq.core.contract import JobRequest
from ocrq.core.store import Claim
from ocrq.worker.job_rows import JobRows
from ocrq.worker.outcome import JobOutcome

if TYPE_CHECKING:
    from ocrq.core.broker_scan import BrokerNotes

log = logging.getLogger(__name__)
T = TypeVar("T")


class RunningElsewhere(Exception):
    """A second copy of a job's message, met while another live worker runs the job and holds
    its own copy: this one is dropped unrun (the Celery task acks it and stores no result).
    Nothing is lost: that worker finishes the job, or dies holding its copy, which the sweep
    puts back (ocrq/core/requeue.py)."""

    def __init__(self, job_id: str, worker: str) -> None:
        super().__init__(f"job {job_id} is running on {worker}, which holds its message")
        self.job_id, self.worker = job_id, worker


@dataclass
class Running:
    """A job a task thread of this process is running: what it names, and when it is done."""

    named: tuple[str, str]  # source, task
    finished: threading.Event = field(default_factory=threading.Event)


class InFlight:
    """Jobs a task thread of this process is running now. A second delivery of one of them
    (the same id in another spelling, a producer's retry, a visibility-timeout redelivery) is
    not a retry of a dead attempt: claimed again, it ran the job once more and, with enough
    copies, failed a healthy job as "the worker died" (issue 16's probe). The cancel watch
    (ocrq/worker/cancels.py) asks `ids` which jobs to look up."""

    def __init__(self) -> None:
        self._running: dict[str, Running] = {}
        self._lock = threading.Lock()

    def enter(self, job_id: str, named: tuple[str, str]) -> tuple[Running, bool]:
        """The job's entry, and whether this caller made it (then it must `leave`)."""
        with self._lock:
            running = self._running.get(job_id)
            if running is not None:
                return running, False
            running = self._running[job_id] = Running(named)
            return running, True

    def leave(self, job_id: str, running: Running) -> None:
        with self._lock:
            del self._running[job_id]
        running.finished.set()

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._running)


class Claiming:
    def __init__(
        self,
        rows: JobRows,
        worker_name: str,
        max_attempts: int,
        job_timeout_s: float,
        broker: BrokerNotes | None,
    ) -> None:
        self.rows = rows
        self.worker_name = worker_name
        self.max_attempts = max_attempts
        self.job_timeout_s = job_timeout_s
        # The broker's notes: whether a worker holds a job's message now, asked when a claim
        # finds the job running under another worker; and which jobs were given back with
        # their rows claimed. None (`ocrq run`): such a job is taken over as before, and there
        # is no broker to give a job back to.
        self.broker = broker
        self.in_flight = InFlight()

    def as_recorded_page(self, request: JobRequest) -> JobRequest | None:
        """The job as its document's split recorded its page row, or None when it names what
        that row does not: only ocrq's own page jobs may name their image (a producer's name
        was taken for a path by re-sends, and ran the job as another file) or a stored
        document (another document's bytes). A stored document's page re-sent from its row
        (the recovery sweep, `ocrq retry`) comes without its name, which the row gives back."""
        row = self.rows.row(request.job_id)
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

    def await_running(self, job_id: str, source: str, running: Running) -> JobOutcome:
        """A copy of a job running in this process: report its outcome once it is stored.

        The copy's message is acked only after that: a message redelivered to this very process
        shares the running one's delivery tag, so acking it early could drop the job if the
        process then died.
        """
        log.info("job %s is running in this worker already; this delivery waits for it", job_id)
        running.finished.wait(self.job_timeout_s + 60)
        row = self.rows.row(job_id) or {}
        return self.rows.as_stored(job_id, source, row, "running")

    def claim(self, request: JobRequest, source: str) -> Claim:
        """The job's row claimed for this worker; or, running under another worker that holds
        its message, `RunningElsewhere` raised. A claim that says not to run is the caller's
        to report (ocrq/worker/completing.py `not_run`)."""
        claim = self._claim(request, source, take_running=self.broker is None)
        if claim.elsewhere is None:
            return claim
        # Running under another worker: a second copy of its message (a producer that sent it
        # twice, a sweep's re-send beside a message still on its way). Taken over, the job ran
        # twice, the second time alone as if its worker had died.
        if self._held_elsewhere(claim.elsewhere, request.job_id):
            log.info(
                "job %s runs on %s, which holds its message: this copy is dropped",
                request.job_id, claim.elsewhere,
            )
            raise RunningElsewhere(request.job_id, claim.elsewhere)
        return self._claim(request, source, take_running=True)  # its worker let it go

    def resumed(self, job_id: str, claim: Claim) -> Claim:
        """A retry's claim as it runs: running already, with an attempt made, its worker died
        mid-run, unless that worker gave the message back because the database went away
        (`note_given_back`). Then the run resumes beside the others and is not charged as a
        retry (ocrq/worker/alone.py)."""
        if not claim.retry:
            return claim
        gave_back = self._given_back(job_id)
        if gave_back is None:
            return claim
        log.info(
            "job %s: %s gave its message back while the database was away; running "
            "it again (not a retry)", job_id, gave_back,
        )
        return replace(claim, retry=False)

    def count_retry(self, job_id: str) -> bool:
        """A retry's attempt counted, once it runs alone; False: not to run (out of tries, or
        final meanwhile)."""
        return self.rows.db(self.rows.store.count_retry)(job_id)

    def note_given_back(self, job_id: str) -> None:
        """Tell the broker that this claimed job's message goes back to the queue with the
        database away: the row stays `running` under this live worker, which the next claim
        would take for a worker that died mid-run. Without the note (no broker, or it failed)
        the job still runs again, alone and charged an attempt, as before."""
        if self.broker is not None:
            broker = self.broker
            self._ask_broker(job_id, "note its message given back",
                             lambda: broker.gave_back(job_id, self.worker_name), None)

    def _claim(self, request: JobRequest, source: str, take_running: bool) -> Claim:
        return self.rows.db(self.rows.store.claim)(
            request.job_id,
            request.task,
            source,
            self.worker_name,
            max_attempts=self.max_attempts,
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
        assert self.broker is not None
        broker = self.broker
        return self._ask_broker(
            job_id, f"ask the broker whether {worker} holds it (running it)",
            lambda: broker.holds(worker, job_id) is True, False,
        )

    def _given_back(self, job_id: str) -> str | None:
        if self.broker is None:
            return None
        broker = self.broker
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
