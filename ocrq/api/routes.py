"""The job endpoints: submit (JSON, multipart upload, raw image body, batches), read, list,
look up many, and wait for results.

Handlers are async so that a long-poll holds no thread while it sleeps; every database or
broker call runs in the thread pool. Backend failures become 503s in http.py.

No `from __future__ import annotations` here: the batch and lookup bodies are models built per
settings (their list caps), and FastAPI can resolve a handler's annotations only when they are
objects, not names of a function's locals.
"""

import asyncio
import base64
import binascii
import datetime as dt
import json
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from ocrq.api import document_status
from ocrq.api.client import FINAL, Client, Delivery, Submitted
from ocrq.api.request_checks import is_json, json_body, known_query
from ocrq.api.schemas import DEFAULT_MAX_ITEMS as RETRY_MAX_IDS
from ocrq.api.schemas import (
    DELIVERY_FIELDS,
    Accepted,
    BatchAccepted,
    BatchCancelled,
    BatchOut,
    CancelOut,
    JobIn,
    JobList,
    JobOut,
    JobsFound,
    Retried,
    RetryIn,
    Status,
    StoredBatch,
    capped,
)
from ocrq.api.uploads import CHUNK, Uploads, UploadSlots, display_name, stored_or_refused
from ocrq.core.contract import canonical_job_id
from ocrq.core.settings import Settings
from ocrq.core.store import JobIdReused

RAW_TYPES = ("image/", "application/octet-stream")
# Body limits of the JSON-only routes, from what their capped lists need (and never above
# OCRQ_API_MAX_BODY_BYTES): a batch job is a path or URL (at most 8,192 characters), a task
# (4,000) and an id; inline images go one per POST /jobs, or as uploads. A lookup is ids.
BATCH_BYTES_PER_JOB = 16 * 1024
LOOKUP_BYTES_PER_ID = 128
BODY_SLACK = 4096
# An upload's or a raw body's job fields (the image is the body): JobIn's, bar the delivery.
UPLOAD_FIELDS = tuple(n for n in JobIn.model_fields if n not in ("image", *DELIVERY_FIELDS))

# POST /jobs takes three bodies; FastAPI can declare only one, so the schema says all three.
CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobIn"}},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        **{
                            name: schema
                            for name, schema in JobIn.model_json_schema()["properties"].items()
                            if name in UPLOAD_FIELDS
                        },
                    },
                }
            },
            "image/*": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


def _invalid(exc: ValidationError, where: str = "body") -> RequestValidationError:
    return RequestValidationError([{**e, "loc": (where, *e.get("loc", ()))} for e in exc.errors()])


def _job_in(data: Any, where: str = "body") -> JobIn:
    try:
        return JobIn.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, where) from None


