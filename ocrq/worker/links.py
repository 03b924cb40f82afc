"""Which Celery links (`link=`, `link_error=`) a job may carry: the rule, pure.

Celery calls a task's callbacks with its result and its errbacks with its failure, sent by the
worker over its own broker connection. That is how a Celery producer hears of a finished job
without polling, but anyone who can write to Redis can also put links in a message: a job that
links to `ocrq.recognize` re-enqueues jobs from inside the worker (a loop), and many links turn
one message into many. So a link is honoured only when its task name matches OCRQ_LINK_TASKS
(fnmatch patterns, the producer's own callback tasks), never an `ocrq.*` or `celery.*` task;
chains and chords (Celery's multi-step workflows) are never honoured. Anything else fails the
job without running it, saying why: silently dropping a link would leave its producer waiting
for a call that never comes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any

LINK_KEYS = ("callbacks", "errbacks")
NEVER = ("chain", "chord")
# Never a link target: ocrq's own tasks (a loop), and Celery's built-ins, which every worker
# registers and so would run inside this worker (an errback of a task the worker knows is
# called in-process, not sent).
NEVER_PREFIXES = ("ocrq.", "celery.")
# More than this many links on one job is fan-out, not a callback.
MAX_LINKS = 8


def _task_name(signature: Any) -> str | None:
    name = signature.get("task") if isinstance(signature, Mapping) else None
    return name if isinstance(name, str) else None


def link_refusal(embed: Mapping[str, Any], allowed: Sequence[str]) -> str | None:
    """Why a job's links must not be honoured, or None; `embed`: the message's callbacks,
    errbacks, chain and chord (Celery's protocol 2 embed, or the task request's fields)."""
    for key in NEVER:
        if embed.get(key):
            return f"the message carries a Celery {key}: an ocrq worker runs no workflows"
    links = [sig for key in LINK_KEYS for sig in (embed.get(key) or [])]
    if not links:
        return None
    if len(links) > MAX_LINKS:
        return f"the message carries {len(links)} links; at most {MAX_LINKS} are honoured"
    for signature in links:
        name = _task_name(signature)
        if (
            name is None
            or name.startswith(NEVER_PREFIXES)
            or not any(fnmatchcase(name, pattern) for pattern in allowed)
        ):
            shown = "a link without a task name" if name is None else f"link to {name[:80]!r}"
            return (
                f"{shown} is not allowed: OCRQ_LINK_TASKS names the tasks a job's link and "
                "link_error may call (docs/producers.md, Callbacks)"
            )
    return None
