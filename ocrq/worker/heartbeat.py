"""A worker process's heartbeat, and its share of the stalled-job sweep, in one daemon thread.

The thread beats every OCRQ_HEARTBEAT_S (one upsert of this process's ocr_workers row) and,
every OCRQ_STALLED_SWEEP_S, runs the recovery sweep (ocrq/core/requeue.py): the jobs of workers
that stopped beating, and queued jobs whose message was lost, are sent again. It
sweeps only after its own beats have succeeded for `SETTLE_BEATS` heartbeats in a row (or
OCRQ_STALLED_AFTER_S where that is shorter): after a database outage every heartbeat is stale,
and a worker that swept at once would take live workers for dead ones; a live worker beats
again within one heartbeat of the database's return, and the settings hold OCRQ_STALLED_AFTER_S
to at least three. Why not OCRQ_STALLED_AFTER_S as before: a worker restarted after its
predecessor died (the usual way a lost message is found) then waited 60 s before its first
sweep, and the job whose message was lost ran 68 s after the worker came back; now ~30 s.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from sqlalchemy import Engine

from ocrq.core import metrics, workers_table
from ocrq.core.requeue import Recovered
from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

SETTLE_BEATS = 3  # own beats in a row before the first sweep (see above)


def unique_worker_name(engine_name: str, node: str | None = None) -> str:
    """This process's name in ocr_jobs.worker and ocr_workers: a restarted process (same host,
    maybe the same pid in a fresh container) must never be taken for the one that died.

    A Celery worker's name starts with its node name (`ocrq-rapid-7-gpu0@host`, what Flower
    and `celery inspect` show), so a row says which worker, host and GPU ran it; other
    processes name their engine and host."""
    where = node or f"{engine_name}@{socket.gethostname()}"
    return f"{where}/{os.getpid()}-{secrets.token_hex(3)}"


class Heartbeat:
    def __init__(
        self,
        db: Engine,
        name: str,
        settings: Settings,
        sweep: Callable[[], Recovered] | None = None,
    ) -> None:
        self.db = db
        self.name = name
        self.interval_s = settings.heartbeat_s
        self.stalled_after_s = settings.stalled_after_s
        self.sweep_s = settings.stalled_sweep_s
        self.settle_s = min(settings.stalled_after_s, SETTLE_BEATS * settings.heartbeat_s)
        self._sweep = sweep
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ocrq-heartbeat", daemon=True)
        self._healthy_since: float | None = None
        self._next_sweep = 0.0

    def start(self) -> Heartbeat:
        """Register now, then beat in the thread (which keeps trying if the database is down:
        a worker that never registered is only recovered by the visibility timeout)."""
        metrics.HEARTBEAT_AT.set(time.time())
        try:
            workers_table.beat(self.db, self.name)
            self._healthy_since = time.monotonic()
            self._next_sweep = self._healthy_since + self.settle_s
        except Exception as exc:
            log.warning("heartbeat: cannot register %s yet: %s", self.name, exc)
        self._thread.start()
        log.info(
            "heartbeat: worker %s beats every %.0f s; jobs of workers silent for %.0f s are "
            "re-sent",
            self.name,
            self.interval_s,
            self.stalled_after_s,
        )
        return self

    def stop(self) -> None:
        """A clean exit: stop beating and retire the row (see workers_table.retire)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 10)
        try:
            workers_table.retire(self.db, self.name)
        except Exception as exc:  # the row then just goes stale; sweeps clean it up
            log.warning("heartbeat: could not retire %s: %s", self.name, exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            metrics.HEARTBEAT_AT.set(time.time())  # liveness: this process's threads run
            try:
                workers_table.beat(self.db, self.name)
            except Exception as exc:
                if self._healthy_since is not None:
                    log.warning("heartbeat: cannot reach the database (%s); retrying", exc)
                self._healthy_since = None
                continue
            t = time.monotonic()
            if self._healthy_since is None:
                log.info("heartbeat: database reachable again")
                self._healthy_since = t
                self._next_sweep = t + self.settle_s
            if self._sweep is not None and t >= self._next_sweep:
                self._next_sweep = t + self.sweep_s
                self._run_sweep()

    def _run_sweep(self) -> None:
        try:
            found = self._sweep() if self._sweep is not None else Recovered()
        except Exception as exc:  # the broker or database went away: try at the next sweep
            log.warning("stalled-job sweep failed: %s: %s", type(exc).__name__, exc)
            return
        final = set(found.final)  # messages of finished jobs: put back, but not re-sent work
        for done, ids, what in (
            ("re-sent", found.stalled, "running job(s) of dead workers"),
            (
                "re-sent",
                [j for j in found.orphaned if j not in final],
                "job(s) dead workers had taken but not started",
            ),
            ("put back", found.final, "message(s) of jobs already final that dead workers held"),
            ("re-sent", found.lost, "queued job(s) whose message was nowhere in the broker"),
        ):
            if ids:
                log.warning(
                    "stalled-job sweep: %s %d %s: %s",
                    done,
                    len(ids),
                    what,
                    " ".join(ids[:20]) + (" ..." if len(ids) > 20 else ""),
                )
        if found.failed is not None:  # what it did before failing is said above
            exc = found.failed
            log.warning("stalled-job sweep failed part-way: %s: %s", type(exc).__name__, exc)
