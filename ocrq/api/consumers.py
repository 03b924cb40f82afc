"""Whether any live worker consumes the queue a waiting producer's jobs went to.

Why: the most common first-hour surprise is a `submit --wait` whose progress bar never moves,
because no worker runs or the worker consumes another queue (OCRQ_QUEUE set on one side only).
Jobs then wait in Redis, correctly and silently. Celery's own remote control answers the
question without anything new on the worker: every worker replies to `active_queues` over the
broker (its pidbox), as Flower asks it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

# How long a broadcast waits for replies: a worker answers from its consumer loop, which a
# busy task pool does not hold up; one that is still starting may miss it, and the warning
# says so rather than claiming there is no worker.
REPLY_S = 2.0


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
