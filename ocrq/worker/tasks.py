"""The Celery task: thin on purpose. Validation, batching and storage live elsewhere."""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

from celery import Task, shared_task
from celery.exceptions import Ignore, Reject
from celery.signals import task_revoked
from celery.utils.time import maybe_iso8601
from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError

from ocrq.core.contract import (
    TASK_NAME,
    ImageRef,
    JobRequest,
    canonical_job_id,
    lane_of_queue,
    message_job_id,
    storable_text,
)
from ocrq.intake.splitting import page_job_id
from ocrq.worker.acking import task_returned
from ocrq.worker.claiming import RunningElsewhere
from ocrq.worker.envelope import REFUSED_HEADER, safe_text
from ocrq.worker.job_rows import db_unavailable
from ocrq.worker.links import LINK_KEYS, NEVER, link_refusal
from ocrq.worker.runtime import get_runtime

log = logging.getLogger(__name__)


class JobFailed(Exception):
    """Raised after the failed row is committed, so Flower shows the task as failed."""


class RecognizeTask(Task):  # type: ignore[misc]
    Request = "ocrq.worker.acking:TimedRequest"  # times the ack (metrics stage "ack")


# A shared task: it binds to the app that `ocrq/worker/main.py` builds from the worker's Settings,
# so
# importing this module builds no Celery app of its own.
@shared_task(
    name=TASK_NAME,
    bind=True,
    base=RecognizeTask,
    acks_late=True,
    reject_on_worker_lost=True,
    # An expected outcome with its own row and log line: Celery logs it in one line at INFO
    # (no traceback) and Flower still shows the task as failed.
    throws=(JobFailed,),
)
def recognize(
    self: Task,
    image: Any = None,
    task: str = "text",
    job_id: str | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """One job; its result (stored in the result backend when there is one) is the job's
    result dict, so `AsyncResult(job_id).get()` returns what `GET /jobs/{id}` would.

    The message's kwargs are a JobRequest's (`JobRequest.message()`): image, task and job id
    are named here for the refusals that precede it; every other field is JobRequest's alone
    (an unknown one is ignored, so an older worker reads a newer producer's message)."""
    task_id = self.request.id
    # Set by the broker (ocrq/worker/broker.py) for a far ETA or links: the job fails with it.
    refusal = getattr(self.request, REFUSED_HEADER, None)
    if job_id is None:
        # The job id a producer learns is the task id send_task returned: without a job_id of
        # its own the job takes that, instead of a fresh id nobody knows.
        job_id = task_id
    if fields.get("priority") is None:  # a producer that only chose the queue: its lane
        fields["priority"] = lane_of_queue((self.request.delivery_info or {}).get("routing_key"))
    try:
        _check_links(self, image, task, job_id, task_id)
        result, split_failures = _recognize(image, task, job_id, task_id, fields, refusal)
        _store_split_failures(self, split_failures)
    except JobFailed as exc:
        _also_under_job_id(self, job_id, task_id, exc, "FAILURE")
        raise
    except RunningElsewhere:
        # A second copy of a job another worker runs: acked, no result stored (that worker
        # stores the job's), Flower shows it IGNORED.
        raise Ignore() from None
    except DBAPIError as exc:
        if not db_unavailable(exc):
            raise
        # Away for all of OCRQ_DB_RETRY_S. Acked (a failed task's default), the message was
        # gone, and a row this worker had claimed stayed `running` under a live worker, which
        # no sweep re-sends: the job was lost. Put back instead, it runs on a later delivery
        # (a claimed row's as a retry, alone: docs/faults.md); nothing is stored meanwhile.
        log.warning(
            "job %s: the database stayed unreachable for OCRQ_DB_RETRY_S; its message goes "
            "back to the queue",
            safe_text(str(job_id), 80),
        )
        raise Reject(exc, requeue=True) from exc
    else:
        _also_under_job_id(self, job_id, task_id, result, "SUCCESS")
        return result
    finally:
        task_returned(task_id)


def _also_under_job_id(self: Task, job_id: Any, task_id: Any, result: Any, state: str) -> None:
    """A producer that sent a job_id but no matching task_id (the old README's example) finds
    the result under its job id too: the result is stored under both."""
    if self.request.ignore_result or getattr(self.app.conf, "task_ignore_result", True):
        return
    try:
        same = canonical_job_id(job_id) == canonical_job_id(task_id)
    except ValueError:
        return  # a malformed job_id: its failure is under the task id (and its row too)
    if not same:
        self.backend.store_result(canonical_job_id(job_id), result, state, request=self.request)


def _store_split_failures(self: Task, failures: tuple[tuple[str, str], ...]) -> None:
    """A page that failed while its document was split (an inline or URL document's page that
    cannot be rendered) has no task, so no result would ever come under its id, which the
    document's result lists in `page_jobs`: `AsyncResult(id).get()` waited out its timeout.
    Its FAILURE is stored here, as its own task would have stored it."""
    if not failures or self.request.ignore_result or getattr(
        self.app.conf, "task_ignore_result", True
    ):
        return
    for page_id, error in failures:
        self.backend.store_result(page_id, JobFailed(error), "FAILURE")


def _recognize(
    image: Any,
    task: str,
    job_id: Any,
    task_id: Any,
    fields: dict[str, Any],
    refusal: str | None = None,
) -> tuple[dict[str, Any], tuple[tuple[str, str], ...]]:
    """The job's result, and the (id, error) of pages that failed while its document was
    split (`_store_split_failures`)."""
    try:
        given = {k: v for k, v in fields.items() if v is not None}  # None: the default
        request = JobRequest.model_validate(
            {**given, "image": image, "task": task, "job_id": job_id}
        )
    except ValidationError as exc:
        message = storable_text(
            "invalid job request: "
            + "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
                for err in exc.errors()
            ),
            limit=2000,
        )
        # The failure gets its row (source and task made storable: they may hold the very NUL
        # or surrogate refused), under the job id, or under the task id when the job id is
        # itself what is malformed: the producer still holds that one (send_task returned it).
        get_runtime().runner.reject(
            job_id, _refused_source(image), storable_text(task, limit=4000), message, task_id
        )
        raise JobFailed(message) from None
    if refusal is not None:
        source = request.image.unnamed().describe()
        get_runtime().runner.reject(request.job_id, source, request.task, refusal, task_id)
        raise JobFailed(refusal)
    if _usable_id(task_id) and canonical_job_id(task_id) != request.job_id:
        log.warning(
            "job %s came in a task with another id (%s): send task_id=job_id so that "
            "AsyncResult(job_id) and Flower name the job",
            request.job_id,
            safe_text(str(task_id), 80),
        )
    outcome = get_runtime().runner.process(request)
    # Flower shows the result (or the exception): the batch and the wait for it are there, since
    # Celery's runtime of the task includes that wait. A redelivery of a finished job names the
    # batch that ran it, with no wait (it waited for none).
    batch = (
        {"batch_id": outcome.batch_id, "batch_wait_s": outcome.batch_wait_s}
        if outcome.batch_id
        else {}
    )
    if outcome.status in ("failed", "cancelled", "expired"):  # link_error is called
        waited = "" if outcome.batch_wait_s is None else f", waited {outcome.batch_wait_s} s"
        raise JobFailed(
            outcome.error if not batch else f"{outcome.error} (batch {outcome.batch_id}{waited})"
        )
    view = outcome.as_json()
    # The batch right after the job's id, path and status: Flower shows the result's repr cut
    # at 1024 characters (Celery's resultrepr_maxsize), and the text and lines come after.
    result = {**{k: view[k] for k in ("job_id", "path", "status")}, **batch, **view}
    if request.batch is not None:  # the producer's grouping, as its rows and the api say it
        result["batch"] = request.batch
    if outcome.pages is not None:  # a document's own job: the page jobs it made
        result["pages"] = outcome.pages
        # Their ids, in page order: a producer with Celery only has no other way to its pages'
        # results (`AsyncResult(id).get()` each) than computing the uuid5s itself.
        result["page_jobs"] = [page_job_id(outcome.job_id, n) for n in range(1, outcome.pages + 1)]
    return result, outcome.split_failures


