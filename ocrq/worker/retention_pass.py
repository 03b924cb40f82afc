"""The workers' daily retention pass (OCRQ_RETENTION_DAYS), in one daemon thread per process.

Once a day for the fleet, not once a day per process: a worker process is replaced at every
recycle (after OCRQ_MAX_IMAGES, minutes apart on a busy GPU), so "first at start-up" alone
made every process of every worker prune again. The fleet's day is a key in the broker's Redis
(one per database: a fleet is the workers that share one). The process that sets it (`SET NX`)
takes the pass, holding the key for two hours at first and for a day once the pass is done; a
pass that failed gives the key back, and one cut short by its process's end lets it expire, so
either is tried again within hours rather than a day later. Every process asks hourly, so the
pass runs within an hour of falling due whichever processes are alive then. The advisory lock
in ocrq/core/retention.py still keeps two passes from overlapping (an `ocrq prune` on demand
does not ask the key). Where the broker is not Redis, or Redis does not answer, a process keeps
its own day: a pass at start-up, then one a day (after a failed one, one an hour).

Retention is housekeeping, never a reason to stop a worker: a failed pass is logged.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from ocrq.core.broker_redis import broker_client, is_redis
from ocrq.core.retention import prune_once_locked, queued_in_broker
from ocrq.core.settings import Settings

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

DAY_S = 86_400.0
ASK_S = 3_600.0  # how often a process asks whether the fleet's pass is due
CLAIM_S = 2 * ASK_S  # how long a pass holds the day before it is done (then DAY_S)
REDIS_TIMEOUT_S = 2.0
POSTGRES_PORT = 5432


def day_key(database_url: str) -> str:
    """The broker key that holds the fleet's last pass: one per database (host, port, name;
    hashed, so that the key does not spell out where the database is)."""
    url = make_url(database_url)
    where = f"{url.host}:{url.port or POSTGRES_PORT}/{url.database}"  # however it is spelt
    return "ocrq:retention:" + hashlib.sha256(where.encode()).hexdigest()[:16]


class RetentionPass:
    def __init__(self, db: Engine, settings: Settings) -> None:
        assert settings.retention_days is not None
        self.db = db
        self.days = settings.retention_days
        self.upload_dir = settings.upload_dir
        self.still_queued = queued_in_broker(settings)
        self.key = day_key(settings.database_url)
        self._redis: redis.Redis | None = (
            broker_client(
                settings, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
            )
            if is_redis(settings.broker_url)
            else None
        )
        self._own_last: float | None = None  # monotonic time of this process's last pass
        self._claimed = False  # this process set the fleet's key for the pass it runs
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ocrq-retention", daemon=True)

    def start(self) -> RetentionPass:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=10)
        if self._redis is not None:
            self._redis.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._due():
                self._own_last = time.monotonic()
                done = self._pass()
                if not done:
                    self._own_last = None  # without Redis: the next hourly look tries again
                self._settle(done)
            self._stop.wait(ASK_S)

    def _due(self) -> bool:
        """Whether this process takes the pass now: the fleet's day is over and this process
        set the key first; without Redis, this process's own day."""
        own = self._own_last is None or time.monotonic() - self._own_last >= DAY_S
        if self._redis is None:
            return own
        import redis

        stamp = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        try:
            self._claimed = bool(self._redis.set(self.key, stamp, nx=True, ex=int(CLAIM_S)))
            return self._claimed
        except redis.RedisError as exc:
            self._claimed = False
            log.warning("retention: cannot ask Redis whether the day's pass ran (%s)", exc)
            return own

    def _settle(self, done: bool) -> None:
        """The fleet's day after this process's pass: held for a day when it is done, given
        back when it failed (the next process to ask tries again)."""
        if self._redis is None or not self._claimed:
            return
        import redis

        self._claimed = False
        try:
            if done:
                self._redis.set(self.key, dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                xx=True, ex=int(DAY_S))
            else:
                self._redis.delete(self.key)
        except redis.RedisError as exc:  # the claim then expires by itself
            log.warning("retention: cannot record the day's pass in Redis (%s)", exc)

    def _pass(self) -> bool:
        """One pass; whether it is done (or another process's, holding the lock, is on it)."""
        cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(days=self.days)
        try:
            pruned = prune_once_locked(self.db, cutoff, self.upload_dir, self.still_queued)
        except Exception:
            log.exception("retention pass failed; tried again within the next hours")
            return False
        if pruned is None:
            log.info("retention: another worker holds the lock; skipped")
            return True
        log.info(
            "retention (older than %g days): deleted %d jobs, %d documents, "
            "%d uploads, %d unsent batch webhooks",
            self.days,
            pruned.jobs,
            pruned.documents,
            pruned.uploads,
            pruned.batch_hooks,
        )
        if pruned.uploads_left:
            log.warning("retention: %s", pruned.uploads_left)
        return True
