"""What a message read from Redis must look like before kombu or Celery are handed it.

Anyone who can write to Redis can LPUSH anything onto the queue's list. kombu and Celery assume
a well-formed envelope: a malformed one raises inside the consumer's event loop, which Celery
calls an "Unrecoverable error" (the worker process dies), and one that already sat in kombu's
unacked set is restored on shutdown and kills the next worker too. These checks are pure (no
broker, no Celery) so they can be tested alone; ocrq/worker/broker.py applies them to each message
as it leaves the list, where rejecting means simply not delivering it.

Two levels: every consumed queue gets the envelope checks kombu itself depends on; the task
queue also gets Celery's task protocol (2, or 1 for old producers), so that nothing reaches
Celery that it would either crash on or log as a multi-line traceback.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from celery.utils.time import maybe_iso8601
from kombu.utils.json import loads as kombu_loads

from ocrq.worker.links import link_refusal

JSON_CONTENT = "application/json"


@dataclass(frozen=True)
class Problem:
    """Why a message was refused, and the part of it worth showing in the log line."""

    reason: str
    sample: Any


def safe_text(value: str, limit: int = 160) -> str:
    """One printable ASCII line: control characters, non-ASCII and lone surrogates escaped."""
    cut = value[:limit]
    out = "".join(
        c if " " <= c <= "~" else c.encode("unicode_escape", "backslashreplace").decode("ascii")
        for c in cut
    )
    return out + ("..." if len(value) > limit else "")


def excerpt(sample: Any, limit: int = 120) -> str:
    """A short, log-safe rendering of (part of) a message."""
    if isinstance(sample, bytes):
        text = sample[: limit * 4].decode("utf-8", "backslashreplace")
    elif isinstance(sample, str):
        text = sample
    else:
        try:
            text = json.dumps(sample, ensure_ascii=False, default=repr)
        except (TypeError, ValueError, RecursionError):
            text = repr(type(sample))
    return safe_text(text, limit)


def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string"}.get(type(value), type(value).__name__)


def decoded_body(payload: dict[str, Any]) -> bytes | str | None:
    """The body as kombu will decode it; raises ValueError when it cannot be.

    Stricter than kombu (base64 must be canonical): kombu's own producer never writes anything
    else, and whatever passes here also decodes there.
    """
    body = payload.get("body")
    encoding = payload["properties"].get("body_encoding")
    if body is None or body == "":
        return body
    if not isinstance(body, str):
        raise ValueError(f"body is a JSON {_type_name(body)}, not a string")
    if not encoding or encoding.lower() == "utf-8":
        return body
    if encoding != "base64":
        raise ValueError(f"unknown body_encoding {safe_text(encoding, 40)!r}")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"body is not valid base64 ({exc})") from None


def envelope_problem(payload: Any) -> Problem | None:
    """The fields kombu's Redis transport reads from every message it delivers."""
    if not isinstance(payload, dict):
        return Problem(f"envelope is a JSON {_type_name(payload)}, not an object", payload)
    props = payload.get("properties")
    if not isinstance(props, dict):
        return Problem("envelope has no 'properties' object", payload)
    tag = props.get("delivery_tag")
    if not isinstance(tag, str) or not tag:
        return Problem("envelope has no delivery_tag", props)
    info = props.get("delivery_info")
    if not isinstance(info, dict) or not all(
        isinstance(info.get(k), str) for k in ("exchange", "routing_key")
    ):
        return Problem("envelope has no delivery_info with exchange and routing_key", props)
    if not isinstance(props.get("body_encoding"), str | None):
        return Problem("body_encoding is not a string", props)
    if not isinstance(payload.get("headers"), dict | None):
        return Problem("headers is not an object", payload.get("headers"))
    for key in ("content-type", "content-encoding"):
        if not isinstance(payload.get(key), str | None):
            return Problem(f"{key} is not a string", payload.get(key))
    try:
        decoded_body(payload)
    except ValueError as exc:
        return Problem(str(exc), payload.get("body"))
    return None


def _is_proto2_body(data: Any) -> bool:
    return (
        isinstance(data, list)
        and len(data) == 3
        and isinstance(data[0], list)
        and isinstance(data[1], dict)
        and isinstance(data[2], dict | None)
    )


def _header_problem(headers: dict[str, Any]) -> str | None:
    """The headers Celery parses while taking a message, before any task code runs."""
    for key in ("eta", "expires"):
        value = headers.get(key)
        if value is None:
            continue
        try:
            if not isinstance(value, str):
                raise TypeError
            maybe_iso8601(value)  # Celery's own parser for these headers
        except (TypeError, ValueError, OverflowError):
            return f"{key} is not an ISO 8601 time"
    limits = headers.get("timelimit")
    if limits is not None and not (
        isinstance(limits, list)
        and len(limits) == 2
        and all(v is None or type(v) in (int, float) for v in limits)
    ):
        return "timelimit is not [hard, soft]"
    return None


