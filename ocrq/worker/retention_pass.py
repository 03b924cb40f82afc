"""The worker's daily retention pass (OCRQ_RETENTION_DAYS), in one daemon thread.

Every worker process runs the thread; the advisory lock in ocrq/core/retention.py lets one of
them prune at a time and the others skip. The first pass runs at start-up (a fleet restarted
daily still prunes), then one a day. A failed pass (the database down) is logged and tried
again at the next one: retention is housekeeping, never a reason to stop a worker.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading

from sqlalchemy import Engine

from ocrq.core.retention import prune_once_locked
from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

DAY_S = 86_400.0


class RetentionPass:
    def __init__(self, db: Engine, settings: Settings) -> None:
        assert settings.retention_days is not None
        self.db = db
        self.days = settings.retention_days
        self.upload_dir = settings.upload_dir
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ocrq-retention", daemon=True)

    def start(self) -> RetentionPass:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(days=self.days)
            try:
                pruned = prune_once_locked(self.db, cutoff, self.upload_dir)
            except Exception:
                log.exception("retention pass failed; next try in a day")
            else:
                if pruned is None:
                    log.info("retention: another worker holds the lock; skipped")
                else:
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
            self._stop.wait(DAY_S)
