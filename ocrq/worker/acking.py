"""The last stage of a job: from the task returning to its message acked (`stage="ack"`).

Why a Request class: Celery acks a late-acked message in `Request.acknowledge`, after the task
function returned and outside it, and sends no signal then. The task marks when it returned;
this subclass observes the time once the ack went through.
"""

from __future__ import annotations

import time

from celery.worker.request import Request

from ocrq.core import metrics
from ocrq.core.process import STATE


def task_returned(task_id: str | None) -> None:
    if task_id is not None:
        with STATE.returned_lock:  # process-wide state: ocrq/core/process.py
            STATE.returned[task_id] = time.perf_counter()


class TimedRequest(Request):  # type: ignore[misc]
    def acknowledge(self) -> None:
        first = not self.acknowledged
        super().acknowledge()
        with STATE.returned_lock:
            returned = STATE.returned.pop(self.id, None)
        if first and returned is not None:
            metrics.observe_stage("ack", time.perf_counter() - returned)
