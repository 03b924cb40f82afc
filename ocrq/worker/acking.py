"""The last stage of a job: from the task returning to its message acked (`stage="ack"`).

Why a Request class: Celery acks a late-acked message in `Request.acknowledge`, after the task
function returned and outside it, and sends no signal then. The task marks when it returned;
this subclass observes the time once the ack went through.
"""

from __future__ import annotations

import threading
import time

from celery.worker.request import Request

from ocrq.core import metrics

_returned: dict[str, float] = {}
_lock = threading.Lock()


def task_returned(task_id: str | None) -> None:
    if task_id is not None:
        with _lock:
            _returned[task_id] = time.perf_counter()


class TimedRequest(Request):  # type: ignore[misc]
    def acknowledge(self) -> None:
        first = not self.acknowledged
        super().acknowledge()
        with _lock:
            returned = _returned.pop(self.id, None)
        if first and returned is not None:
            metrics.observe_stage("ack", time.perf_counter() - returned)
