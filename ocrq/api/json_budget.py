"""A cap on how much a JSON request body may cost to parse, checked while it arrives.

Why: `json.loads` turns every value into a Python object, and pydantic then validates (and
reports on) each one, all on the event loop. A body's size says little about that cost: 8 MB
of `[{},{},...]` is 2.7 million dicts (over 200 MB) and as many validation errors, while a
67 MB single job of base64 text is one string. Issue 31's probe took 21.9 GB of the api with a
65 MB `{"jobs": [1,1,...]}` and stalled `/healthz` for 9 s.

What is counted: the bytes `,` `:` `[` `{`. Every value and key of a JSON document but the first
follows one of them, so their count bounds the objects `json.loads` would make (strings that
contain them only make the bound looser). It is counted chunk by chunk as uvicorn hands the
body over (`bytes.count`, in C), and past the route's budget the request ends in a 413 before
the rest is read, let alone parsed. Routes that take JSON name a budget sized by what they
accept (`budgets`); others, and bodies that are not JSON (uploads), pass as they
are.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ocrq.api.schemas import DEFAULT_MAX_ITEMS as RETRY_MAX_IDS
from ocrq.core.settings import Settings

STRUCTURAL = (b",", b":", b"[", b"{")
# A job of POST /jobs/batch is ~20 values; the rest is room for prompts and paths that hold
# commas and colons. A lookup's job id is one value and a comma.
VALUES_PER_JOB = 256
VALUES_PER_ID = 4
SINGLE_JOB_VALUES = 4096  # POST /jobs with a JSON body: one job
MIN_VALUES = 1024


def is_json(headers: Headers) -> bool:
    """As FastAPI decides to parse a body as JSON: no content type, or application/(*+)json."""
    kind = headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in ("", "application/json") or (
        kind.startswith("application/") and kind.endswith("+json")
    )


def budgets(settings: Settings) -> dict[tuple[str, str], int]:
    """(method, path) -> the most structural bytes its JSON body may hold."""
    n = settings.api_max_batch
    return {
        ("POST", "/jobs"): SINGLE_JOB_VALUES,
        ("POST", "/jobs/batch"): max(MIN_VALUES, n * VALUES_PER_JOB),
        ("POST", "/jobs/lookup"): max(MIN_VALUES, n * VALUES_PER_ID),
        ("POST", "/jobs/retry"): max(MIN_VALUES, RETRY_MAX_IDS * VALUES_PER_ID),
    }


class JsonBudget:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.budgets: Mapping[tuple[str, str], int] = budgets(settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        budget = (
            self.budgets.get((scope.get("method", ""), scope.get("path", "")))
            if scope["type"] == "http"
            else None
        )
        if budget is None or not is_json(Headers(scope=scope)):
            return await self.app(scope, receive, send)
        counted = 0

        async def counting() -> Message:
            nonlocal counted
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                counted += sum(chunk.count(c) for c in STRUCTURAL)
                if counted > budget:
                    # Raised inside the route's body read: FastAPI passes an HTTPException
                    # from there on untouched, so the client gets this 413.
                    raise HTTPException(413, f"JSON body holds more values than {budget}")
            return message

        await self.app(scope, counting, send)
