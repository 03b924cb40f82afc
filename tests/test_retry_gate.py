"""The gate that makes a retry run alone in its worker process (ocrq/worker/alone.py)."""

from __future__ import annotations

import threading
import time

from ocrq.worker.alone import RetryGate


def test_a_retry_waits_for_first_runs_and_new_ones_wait_for_it() -> None:
    gate = RetryGate()
    events: list[str] = []
    first_in = threading.Event()
    release_first = threading.Event()

    def first_run() -> None:
        with gate.shared():
            events.append("first in")
            first_in.set()
            release_first.wait(10)
            events.append("first out")

    def retry() -> None:
        with gate.alone():
            events.append("retry in")
            time.sleep(0.2)
            events.append("retry out")

    def late_run() -> None:
        with gate.shared():
            events.append("late in")

    threads = [threading.Thread(target=first_run)]
    threads[0].start()
    assert first_in.wait(10)
    threads.append(threading.Thread(target=retry))
    threads[1].start()
    deadline = time.monotonic() + 10
    while gate._waiting != 1 and time.monotonic() < deadline:  # the retry waits for the first
        time.sleep(0.01)
    assert gate._waiting == 1
    threads.append(threading.Thread(target=late_run))
    threads[2].start()
    time.sleep(0.2)  # the late run waits behind the waiting retry
    assert events == ["first in"]
    release_first.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    assert events == ["first in", "first out", "retry in", "retry out", "late in"]