def _encode_cursor(after: tuple[dt.datetime, str]) -> str:
    raw = json.dumps([after[0].isoformat(), after[1]]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        stamp, job_id = json.loads(raw)
        return dt.datetime.fromisoformat(stamp), canonical_job_id(job_id)
    except (binascii.Error, ValueError, TypeError, json.JSONDecodeError, RecursionError):
        raise RequestValidationError(
            [
                {
                    "loc": ("query", "cursor"),
                    "msg": "not a cursor from GET /jobs",
                    "type": "value_error",
                }
            ]
        ) from None


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    if value is not None and value.tzinfo is None:
        return value.replace(tzinfo=dt.UTC)  # a time without a zone is UTC
    return value


def router(settings: Settings, client: Client, slots: UploadSlots | None = None) -> APIRouter:
    api = APIRouter(tags=["jobs"])
    slots = slots or UploadSlots(settings.api_max_uploads)
    BatchIn, LookupIn = capped(settings.api_max_batch)
    n, most = settings.api_max_batch, settings.api_max_body_bytes
    batch_bytes = min(most, n * BATCH_BYTES_PER_JOB + BODY_SLACK)
    lookup_bytes = min(most, n * LOOKUP_BYTES_PER_ID + BODY_SLACK)
    # A retry names a batch and/or at most RETRY_MAX_IDS ids (69 MB of `{}` items took 1.82 GB).
    retry_bytes = min(most, RETRY_MAX_IDS * LOOKUP_BYTES_PER_ID + BODY_SLACK)
    uploads = (
        Uploads(settings.upload_dir, settings.max_image_bytes) if settings.upload_dir else None
    )

    async def submit(jobs: list[JobIn], names: list[str | None] | None = None) -> list[Submitted]:
        if settings.webhook_secret is None and any(job.callback_url for job in jobs):
            raise HTTPException(
                422,
                "callback_url needs OCRQ_WEBHOOK_SECRET set on the api and the workers: "
                "webhooks are always signed (docs/security.md, Webhooks)",
            )
        requests = [job.request() for job in jobs]
        names = names or [None] * len(jobs)
        deliveries = [
            Delivery(job.expires_at, job.callback_url, name)
            for job, name in zip(jobs, names, strict=True)
        ]
        return await run_in_threadpool(client.submit_many, requests, deliveries)

    async def stored_upload(chunks: Any) -> str:
        if uploads is None:
            raise HTTPException(
                415,
                "uploads are not enabled on this api: set OCRQ_UPLOAD_DIR to one folder shared "
                "by the api and every worker (docs/deploy.md, Uploads), or send JSON that names "
                "the image by path or url",
            )
        return str(await stored_or_refused(uploads, chunks))

    async def from_multipart(request: Request) -> tuple[JobIn, str | None]:
        async with request.form(max_files=1, max_fields=len(UPLOAD_FIELDS)) as form:
            file = form.get("file")
            if not isinstance(file, UploadFile):
                raise RequestValidationError(
                    [
                        {
                            "loc": ("body", "file"),
                            "msg": "a file field is required",
                            "type": "missing",
                        }
                    ]
                )
            unknown = sorted(set(form.keys()) - {"file", *UPLOAD_FIELDS})
            if unknown:
                raise RequestValidationError(
                    [
                        {"loc": ("body", k[:64]), "msg": "unknown field", "type": "extra_forbidden"}
                        for k in unknown
                    ]
                )

            async def chunks() -> Any:
                while chunk := await file.read(CHUNK):
                    yield chunk

            fields = {k: form[k] for k in UPLOAD_FIELDS if isinstance(form.get(k), str)}
            _job_in({"image": {"path": "/"}, **fields})  # fields checked before storing
            path = await stored_upload(chunks())
            name = display_name(file.filename)
        return _job_in({"image": {"path": path}, **fields}), name

    async def from_raw(request: Request, given: dict[str, Any]) -> JobIn:
        fields = {k: v for k, v in given.items() if v is not None}
        _job_in({"image": {"path": "/"}, **fields}, "query")
        path = await stored_upload(request.stream())
        return _job_in({"image": {"path": path}, **fields}, "query")

    @api.post(
        "/jobs",
        status_code=202,
        response_model=Accepted,
        openapi_extra=CREATE_BODY,
        dependencies=[known_query(*UPLOAD_FIELDS, "file_name")],
        responses={
            200: {"model": Accepted, "description": "the job was already recorded (a retry)"},
            409: {"description": "job_id already used for a different image or task"},
            413: {"description": "body or image too large"},
            415: {"description": "not JSON, multipart or an image (or uploads not enabled)"},
            503: {"description": "Redis or PostgreSQL unavailable; nothing was recorded"},
        },
    )
    async def create_job(
        request: Request,
        task: Annotated[str | None, Query(description="raw image bodies only")] = None,
        job_id: Annotated[str | None, Query(description="raw image bodies only")] = None,
        max_pixels: Annotated[int | None, Query(description="raw image bodies only")] = None,
        max_new_tokens: Annotated[int | None, Query(description="raw image bodies only")] = None,
        priority: Annotated[str | None, Query(description="raw image bodies only")] = None,
        batch: Annotated[str | None, Query(description="raw image bodies only")] = None,
        file_name: Annotated[
            str | None,
            Query(description="raw image bodies only: the file's own name, shown with the job"),
        ] = None,
    ) -> JSONResponse:
        """Submit one job: a JSON `JobIn`, a multipart upload (`file` plus optional `task`,
        `job_id`, `max_pixels`, `max_new_tokens`, `priority`, `batch` fields) or a raw image
        body (`Content-Type: image/...`; those fields as query parameters). Uploads are stored
        in OCRQ_UPLOAD_DIR under their SHA-256 and sent as path jobs. 202 when recorded now, 200
        for a retry of a job already recorded."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        name: str | None = None  # an upload's own name, shown with the job (display only)
        if is_json(request):
            try:
                data = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                # RecursionError: nested deeper than the decoder goes (the probe's 100,000
                # brackets were a 500); no real job is nested more than three levels.
                msg = "JSON nested too deeply" if isinstance(exc, RecursionError) else None
                raise RequestValidationError(
                    [{"loc": ("body",), "msg": msg or "JSON decode error", "type": "json_invalid"}]
                ) from None
            job = _job_in(data)
        elif kind == "multipart/form-data":
            with slots.slot():
                job, name = await from_multipart(request)
        elif kind.startswith(RAW_TYPES):
            name = display_name(file_name)
            with slots.slot():
                job = await from_raw(
                    request,
                    {
                        "task": task,
                        "job_id": job_id,
                        "max_pixels": max_pixels,
                        "max_new_tokens": max_new_tokens,
                        "priority": priority,
                        "batch": batch,
                    },
                )
        else:
            raise HTTPException(
                415,
                "send application/json, multipart/form-data, or the image itself as image/* or "
                "application/octet-stream; a PDF or TIFF as the body goes to POST /documents "
                "(or as a multipart `file` here)",
            )
        (done,) = await submit([job], [name])
        return JSONResponse(
            Accepted(job_id=done.job_id, created=done.created, status=done.status).model_dump(),
            status_code=202 if done.created else 200,
        )

    @api.post(
        "/jobs/batch",
        status_code=202,
        dependencies=[Depends(json_body)],
        response_model=BatchAccepted,
        max_body_size=batch_bytes,
        responses={413: {"description": "body over its limit, or too many JSON values"}},
    )
    async def create_batch(batch: BatchIn) -> BatchAccepted:
        """Submit many jobs in one request (at most OCRQ_API_MAX_BATCH; more is a 422): recorded
        all or none (a reused `job_id` -> 409 and nothing recorded), then sent; duplicate ids of
        the same job count once. Jobs naming no `batch` of their own join the request's
        `batch`, or one the api makes up and returns (`GET /batches/{batch}`). The request's
        `callback_url` is the batch's webhook: sent once every job of the batch is final."""
        name = batch.batch or str(uuid.uuid4())
        jobs = [j if j.batch else j.model_copy(update={"batch": name}) for j in batch.jobs]
        hook, previous = batch.callback_url, None
        if hook is not None:  # known before any job is sent (it may end at once)
            if settings.webhook_secret is None:
                raise HTTPException(422, "callback_url needs OCRQ_WEBHOOK_SECRET set")
            previous = await run_in_threadpool(client.register_batch_webhook, name, hook)
        try:
            done = await submit(jobs)
        except (JobIdReused, HTTPException):  # nothing recorded: nor is the webhook
            if hook is not None:
                await run_in_threadpool(client.withdraw_batch_webhook, name, hook, previous)
            raise
        return BatchAccepted(
            jobs=[Accepted(job_id=d.job_id, created=d.created, status=d.status) for d in done],
            batch=name,
        )

    @api.get("/batches/{batch:path}", response_model=BatchOut, responses={404: {}})
    async def get_batch(batch: StoredBatch) -> dict[str, Any]:
        """A batch's jobs counted by status (images and documents' pages), its documents, its
        first and last finish, and an ETA from the batch's own completion rate. Its jobs
        themselves: `GET /jobs?batch=...`, paged."""
        found = await run_in_threadpool(client.batch, batch)
        if found is None:
            raise HTTPException(404, "no job names this batch")
        return found.as_json()

    @api.delete("/batches/{batch:path}", response_model=BatchCancelled, responses={404: {}})
    async def cancel_batch(batch: StoredBatch) -> dict[str, Any]:
        """Cancel every job of the batch not final yet: queued ones never run, running ones are
        dropped from the running loop at its next harvest (or, on an engine without one, their
        result is not stored). Final jobs and other batches are not touched. The batch's
        summary afterwards, with `cancelled`: how many this request cancelled."""
        cancelled, found = await run_in_threadpool(client.cancel_batch, batch)
        if found is None:
            raise HTTPException(404, "no job names this batch")
        return {**found.as_json(), "cancelled": len(cancelled)}

    @api.post(
        "/jobs/retry",
        response_model=Retried,
        dependencies=[Depends(json_body)],
        max_body_size=retry_bytes,
        responses={404: {}, 413: {"description": "body over its limit, or too many JSON values"}},
    )
    async def retry_jobs(body: RetryIn) -> dict[str, Any]:
        """Run failed jobs again (of `batch`, and/or of `job_ids`): each goes back to
        `queued` as a new attempt (its row's `attempts` and `retries` count it) and is sent
        again; a document with a re-run page is assembled again. Copies of the old messages
        still find the job as it is: only the re-run's own message runs it. A batch no job
        names is a 404 (as `GET /batches/{batch}`); each named job not sent again is in
        `not_retried` with why."""
        if body.batch is not None and not await run_in_threadpool(
            client.known_batches, [body.batch]
        ):
            raise HTTPException(404, "no job names this batch")
        sent = await run_in_threadpool(client.retry_failed, body.batch, body.job_ids)
        skipped = (
            await run_in_threadpool(client.not_rerun, body.job_ids, sent, body.batch)
            if body.job_ids
            else {}
        )
        return {"job_ids": sent, "not_retried": skipped}

    async def wait_for(request: Request, ids: list[str], wait_s: float) -> list[dict[str, Any]]:
        """Rows once none is queued or running, or after wait_s (capped): polling the table,
        50 ms at first, then twice as long each time up to 1 s."""
        deadline = time.monotonic() + min(wait_s, settings.api_max_wait_s)
        delay = 0.05
        while True:
            rows = await run_in_threadpool(client.status, ids)
            pending = any(r["status"] not in (*FINAL, "unknown") for r in rows)
            left = deadline - time.monotonic()
            if not pending or left <= 0 or await request.is_disconnected():
                return rows
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, 1.0)

    @api.get("/jobs", response_model=JobList)
    async def list_jobs(
        status: Annotated[list[Status] | None, Query(description="repeatable")] = None,
        created_after: dt.datetime | None = None,
        created_before: dt.datetime | None = None,
        limit: Annotated[int, Query(ge=1)] = 50,
        cursor: Annotated[str | None, Query(description="next_cursor of the previous page")] = None,
        batch: Annotated[StoredBatch | None, Query(description="only this batch's jobs")] = None,
    ) -> dict[str, Any]:
        """Jobs newest first, filtered by status, creation time and batch; page on with
        `cursor` (a `limit` above OCRQ_API_MAX_BATCH gets that many, and a `next_cursor`)."""
        after = _decode_cursor(cursor) if cursor else None
        page = await run_in_threadpool(
            client.page,
            status or (),
            _utc(created_after),
            _utc(created_before),
            min(limit, settings.api_max_batch),
            after,
            batch,
        )
        # A document's own job with its document's status, text and pages (as `ocrq jobs`).
        rows = await run_in_threadpool(document_status.listed, client.documents, page.rows)
        return {
            "jobs": rows,
            "next_cursor": _encode_cursor(page.next_after) if page.next_after else None,
        }

    @api.post(
        "/jobs/lookup",
        response_model=JobsFound,
        dependencies=[Depends(json_body)],
        max_body_size=lookup_bytes,
        responses={413: {"description": "body over its limit, or too many JSON values"}},
    )
    async def lookup(request: Request, body: LookupIn) -> dict[str, Any]:
        """Many jobs by id (at most OCRQ_API_MAX_BATCH), in the order given (`status:
        "unknown"` for ids with no row); with `wait`, answered once none is queued or running
        or after `wait` s (capped)."""
        return {"jobs": await wait_for(request, body.job_ids, body.wait)}

    @api.get("/jobs/{job_id}", response_model=JobOut, responses={404: {}})
    async def get_job(
        request: Request,
        job_id: str,
        wait: Annotated[
            float,
            Query(ge=0, allow_inf_nan=False,
                  description="seconds to wait for a final status (capped at OCRQ_API_MAX_WAIT_S)"),
        ] = 0.0,
    ) -> dict[str, Any]:
        """The job's whole row; with `wait`, answered once it is done or failed or after
        `wait` seconds (capped at OCRQ_API_MAX_WAIT_S), whichever comes first."""
        try:
            key = canonical_job_id(job_id)
        except ValueError:
            raise HTTPException(404, "no such job") from None
        (row,) = await wait_for(request, [key], wait)
        if row["status"] == "unknown":
            raise HTTPException(404, "no such job")
        return row

    @api.delete(
        "/jobs/{job_id}",
        response_model=CancelOut,
        responses={
            404: {"description": "no such job"},
            409: {"description": "the job is final already (done, failed or expired)"},
        },
    )
    async def cancel_job(job_id: str) -> dict[str, Any]:
        """Cancel a job: queued, it never runs; running, its batch goes on undisturbed and its
        result is not stored. The row says `cancelled` (final). Cancelling a cancelled job
        answers its row again (200, `cancelled` false)."""
        try:
            key = canonical_job_id(job_id)
        except ValueError:
            raise HTTPException(404, "no such job") from None
        (row,) = await run_in_threadpool(client.cancel, [key])
        if row["status"] == "unknown":
            raise HTTPException(404, "no such job")
        if row["status"] != "cancelled":
            raise HTTPException(409, f"job {key} is {row['status']} already: not cancelled")
        return row

    return api
