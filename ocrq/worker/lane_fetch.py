"""The order a worker fetches its queues in: interactive first, bulk never starved at the broker.

kombu's Redis transport fetches with one BRPOP over the consumed lists, which pops from the
first non-empty one in the order given. Interactive first (docs/internals.md) means the bulk
list is never popped while the interactive one holds a message: a stream of interactive jobs
that keeps a worker busy kept every bulk job in Redis until the stream ended (10 bulk jobs,
then 400 interactive: the first bulk job started after 88.7 s, after the last interactive one),
so the worker's own promotion after `OCRQ_BULK_MAX_WAIT_S` (ocrq/core/lanes.py) never
saw a bulk image to promote.

The rule here is the broker's half of that promotion, and costs no Redis command: when this
worker has taken no bulk message for `OCRQ_BULK_MAX_WAIT_S`, its fetches alternate, bulk lists
first then interactive first, until a fetch finds one lane empty (a bulk-first fetch that
returns an interactive message, or nothing; an interactive-first one that returns a bulk
message). So a worker kept busy by interactive jobs takes every other message from a waiting
bulk lane once that lane has waited the bound, and goes back to interactive first as soon as
either lane runs dry. Why not "bulk messages older than the bound first": a nightly bulk
backlog is older than any bound, and would then pass every interactive job; why not an age read
from Redis: kombu's messages carry no enqueue time, and peeking at message bodies on every fetch
costs what they weigh.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ocrq.core.contract import INTERACTIVE_SUFFIX

log = logging.getLogger(__name__)


def is_interactive(queue: str) -> bool:
    return queue.endswith(INTERACTIVE_SUFFIX)


class LaneOrder:
    """A kombu queue cycle (`consume(n)`, `rotate(used)`, `update(queues)`, as
    kombu.utils.scheduling's) that orders the consumed queues by the rule above.

    `fetched(queue)` is told what each fetch returned (None: nothing within the poll)."""

    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.items: list[str] = []
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last_bulk = clock()  # the last bulk message taken, or the worker's start
        self._promoting = False
        self._bulk_first = False  # the order of the fetch in flight

    def update(self, queues: list[str]) -> None:
        self.items[:] = queues

    def consume(self, n: int) -> list[str]:
        queues = self.items[:n]
        with self._lock:
            if not self._promoting and self._clock() - self._last_bulk >= self._max_wait_s:
                self._promoting = True
                log.info(
                    "bulk lane not served for %.0f s (OCRQ_BULK_MAX_WAIT_S): fetching it "
                    "every other time until a lane is empty",
                    self._max_wait_s,
                )
            # While promoting: bulk first on every other fetch, starting with the first.
            self._bulk_first = self._promoting and not self._bulk_first
            bulk_first = self._bulk_first
        if not bulk_first:
            return queues
        return [q for q in queues if not is_interactive(q)] + [
            q for q in queues if is_interactive(q)
        ]

    def rotate(self, last_used: str) -> None:
        """kombu's call after a delivery from `last_used` (a queue name)."""
        self.fetched(last_used)

    def fetched(self, queue: str | None) -> None:
        with self._lock:
            if queue is None:  # nothing in any list within the poll: nothing starves
                self._last_bulk = self._clock()
                self._promoting = False
            elif not is_interactive(queue):
                self._last_bulk = self._clock()
                if not self._bulk_first:  # interactive first gave bulk: no interactive waits
                    self._promoting = False
            elif self._bulk_first:  # bulk first gave interactive: the bulk lists are empty
                self._last_bulk = self._clock()
                self._promoting = False
            if not self._promoting:
                self._bulk_first = False
