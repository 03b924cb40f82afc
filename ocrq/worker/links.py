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

A link must also be a plain signature, sent where the operator said: Celery rebuilds a link
from its dict by `subtask_type`, not by its name, so `{"task": "myapp.done", "subtask_type":
"group", "kwargs": {"tasks": [...]}}` passed the name check and ran as a group of any tasks (a
tree of them: one message, 15 jobs; 50 `billing.refund_all` in another app's queue). And a
link's options are the worker's `apply_async` options: `queue`, `exchange` or `routing_key` put
the call in any queue of the broker, `link` nests more calls. So a link has the keys of a plain
signature, no `subtask_type`, options from a short list, and names its queue, one matching
OCRQ_LINK_QUEUES (without one Celery sends it to ocrq's own queue, where it is dropped).
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
# The keys of a plain signature's dict (Celery's `Signature`); `subtask_type` and `chord_size`
# only as null.
SIGNATURE_KEYS = frozenset(
    {"task", "args", "kwargs", "options", "subtask_type", "immutable", "chord_size"}
)
# The options a link may carry: when and how it runs, not where it goes or what it calls next.
# Not `exchange`, `routing_key`, `declare` (another destination), `link`, `link_error`,
# `chain`, `chord`, `group_id` (more calls), `headers` (a message's own fields), `shadow`.
LINK_OPTIONS = frozenset(
    {"queue", "countdown", "eta", "expires", "priority", "task_id", "ignore_result",
     "time_limit", "soft_time_limit"}
)  # fmt: skip
HELP = "(docs/producers.md, Callbacks)"


def _task_name(signature: Any) -> str | None:
    name = signature.get("task") if isinstance(signature, Mapping) else None
    return name if isinstance(name, str) else None


def _shape_refusal(signature: Mapping[str, Any], queues: Sequence[str]) -> str | None:
    """Why a link whose name is allowed is still not a plain signature sent to an allowed
    queue, or None."""
    name = str(signature.get("task"))[:80]
    extra = sorted(str(k)[:40] for k in signature if k not in SIGNATURE_KEYS)
    if extra:
        return f"link to {name!r} carries {', '.join(extra)}: a link is a plain signature"
    kind = signature.get("subtask_type")
    if kind is not None or signature.get("chord_size") is not None:
        return (
            f"link to {name!r} is a Celery {str(kind)[:20]}, not a plain signature: a link "
            f"calls one task {HELP}"
        )
    options = signature.get("options") or {}
    if (
        not isinstance(signature.get("args") or [], list | tuple)
        or not isinstance(signature.get("kwargs") or {}, Mapping)
        or not isinstance(options, Mapping)
    ):
        return f"link to {name!r} is not a signature (args, kwargs, options)"
    refused = sorted(str(k)[:40] for k in options if k not in LINK_OPTIONS)
    if refused:
        return (
            f"link to {name!r} carries the options {', '.join(refused)}: a link may not route "
            f"its call elsewhere or nest more calls {HELP}"
        )
    queue = options.get("queue")
    if not isinstance(queue, str) or not any(fnmatchcase(queue, q) for q in queues):
        shown = "no queue" if queue is None else f"the queue {str(queue)[:80]!r}"
        return (
            f"link to {name!r} names {shown}: OCRQ_LINK_QUEUES names the queues a link may be "
            f"sent to (signature(name, queue=...)) {HELP}"
        )
    return None


def link_refusal(
    embed: Mapping[str, Any], allowed: Sequence[str], queues: Sequence[str] = ()
) -> str | None:
    """Why a job's links must not be honoured, or None; `embed`: the message's callbacks,
    errbacks, chain and chord (Celery's protocol 2 embed, or the task request's fields);
    `allowed`, `queues`: OCRQ_LINK_TASKS and OCRQ_LINK_QUEUES."""
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
                f"link_error may call {HELP}"
            )
        refused = _shape_refusal(signature, queues)
        if refused is not None:
            return refused
    return None
