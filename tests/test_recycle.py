"""The recycler's decision (ocrq/scheduling/recycle.py): pure, fed numbers and a clock; and
how the worker acts on it (ocrq/worker/exit_state.py)."""

from __future__ import annotations

import logging
import signal

import pytest

from ocrq.models.costs import GiB
from ocrq.scheduling.recycle import RECYCLE_EXIT_CODE, RecyclePolicy, Recycler
from ocrq.scheduling.vocabulary import BatchRecord


def record(size: int = 1) -> BatchRecord:
    return BatchRecord("b", size, 0.0, 0.0, 0, 0)


def test_memory_is_read_at_most_every_interval_and_patience_counts_readings() -> None:
    """Rounds of the running loop come every few decode steps. Reading the fragmentation there
    each time would sync the device each time, and a patience of 3 would be 3 rounds, a
    fraction of a second. Readings are spaced instead, and patience counts them."""
    now = [0.0]
    reads: list[float] = []
    fired: list[str] = []

    def fragmentation() -> int:
        reads.append(now[0])
        return 3 * GiB

    recycler = Recycler(
        RecyclePolicy(max_images=None, max_fragmentation_bytes=2 * GiB, patience=3),
        fired.append,
        fragmentation=fragmentation,
        check_every_s=5.0,
        clock=lambda: now[0],
    )
    for _ in range(100):  # 100 rounds in 1 s: one reading
        recycler.after_batch(record())
        now[0] += 0.01
    assert reads == [0.0] and not fired
    for t in (5.0, 10.0):
        now[0] = t
        recycler.after_batch(record())
    assert reads == [0.0, 5.0, 10.0]
    assert fired == ["fragmentation 3.00 GiB above 2.00 GiB for 3 readings"]


def test_a_reading_under_the_limit_resets_patience() -> None:
    now = [0.0]
    values = iter([3 * GiB, 3 * GiB, 1 * GiB, 3 * GiB, 3 * GiB, 3 * GiB])
    fired: list[str] = []
    recycler = Recycler(
        RecyclePolicy(max_images=None, max_rss_bytes=2 * GiB, patience=3),
        fired.append,
        rss=lambda: next(values),
        clock=lambda: now[0],
    )
    for i in range(6):
        now[0] = 5.0 * i
        recycler.after_batch(record())
        assert bool(fired) == (i == 5), (i, fired)


def test_a_planned_recycle_is_one_info_line_and_a_stop_under_way_is_not_a_recycle(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The recycle is said once, at INFO (it was said twice at WARNING: the recycler's line
    and the exit request's). A recycle falling due while a stop drains (the batch that reaches
    --max-images finishing after SIGTERM) exits as the stop, not as `recycle` with code 75."""
    from ocrq.core.process import STATE
    from ocrq.worker import exit_state

    killed: list[int] = []
    monkeypatch.setattr(exit_state.os, "kill", lambda _pid, sig: killed.append(sig))
    monkeypatch.setattr(STATE, "exit_code", None)
    monkeypatch.setattr(STATE, "stopping", None)
    recycler = Recycler(RecyclePolicy(max_images=2), exit_state.request_recycle)
    with caplog.at_level(logging.DEBUG):
        recycler.after_batch(record(3))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.INFO, "worker exit requested (75): recycle: processed 3 images "
                     "(max_images=2)")], said
    assert STATE.exit_code == RECYCLE_EXIT_CODE and killed == [signal.SIGTERM]

    caplog.clear()
    killed.clear()
    monkeypatch.setattr(STATE, "exit_code", None)
    monkeypatch.setattr(STATE, "stopping", "SIGTERM")
    with caplog.at_level(logging.DEBUG):
        Recycler(RecyclePolicy(max_images=2), exit_state.request_recycle).after_batch(record(3))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "stop (SIGTERM) is under way" in said[0], said
    assert "worker exit requested" not in said[0]
    assert STATE.exit_code is None and killed == []
