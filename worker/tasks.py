"""The Celery task: thin on purpose. Validation, batching and storage live elsewhere."""

from __future__ import annotations

from typing import Any

from celery import Task
from pydantic import ValidationError

from ocrq.contract import TASK_NAME, JobRequest
from worker.celery_app import app
from worker.runtime import get_runtime


class JobFailed(Exception):
    """Raised after the failed row is committed, so Flower shows the task as failed."""


@app.task(
    name=TASK_NAME,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
)
def recognize(
    self: Task, image: Any = None, task: str = "text", job_id: str | None = None, **_: Any
) -> dict[str, Any]:
    try:
        kwargs = {"image": image, "task": task}
        if job_id is not None:
            kwargs["job_id"] = job_id
        request = JobRequest.model_validate(kwargs)
    except ValidationError as exc:
        message = "invalid job request: " + "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'request'}: {err['msg']}"
            for err in exc.errors()
        )
        # With a usable job id the failure gets its row; without one, Flower alone shows it.
        get_runtime().runner.reject(job_id, str(image)[:200], task, message)
        raise JobFailed(message) from None
    outcome = get_runtime().runner.process(request)
    if outcome.status == "failed":
        raise JobFailed(outcome.error)
    return {
        "job_id": outcome.job_id,
        "status": outcome.status,
        "chars": len(outcome.text or ""),
        "lines": len(outcome.lines or []),
    }
