"""How a worker learns that a job it is running was cancelled, and tells its batcher.

A cancel is a row turned `cancelled` (DELETE /jobs/{id}, DELETE /batches/{id}, `ocrq cancel`),
written by the api or the CLI, which know nothing of the workers. So each worker process asks
the job table, at most once every `POLL_S` and only while it has jobs in flight, which of its
in-flight jobs are cancelled (one primary-key lookup of at most its task threads' jobs), and
hands those to its batcher, which drops them: a waiting image at once, a row in the running
loop at the loop's next harvest (ocrq/scheduling/streaming.py). Why polling and not a message:
the row is the record anyway, a missed Redis message would leave a row decoding to its cap, and
the bound on the rate is the bound on the cost. A job cancelled between two polls runs on for at
most `POLL_S`; its result is never stored over `cancelled` (JobStore.finish) either way.

The job runner (ocrq/worker/jobs.py) holds one beside its stages and starts it at its first job;
it asks the runner's in-flight jobs (ocrq/worker/claiming.py `InFlight.ids`), nothing else.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ocrq.core.store import JobStore
from ocrq.scheduling.vocabulary import Batcher

log = logging.getLogger(__name__)

POLL_S = 1.0


class CancelWatch:
    def __init__(
        self,
        store: JobStore,
        batcher: Batcher,
        in_flight: Callable[[], list[str]],
        poll_s: float = POLL_S,
    ) -> None:
        self.store = store
        self.batcher = batcher
        self.in_flight = in_flight
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ocrq-cancels", daemon=True)
        self._started = False
        self._lock = threading.Lock()

    def start(self) -> CancelWatch:
        """Its thread started, once: later calls (every job's) do nothing."""
        if not self._started:
            with self._lock:
                if not self._started:
                    self._thread.start()
                    self._started = True
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> list[str]:
        """One look: the in-flight jobs found cancelled, handed to the batcher."""
        ids = self.in_flight()
        if not ids:
            return []
        found = self.store.cancelled_among(ids)
        if found:
            log.info("job(s) cancelled while in flight, dropping: %s", ", ".join(found))
            self.batcher.cancel(set(found))
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # the database away: the next look tries again
                log.warning("could not look for cancelled jobs", exc_info=True)