def task_problem(payload: dict[str, Any], task_names: Collection[str]) -> Problem | None:
    """Celery's task message protocol, for a payload whose envelope is already sound."""
    headers = payload.get("headers") or {}
    content_type = payload.get("content-type")
    if content_type != JSON_CONTENT:
        reason = f"content type {safe_text(str(content_type), 60)!r} is not JSON"
        return Problem(reason, decoded_body(payload))
    encoding = payload.get("content-encoding")
    if encoding is not None and encoding.lower() != "utf-8":
        reason = f"content encoding {safe_text(encoding, 40)!r} is not utf-8"
        return Problem(reason, decoded_body(payload))
    body = decoded_body(payload)
    try:
        # kombu's decoder, object hooks included: exactly what Celery runs on it later.
        data = kombu_loads(body) if body else None
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        return Problem(f"body is not JSON ({type(exc).__name__})", body)
    if "task" in headers:  # protocol 2: task name and id in the headers
        name, task_id = headers.get("task"), headers.get("id")
        if not _is_proto2_body(data):
            return Problem("body is not [args, kwargs, embed]", data)
        reason = _header_problem(headers)
        if reason is not None:
            return Problem(reason, headers)
    else:  # protocol 1: everything in the body
        if not isinstance(data, dict):
            return Problem(f"body is a JSON {_type_name(data)}, not a task", data)
        name, task_id = data.get("task"), data.get("id")
        if not isinstance(data.get("args", []), list) or not isinstance(
            data.get("kwargs", {}), dict
        ):
            return Problem("args/kwargs are not a list/object", data)
        reason = _header_problem(data)
        if reason is not None:
            return Problem(reason, data)
    if not isinstance(name, str) or name not in task_names:
        return Problem(f"unknown task {excerpt(name, 60)}", headers or data)
    if not isinstance(task_id, str) or not task_id:
        return Problem("no task id", headers or data)
    return None


# The message header a refused task carries to the task (a producer's own is dropped first).
REFUSED_HEADER = "ocrq_refused"
# What Celery runs or sends after a task: each makes the worker enqueue more messages.
LINKS = ("callbacks", "errbacks", "chain", "chord")


def task_refusal(
    payload: dict[str, Any],
    max_eta_s: float,
    now: dt.datetime,
    link_tasks: Sequence[str] = (),
    link_queues: Sequence[str] = (),
) -> str | None:
    """Why a sound task message must fail its job instead of running: an ETA more than
    `max_eta_s` ahead (held unacked, Redis would deliver it again every visibility timeout until
    then), or links that would have the worker send further tasks other than the producer's own
    callbacks named by OCRQ_LINK_TASKS and sent to OCRQ_LINK_QUEUES (`link_tasks`,
    `link_queues`; ocrq/worker/links.py has the rule)."""
    headers = payload.get("headers") or {}
    if "task" in headers:
        eta, links = headers.get("eta"), _embed(payload)
    else:  # protocol 1: everything in the body
        data = kombu_loads(decoded_body(payload))
        eta, links = data.get("eta"), data
    reason = link_refusal(links, link_tasks, link_queues)
    if reason is not None:
        return reason
    if eta is not None:
        when = maybe_iso8601(eta)
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        ahead = (when - now).total_seconds()
        if ahead > max_eta_s:
            return (
                f"eta {safe_text(eta, 40)} is {ahead:.0f} s ahead, more than OCRQ_MAX_ETA_S "
                f"({max_eta_s:g} s; by default the visibility timeout): send it nearer its time"
            )
    return None


def _embed(payload: dict[str, Any]) -> dict[str, Any]:
    body = decoded_body(payload)
    data = kombu_loads(body) if body else None
    return (data[2] or {}) if _is_proto2_body(data) else {}


def refused(payload: dict[str, Any], reason: str) -> dict[str, Any] | None:
    """The message rewritten to run at once with no links, carrying `reason` for the task to
    fail its job with (its row then says why); None for protocol 1, which is only rejected."""
    headers = payload.get("headers") or {}
    if "task" not in headers:
        return None
    args, kwargs, embed = kombu_loads(decoded_body(payload))
    body = json.dumps([args, kwargs, {**(embed or {}), **dict.fromkeys(LINKS)}])
    encoded = (
        base64.b64encode(body.encode()).decode("ascii")
        if payload["properties"].get("body_encoding") == "base64"
        else body
    )
    return {
        **payload,
        "body": encoded,
        "headers": {**headers, "eta": None, REFUSED_HEADER: reason},
    }


def message_problem(payload: Any, task_names: Collection[str] | None) -> Problem | None:
    """Why `payload` must not be delivered, or None. `task_names`: set for the task queue."""
    found = envelope_problem(payload)
    if found is None and task_names is not None:
        found = task_problem(payload, task_names)
    return found
