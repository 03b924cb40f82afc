"""Batch and document webhooks: sent when the batch or the document ends, never in a task's way.

A document's webhook is its own job's `callback_url`: the job that splits it is not what the
producer waits for, so instead of that job's outcome, the document's is sent (`document.
finished`) once its last page is final and it is assembled. A batch's webhook (ocrq/core/
batch_hooks.py) is sent once every unit of the batch is final (`batch.finished`, with its
counts, as GET /batches/{id} has them).

Who sends a batch's: a worker that ends one of its jobs notes the batch's name (in memory: the
task thread asks nothing); a thread of that worker looks, at most once every `POLL_S`, which
noted batches have a webhook waiting (one query in `ocr_batch_hooks` for all of them), sums up
each of those (one grouped query, ocrq/core/batches.py), and when one is final takes its
webhook (one taker among all workers) and hands it to the job webhooks' sender, which signs,
retries with backoff and applies the URL-image address policy (ocrq/worker/webhooks.py). So
the task threads never wait on the database, a summary or a POST for a batch. Every
`SWEEP_S` the thread also notes the webhooks registered longer ago than that, `SWEEP_LIMIT` at a
time, each sweep going on from the last (the next at once while pages are full): a batch whose
last job ended in a worker that died (or was recycled) before it looked fires from another
worker's sweep instead of never, however many registrations that never fire are older.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from ocrq.core import batch_hooks, batches
from ocrq.core.broker_redis import broker_client, is_redis
from ocrq.core.settings import Settings
from ocrq.worker.webhooks import Webhooks

log = logging.getLogger(__name__)

POLL_S = 1.0
SWEEP_S = 60.0  # how often a worker re-checks webhooks older than this
SWEEP_LIMIT = 100  # registrations a sweep looks at; the next goes on from the last


class BatchHooks:
    def __init__(
        self, settings: Settings, engine: Engine, webhooks: Callable[[], Webhooks]
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.webhooks = webhooks
        self._noted: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Where the next sweep goes on from (None: the oldest), and whether the last one read a
        # full page (then the next comes at the next poll, not a minute later).
        self._cursor: tuple[dt.datetime, str] | None = None
        self._more = False

    def start(self) -> BatchHooks:
        """The thread that looks at noted batches and sweeps old webhooks, after moving an older
        ocrq's registrations out of the broker's Redis (core/batch_hooks.adopt_legacy)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="ocrq-batch-hooks", daemon=True
                )
                self._thread.start()
        return self

    def job_ended(self, batch: str | None) -> None:
        """A job of `batch` ended in this worker (or was refused as final): look at the batch
        soon (the thread asks whether it has a webhook waiting)."""
        if batch is None:
            return
        with self._lock:
            self._noted.add(batch)
        self.start()

    def check(self) -> list[str]:
        """One look at the noted batches that have a webhook waiting; those whose webhook this
        worker sent."""
        with self._lock:
            noted, self._noted = self._noted, set()
        sent = []
        for batch in batch_hooks.waiting(self.engine, noted):
            summary = batches.summary(self.engine, batch)
            if summary is None or not summary.final:
                continue  # a later job of it notes it again
            url = batch_hooks.take(self.engine, batch)
            if url is None:
                continue  # another worker took it
            body: dict[str, Any] = summary.as_json()
            self.webhooks().send(url, body, event="batch.finished", key=f"batch {batch}")
            sent.append(batch)
        return sent

    def close(self) -> None:
        self._stop.set()

    def sweep(self, older_than_s: float = SWEEP_S) -> None:
        """Note the next `SWEEP_LIMIT` webhooks registered more than `older_than_s` ago (the
        next `check` looks), going on from where the last sweep stopped and starting again
        from the oldest after the last page."""
        page = batch_hooks.pending_page(self.engine, older_than_s, SWEEP_LIMIT, self._cursor)
        self._more = len(page) == SWEEP_LIMIT
        self._cursor = page[-1] if self._more else None
        with self._lock:
            self._noted.update(batch for _, batch in page)

    def _adopt_legacy(self) -> None:
        if not is_redis(self.settings.broker_url):
            return
        try:
            moved = batch_hooks.adopt_legacy(
                broker_client(self.settings, socket_timeout=5), self.engine
            )
        except (RedisError, OSError, SQLAlchemyError) as exc:
            # Redis or the database away: the next worker start tries again. One line: the
            # broker's own wait is said elsewhere (ocrq/worker/broker.py), with its URL.
            log.warning("could not move batch webhooks out of Redis (tried again at the next "
                        "start): %s: %s", type(exc).__name__, exc)
            return
        except Exception:  # anything else is a bug: its traceback
            log.warning("could not move batch webhooks out of Redis", exc_info=True)
            return
        if moved:
            log.info("moved %d batch webhook(s) from the broker's Redis to the database", moved)

    def _run(self) -> None:
        """A sweep at once (a worker that starts fires what ended while none looked), then one
        every SWEEP_S; the noted batches every POLL_S."""
        self._adopt_legacy()
        swept = -SWEEP_S
        while True:
            try:
                if self._more or time.monotonic() - swept >= SWEEP_S:
                    swept = time.monotonic()
                    self.sweep()
                self.check()
            except Exception:  # the database away: the batch is noted again later
                log.warning("could not look at batches with webhooks", exc_info=True)
            if self._stop.wait(POLL_S):
                return
