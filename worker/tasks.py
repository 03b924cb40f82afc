"""The Celery task: thin on purpose. Validation, batching and storage live elsewhere."""

from __future__ import annotations

from typing import Any

from celery import Task
from celery.utils.log import get_task_logger
from celery.worker.request import Request
from pydantic import ValidationError

from ocrq.contract import TASK_NAME, JobRequest
from worker.celery_app import app
from worker.runtime import get_runtime

logger = get_task_logger(__name__)


class BrokerLossTolerantRequest(Request):
    """Acks that survive the broker going away mid-task.

    When Redis restarts, kombu's channel drops its connection object, and an ack attempted then
    raises AttributeError instead of a connection error, which Celery treats as unrecoverable
    and the whole worker dies. Counted as a connection error, it is logged and the worker goes
    on reconnecting; the message stays in Redis's unacked set and comes back after the
    visibility timeout, where the job's done row makes the redelivery a no-op.
    """

    def acknowledge(self) -> None:
        if not self.acknowledged:
            self._on_ack(logger, (*self._connection_errors, AttributeError))
            self.acknowledged = True


class JobFailed(Exception):
    """Raised after the failed row is committed, so Flower shows the task as failed."""


@app.task(
    name=TASK_NAME,
    bind=True,
    acks_late=True,
    reject_on_worker_lost=True,
    Request=BrokerLossTolerantRequest,
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
