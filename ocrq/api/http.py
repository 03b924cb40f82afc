"""A small HTTP front door for producers that cannot speak Celery: POST a job, GET its row.

Run: `uvicorn ocrq.api.http:app` (settings from OCRQ_* variables). It only enqueues and reads; it
never touches an engine. Safe by default:

- every path but `/healthz` needs `Authorization: Bearer $OCRQ_API_TOKEN`, checked before
  any of the body is read; without a token the app refuses to start (and, if started some
  other way, answers 503) unless OCRQ_API_ALLOW_NO_AUTH=true says a proxy authenticates;
- request bodies over OCRQ_API_MAX_BODY_BYTES get 413 as soon as the count passes the limit
  (FastAPI's own limit, counted while reading, chunked bodies included);
- a 422 names the fields and what is wrong with them, never the values sent;
- no /docs or /openapi.json: the contract is in README.md.
"""

from __future__ import annotations

import hmac
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ocrq.api import documents
from ocrq.api.client import Client
from ocrq.core.contract import ImageRef
from ocrq.core.settings import Settings

MAX_TASK_CHARS = 4000  # as the worker's JobRequest
MAX_REF_CHARS = 8192  # a path or URL longer than this is not a real reference
MIN_TOKEN_CHARS = 16
MAX_ERRORS = 20  # a 422 lists at most this many problems
OPEN_PATHS = frozenset({"/healthz"})


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    image: ImageRef
    task: Annotated[str, Field(min_length=1, max_length=MAX_TASK_CHARS)] = "text"

    @model_validator(mode="after")
    def _storable(self) -> JobIn:
        for name in ("path", "url"):
            value = getattr(self.image, name)
            if value and len(value) > MAX_REF_CHARS:
                raise ValueError(f"image.{name} is longer than {MAX_REF_CHARS} characters")
        if any("\x00" in (v or "") for v in (self.task, self.image.path, self.image.url)):
            raise ValueError("NUL characters are not allowed")
        return self


def auth_problem(settings: Settings) -> str | None:
    """Why this configuration must not serve requests, or None when it may."""
    token = settings.api_token.get_secret_value() if settings.api_token else ""
    if not token:
        if settings.api_allow_no_auth:
            return None
        return (
            "OCRQ_API_TOKEN is not set: set it to a secret of at least "
            f"{MIN_TOKEN_CHARS} characters, or set OCRQ_API_ALLOW_NO_AUTH=true when an "
            "authenticating proxy stands in front of the api"
        )
    if len(token) < MIN_TOKEN_CHARS:
        return f"OCRQ_API_TOKEN is shorter than {MIN_TOKEN_CHARS} characters"
    return None


class BearerAuth:
    """Checks the token from the request's headers before the app reads a byte of its body,
    so an unauthenticated client cannot make the server take in a large upload."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.problem = auth_problem(settings)
        token = settings.api_token.get_secret_value() if settings.api_token else ""
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
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


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

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
        openapi_url=None,
    )
    app.add_middleware(BearerAuth, settings=settings)
    app.add_exception_handler(RequestValidationError, validation_failed)
    client = Client(settings)
    app.include_router(documents.router(client, settings))

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """Liveness for load balancers: the process answers; no auth, no backend calls."""
        return {"status": "ok"}

    @app.post("/jobs", status_code=202)
    def create_job(job: JobIn) -> dict[str, str]:
        image = job.image.model_dump(exclude_none=True)
        return {"job_id": client.submit(image, job.task)}

    @app.get("/jobs/{job_id}")
    def get_job(job_id: str) -> dict[str, Any]:
        try:
            key = str(uuid.UUID(job_id))
        except ValueError:
            raise HTTPException(404, "no such job") from None
        row = client.status([key])[0]
        if row["status"] == "unknown":
            raise HTTPException(404, "no such job")
        return row

    return app


app = create_app()
