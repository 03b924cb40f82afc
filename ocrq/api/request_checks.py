"""Checks of a request's shape that several routes share, run before its body is read.

Why a module: FastAPI refuses a JSON body's unknown fields (the models forbid extras) but takes
any query parameter and drops those a route does not name, and reads a JSON-only route's body
sent as a form as if it were one, failing later with a message about dictionaries. Said here,
once, in the words a user can act on.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError


def is_json(request: Request) -> bool:
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind in ("", "application/json") or kind.endswith("+json")  # as FastAPI reads


def json_body(request: Request) -> None:
    """A JSON-only route's body sent as something else (curl's `-d` sends a form) was a 422
    "Input should be a valid dictionary or object to extract fields from"; `POST /jobs`
    already said what to send."""
    if not is_json(request):
        raise HTTPException(
            415, "send the body as JSON: Content-Type: application/json (curl: --json, or "
            "-H 'Content-Type: application/json')"
        )


def _query_names(dependant: Any) -> set[str]:
    """The query parameters a route takes: its own and its dependencies'."""
    names = {f.alias for f in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names


def _refuse_unknown(request: Request, names: set[str]) -> None:
    unknown = sorted(set(request.query_params) - names)
    if unknown:
        takes = ", ".join(sorted(names)) or "none"
        raise RequestValidationError(
            [
                {
                    "loc": ("query", k[:64]),
                    "msg": f"unknown query parameter (this route takes: {takes})",
                    "type": "extra_forbidden",
                }
                for k in unknown[:20]  # a URL of thousands: the first are enough
            ]
        )


def declared_query(request: Request) -> None:
    """A dependency refusing query parameters the route does not declare, on every route it is
    given to (http.py gives it to all the api's routes): `GET /jobs?stauts=failed` listed
    every job, and a raw upload's `?taks=spotting` was dropped without a word (its task stayed
    `text`), where the same typo in JSON or a multipart field is a 422."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    if dependant is not None:
        _refuse_unknown(request, _query_names(dependant))


def known_query(*names: str) -> Any:
    """As `declared_query`, for a route that reads its query parameters itself: these names."""

    def check(request: Request) -> None:
        _refuse_unknown(request, set(names))

    return Depends(check)