def _check_links(self: Task, image: Any, task: Any, job_id: Any, task_id: Any) -> None:
    """A job whose links break the rule (ocrq/worker/links.py) fails without running, with
    its links dropped first: not one is called, its errbacks neither."""
    request = self.request
    embed = {k: getattr(request, k, None) for k in (*LINK_KEYS, *NEVER)}
    settings = get_runtime().settings
    reason = link_refusal(embed, settings.link_tasks, settings.link_queues)
    if reason is None:
        return
    for key in embed:
        setattr(request, key, None)
    get_runtime().runner.reject(
        job_id, _refused_source(image), storable_text(str(task), limit=4000), reason, task_id
    )
    raise JobFailed(reason)


@task_revoked.connect
def _expired(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery discards a message past its `expires` before the task runs (and acks it): the
    job's row says so, `expired`, instead of staying `queued` for ever."""
    if not expired or getattr(sender, "name", None) != TASK_NAME or request is None:
        return
    kwargs = request.kwargs if isinstance(request.kwargs, dict) else {}
    try:
        job_id = message_job_id(kwargs, request.id)
        image = kwargs.get("image")
        source = ImageRef.model_validate(image).describe() if image else "unknown"
    except (ValueError, ValidationError):
        return  # nothing a row could be written under; Celery logged the discard
    when = request.expires
    when = maybe_iso8601(when) if isinstance(when, str) else when
    if not isinstance(when, dt.datetime):
        when = dt.datetime.now(dt.UTC)
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    task = storable_text(str(kwargs.get("task", "text")), limit=4000)
    stored = get_runtime().runner.expire(job_id, task, storable_text(source), when)
    log.info("job %s expired before it ran (%s)", job_id, "row updated" if stored else "final")


def _usable_id(value: Any) -> bool:
    try:
        canonical_job_id(value)
    except ValueError:
        return False
    return True


def _refused_source(image: Any) -> str:
    """What a refused request's row names as its source: never inline bytes."""
    if isinstance(image, dict) and isinstance(image.get("b64"), str) and len(image) == 1:
        return f"b64:{len(image['b64'])} chars"
    if isinstance(image, dict) and len(image) == 1:
        (value,) = image.values()
        return storable_text(value)
    return storable_text(image)
