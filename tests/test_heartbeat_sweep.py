"""When a worker's first recovery sweep comes (ocrq/worker/heartbeat.py): after a few of its own
heartbeats, not after OCRQ_STALLED_AFTER_S. A worker restarted after its predecessor died is
what finds that one's lost message: waiting OCRQ_STALLED_AFTER_S (60 s) first, the job ran 68 s
after the worker came back."""

from __future__ import annotations

import threading
import time

from ocrq.core.db import get_engine
from ocrq.core.requeue import Recovered
from ocrq.core.settings import Settings
from ocrq.worker.heartbeat import SETTLE_BEATS, Heartbeat


def test_the_first_sweep_comes_after_three_beats_not_the_stall_bound(
    private_database: str,
) -> None:
    settings = Settings(
        database_url=private_database, heartbeat_s=0.3, stalled_after_s=20, stalled_sweep_s=30
    )
    swept = threading.Event()

    def sweep() -> Recovered:
        swept.set()
        return Recovered()

    started = time.monotonic()
    beat = Heartbeat(get_engine(private_database), "settle-test/1-abc", settings, sweep).start()
    try:
        assert swept.wait(10), "no sweep within 10 s (the stall bound is 20 s)"
        took = time.monotonic() - started
        assert took >= SETTLE_BEATS * settings.heartbeat_s - 0.05, took
    finally:
        beat.stop()
