"""A small HTTP front door for producers that cannot speak Celery: submit jobs (JSON, uploads,
batches), read, list and wait for their rows.

Run: `uvicorn ocrq.api.http:app` (settings from OCRQ_* variables). It only enqueues and reads; it
never touches an engine. The endpoints live in routes.py (jobs), health.py (/healthz, /readyz),
docs.py (offline OpenAPI pages) and viewer.py (a page that draws results); this module
assembles them behind the safe defaults:

- every path but `/healthz`, `/readyz`, the viewer's page under `/view/` (it holds no data:
  viewer.py) and the docs with OCRQ_API_DOCS=public needs `Authorization: Bearer
  $OCRQ_API_TOKEN`, checked before any of the body is read; without a token the app refuses
  to start (and, if started some other way, answers 503) unless OCRQ_API_ALLOW_NO_AUTH=true
  says a proxy authenticates;
- request bodies over OCRQ_API_MAX_BODY_BYTES get 413 as soon as the count passes the limit
  (FastAPI's own limit, counted while reading, chunked bodies included); the JSON-only routes
  (/jobs/batch, /jobs/lookup) have lower limits, from what their capped lists need (routes.py);
- a JSON body with more values than its route could use gets 413 while it is still arriving,
  before it is parsed (json_budget.py): parsing and validating stay bounded on the event loop;
- a 422 names the fields and what is wrong with them, never the values sent;
- Redis or PostgreSQL down is a 503 with Retry-After, and leaves no job half-submitted
  (client.py's submit_many says how).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import kombu.exceptions
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from sqlalchemy import exc as sa_exc
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ocrq import __version__
from ocrq.api import docs, documents, health, routes, viewer
from ocrq.api.body_idle import BodyIdle
from ocrq.api.client import Client, NotSent
from ocrq.api.json_budget import JsonBudget
from ocrq.api.request_checks import declared_query
from ocrq.api.uploads import UploadSlots
from ocrq.core.settings import Settings, warn_unknown_variables
from ocrq.core.store import REUSED_ID, JobIdReused

MIN_TOKEN_CHARS = 16
# Said with the refusal: a user told only "too short" picked a longer guessable word.
MAKE_TOKEN = (
    "make one with `openssl rand -hex 32` or "
    '`python -c "import secrets; print(secrets.token_hex(32))"`'
)
MAX_ERRORS = 20  # a 422 lists at most this many problems
OPEN_PATHS = frozenset({"/", "/healthz", "/readyz"})
RETRY_AFTER_S = "5"
log = logging.getLogger(__name__)


def auth_problem(settings: Settings) -> str | None:
    """Why this configuration must not serve requests, or None when it may."""
    token = settings.api_token.get_secret_value() if settings.api_token else ""
    if not token:
        if settings.api_allow_no_auth:
            return None
        return (
            "OCRQ_API_TOKEN is not set: set it to a secret of at least "
            f"{MIN_TOKEN_CHARS} characters ({MAKE_TOKEN}), or set OCRQ_API_ALLOW_NO_AUTH=true "
            "when an authenticating proxy stands in front of the api"
        )
    if len(token) < MIN_TOKEN_CHARS:
        return f"OCRQ_API_TOKEN is shorter than {MIN_TOKEN_CHARS} characters: {MAKE_TOKEN}"
    return None


class BearerAuth:
    """Checks the token from the request's headers before the app reads a byte of its body,
    so an unauthenticated client cannot make the server take in a large upload."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.problem = auth_problem(settings)
        token = settings.api_token.get_secret_value() if settings.api_token else ""
        self.token = token.encode() if token else None
        doc_paths, doc_prefixes = docs.open_paths(settings.api_docs)
        self.open_prefixes = (*doc_prefixes, *viewer.open_prefixes())
        self.open_paths = OPEN_PATHS | doc_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] != "http"
            or path in self.open_paths
            or path.startswith(self.open_prefixes)
        ):
            return await self.app(scope, receive, send)
        if self.problem is not None:  # started without the lifespan check: fail closed
            response = JSONResponse({"detail": "api not configured"}, status_code=503)
            return await response(scope, receive, send)
        if self.token is not None:
            scheme, _, supplied = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                supplied.strip().encode("utf-8", "replace"), self.token
            ):
                response = JSONResponse(
                    {"detail": "missing or wrong bearer token"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


async def validation_failed(_: Request, exc: Exception) -> JSONResponse:
    """FastAPI's default 422 echoes each bad value back (a 10 MB task came back whole): keep
    where and what, drop the values; field names that came from the client are cut short."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    detail = [
        {
            "loc": [p if isinstance(p, int) else str(p)[:64] for p in e.get("loc", ())],
            "msg": str(e.get("msg", ""))[:300],
            "type": str(e.get("type", "")),
        }
        for e in errors[:MAX_ERRORS]
    ]
    body: dict[str, Any] = {"detail": detail}
    if len(errors) > MAX_ERRORS:
        body["more_errors"] = len(errors) - MAX_ERRORS
    return JSONResponse(body, status_code=422)


def _unavailable(what: str, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"detail": f"{what} unavailable, try again later", **extra},
        status_code=503,
        headers={"Retry-After": RETRY_AFTER_S},
    )


async def database_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", exc)
    return _unavailable("database")


async def broker_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("broker unavailable: %s", exc)
    return _unavailable("broker")


async def not_sent(_: Request, exc: Exception) -> JSONResponse:
    """The broker failed mid-submit. Unsent jobs' rows were deleted again, so a retry of the
    same request (with its job ids) finishes the job; the body names what did go out."""
    assert isinstance(exc, NotSent)
    log.warning("%s (sent %d, kept %d)", exc, len(exc.sent), len(exc.kept))
    return _unavailable("broker", sent=exc.sent, recorded_not_sent=exc.kept)


async def id_reused(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, JobIdReused)
    return JSONResponse({"detail": REUSED_ID, "job_ids": exc.job_ids[:MAX_ERRORS]}, 409)


def create_app(settings: Settings | None = None) -> FastAPI:
    if settings is None:  # the app as uvicorn starts it: a misspelt OCRQ_* is said, not ignored
        warn_unknown_variables(os.environ)
        settings = Settings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        problem = auth_problem(settings)
        if problem is not None:
            raise RuntimeError(f"ocrq api cannot start: {problem}")
        yield

    app = FastAPI(
        title="ocrq",
        summary="Enqueue OCR jobs and read their results.",
        lifespan=lifespan,
        max_body_size=settings.api_max_body_bytes,
        docs_url=None,
        redoc_url=None,
        openapi_url=None if settings.api_docs == "off" else docs.OPENAPI,
    )
    # The last added runs first: the token is checked before a JSON body is counted, and a
    # body's pauses are bounded under both.
    app.add_middleware(BodyIdle, idle_s=settings.api_body_idle_s)
    app.add_middleware(JsonBudget, settings=settings)
    app.add_middleware(BearerAuth, settings=settings)
    app.add_exception_handler(RequestValidationError, validation_failed)
    # Connection-level failures only: a constraint or data error is a bug and stays a 500.
    for exc in (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
        app.add_exception_handler(exc, database_down)
    for exc in (kombu.exceptions.OperationalError, ConnectionError):
        app.add_exception_handler(exc, broker_down)
    app.add_exception_handler(NotSent, not_sent)
    app.add_exception_handler(JobIdReused, id_reused)
    client = Client(settings)
    # Every api route refuses query parameters it does not take (the viewer's page, which
    # holds no data, and the docs take what a browser adds).
    strict = [Depends(declared_query)]
    app.include_router(health.router(client.app, lambda: client.store.engine), dependencies=strict)
    # The bearer scheme in the schema of every route behind the token, so Swagger UI's
    # "Authorize" sends it; BearerAuth checks it (the dependency never refuses).
    bearer = [Depends(HTTPBearer(auto_error=False))]
    slots = UploadSlots(settings.api_max_uploads)  # one count for every route's uploads
    app.include_router(routes.router(settings, client, slots), dependencies=[*bearer, *strict])
    app.include_router(documents.router(client, settings, slots), dependencies=[*bearer, *strict])
    app.include_router(viewer.router(settings, client), dependencies=bearer)
    viewer.mount(app)
    if settings.api_docs != "off":
        docs.mount(app)

    @app.get("/", include_in_schema=False)
    def index() -> dict[str, Any]:
        """Where things are, for a browser or `curl` pointed at the server's root (it was a
        401, or a 404 with the token); open, as /healthz is: it names no job."""
        return {
            "service": "ocrq api",
            "version": __version__,
            "docs": docs.DOCS if settings.api_docs != "off" else None,
            "health": "/healthz",
            "ready": "/readyz",
        }

    return app


app = create_app()
