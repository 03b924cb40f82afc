"""Whether any live worker consumes the queue a waiting producer's jobs went to.

Why: the most common first-hour surprise is a `submit --wait` whose progress bar never moves,
because no worker runs or the worker consumes another queue (OCRQ_QUEUE set on one side only).
Jobs then wait in Redis, correctly and silently. Celery's own remote control answers the
question without anything new on the worker: every worker replies to `active_queues` over the
broker (its pidbox), as Flower asks it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import Any

from ocrq.core.contract import redact_url

# How long a broadcast waits for replies: a worker answers from its consumer loop, which a
# busy task pool does not hold up; one that is still starting may miss it, and the warning
# says so rather than claiming there is no worker.
REPLY_S = 2.0
# Seconds into a wait with nothing finished before asking: past a worker's usual start, before
# a user gives up.
ASK_AFTER_S = 10.0
log = logging.getLogger(__name__)


class ConsumerCheck:
    """Called with the finished count each time a wait polls: once, after ASK_AFTER_S with none
    finished, the warning when no live worker consumes any of `queues` (else None)."""

    def __init__(self, app: Any, broker_url: str, queues: Collection[str]) -> None:
        self.app, self.broker, self.queues = app, redact_url(broker_url), list(queues)
        self.started = time.monotonic()
        self.asked = False

    def __call__(self, finished: int) -> str | None:
        if self.asked or finished or time.monotonic() - self.started < ASK_AFTER_S:
            return None
        self.asked = True
        try:
            consumers = queue_consumers(self.app)
        except Exception as exc:  # the wait goes on; this was only advice
            log.debug("asking the workers for their queues failed: %s", exc)
            return None
        return missing_consumer(consumers, self.queues, self.broker)


def queue_consumers(app: Any, reply_s: float = REPLY_S) -> dict[str, list[str]]:
    """Each worker that answered within `reply_s` and the queues it consumes."""
    replies = app.control.inspect(timeout=reply_s).active_queues() or {}
    return {worker: sorted(q["name"] for q in queues or ()) for worker, queues in replies.items()}


def missing_consumer(
    consumers: dict[str, list[str]], queues: Collection[str], broker: str
) -> str | None:
    """A one-paragraph warning when no answering worker consumes any of `queues`; None when
    one does."""
    if any(q in consumed for consumed in consumers.values() for q in queues):
        return None
    wanted = " or ".join(f"'{q}'" for q in sorted(queues))
    if not consumers:
        return (
            f"no worker answered on {broker} within {REPLY_S:.0f} s, so nothing consumes "
            f"queue {wanted} yet: start one with `ocrq worker` (same OCRQ_BROKER_URL), or "
            "check the log of one that is starting (it answers once ready); the jobs wait in "
            "Redis until one runs"
        )
    seen = "; ".join(f"{w}: {', '.join(qs)}" for w, qs in sorted(consumers.items()))
    return (
        f"no worker consumes queue {wanted} (workers answering: {seen}); set OCRQ_QUEUE to "
        "the same name for the worker and for this command; the jobs wait in Redis until then"
    )
