"""The Celery task: thin on purpose. Validation, batching and storage live elsewhere."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task
from pydantic import ValidationError

from ocrq.core.contract import TASK_NAME, JobRequest, storable_text
from ocrq.worker.acking import task_returned
from ocrq.worker.runtime import get_runtime


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
    self: Task, image: Any = None, task: str = "text", job_id: str | None = None, **_: Any
) -> dict[str, Any]:
    try:
        return _recognize(image, task, job_id)
    finally:
        task_returned(self.request.id)


def _recognize(image: Any, task: str, job_id: str | None) -> dict[str, Any]:
    try:
        kwargs = {"image": image, "task": task}
        if job_id is not None:
            kwargs["job_id"] = job_id
        request = JobRequest.model_validate(kwargs)
    except ValidationError as exc:
        message = storable_text(
            "invalid job request: "
            + "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
                for err in exc.errors()
            ),
            limit=2000,
        )
        # With a usable job id the failure gets its row (source and task made storable: they
        # may hold the very NUL or surrogate refused); without one, the log line and Flower.
        get_runtime().runner.reject(
            job_id, _refused_source(image), storable_text(task, limit=4000), message
        )
        raise JobFailed(message) from None
    outcome = get_runtime().runner.process(request)
    # Flower shows the result (or the exception): the batch and the wait for it are there, since
    # Celery's runtime of the task includes that wait.
    batch = (
        {"batch_id": outcome.batch_id, "batch_wait_s": outcome.batch_wait_s}
        if outcome.batch_id
        else {}
    )
    if outcome.status == "failed":
        raise JobFailed(
            outcome.error
            if not batch
            else f"{outcome.error} (batch {outcome.batch_id}, waited {outcome.batch_wait_s} s)"
        )
    return {
        "job_id": outcome.job_id,
        "status": outcome.status,
        "chars": len(outcome.text or ""),
        "lines": len(outcome.lines or []),
        **batch,
    }


def _refused_source(image: Any) -> str:
    """What a refused request's row names as its source: never inline bytes."""
    if isinstance(image, dict) and isinstance(image.get("b64"), str) and len(image) == 1:
        return f"b64:{len(image['b64'])} chars"
    if isinstance(image, dict) and len(image) == 1:
        (value,) = image.values()
        return storable_text(value)
    return storable_text(image)
