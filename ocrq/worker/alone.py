"""Retries run alone in their worker process, so that a death can be blamed on the right job.

A worker process that dies (kill -9, a crash in native code, the OOM killer) takes every job it
had in flight with it, and their next claims cannot tell the job that killed it from its
neighbours. The probe saw healthy images fail with "gave up after 3 attempts" because their
worker was killed three times for another reason. So a retry (a job whose earlier run never
finished) waits until nothing else runs in its process, runs alone, and only then is its attempt
counted (`JobStore.count_retry`); other jobs wait meanwhile. A retry that dies was alone: it is
the likely cause. A neighbour that died waiting here is not charged.

Writer-preferring: once a retry waits, new jobs wait behind it, or a busy worker would never
drain. Every holder is bounded by OCRQ_JOB_TIMEOUT_S, so no wait here is unbounded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class RetryGate:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0  # first runs in flight
        self._alone = False  # a retry runs
        self._waiting = 0  # retries waiting to run alone

    @contextmanager
    def shared(self) -> Iterator[None]:
        """A first run: alongside other first runs, never beside a retry."""
        with self._cond:
            self._cond.wait_for(lambda: not self._alone and not self._waiting)
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self) -> Iterator[None]:
        """A retry: once nothing else runs in this process, and with nothing beside it."""
        with self._cond:
            self._waiting += 1
            try:
                self._cond.wait_for(lambda: not self._alone and not self._shared)
            finally:
                self._waiting -= 1
            self._alone = True
        try:
            yield
        finally:
            with self._cond:
                self._alone = False
                self._cond.notify_all()
