"""Batch and document webhooks: sent when the batch or the document ends, never in a task's way.

A document's webhook is its own job's `callback_url`: the job that splits it is not what the
producer waits for, so instead of that job's outcome, the document's is sent (`document.
finished`) once its last page is final and it is assembled. A batch's webhook (ocrq/core/
batch_hooks.py) is sent once every unit of the batch is final (`batch.finished`, with its
counts, as GET /batches/{id} has them).

Who sends a batch's: a worker that ends one of its jobs notes the batch (one Redis HEXISTS per
job of a batch) when it has a webhook waiting; a thread of that worker looks at each noted batch
at most once every `POLL_S` (one grouped query, ocrq/core/batches.py), and when it is final takes
the webhook (one taker among all workers) and hands it to the job webhooks' sender, which signs,
retries with backoff and applies the URL-image address policy (ocrq/worker/webhooks.py).
So the task threads never wait on a summary or a POST, and a batch of N jobs costs N HEXISTS
and at most one summary a second per worker while it runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine

from ocrq.core import batch_hooks, batches
from ocrq.core.broker_redis import broker_client, is_redis
from ocrq.core.settings import Settings
from ocrq.worker.webhooks import Webhooks

log = logging.getLogger(__name__)

POLL_S = 1.0


class BatchHooks:
    def __init__(
        self, settings: Settings, engine: Engine, webhooks: Callable[[], Webhooks]
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.webhooks = webhooks
        self._redis = (
            broker_client(settings, socket_timeout=5) if is_redis(settings.broker_url) else None
        )
        self._noted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def job_ended(self, batch: str | None) -> None:
        """A job of `batch` ended in this worker (or was refused as final): look at the batch
        soon, if it has a webhook waiting."""
        if batch is None or self._redis is None:
            return
        try:
            if not batch_hooks.waiting(self._redis, batch):
                return
        except Exception:
            log.warning("could not look up batch %s's webhook", batch, exc_info=True)
            return
        with self._lock:
            self._noted.add(batch)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ocrq-batch-hooks", daemon=True
                )
                self._thread.start()

    def check(self) -> list[str]:
        """One look at the noted batches; those whose webhook this worker sent."""
        with self._lock:
            noted, self._noted = self._noted, set()
        sent = []
        for batch in noted:
            summary = batches.summary(self.engine, batch)
            if summary is None or not summary.final:
                continue  # a later job of it notes it again
            assert self._redis is not None
            url = batch_hooks.take(self._redis, batch)
            if url is None:
                continue  # another worker took it
            body: dict[str, Any] = summary.as_json()
            self.webhooks().send(url, body, event="batch.finished", key=f"batch {batch}")
            sent.append(batch)
        return sent

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.check()
            except Exception:  # the database or Redis away: the batch is noted again later
                log.warning("could not look at batches with webhooks", exc_info=True)
