"""The api's document routes: upload a PDF or multi-page TIFF, read a document and its pages.

A document named by path or URL needs no route of its own: `POST /jobs` with
`{"image": {"path": "/srv/docs/report.pdf"}}` is a document job (the worker tells a document
from an image by its bytes), and its job id is the document's id. `POST /documents` takes the
file itself as the request body, capped by OCRQ_MAX_IMAGE_BYTES as it arrives. Where
OCRQ_UPLOAD_DIR is set it is streamed there, content-addressed, and sent as a path job, as
`POST /jobs` does with an upload: the viewer can draw its pages, `ocrq retry` can read it
again, and a retry under the same `job_id` is compared by content. Without it the document
travels to the worker inline, once (the worker's cap on inline bytes is the same), and the
worker sends each page on as a one-page document, so no later message holds the whole file.
Either way at most OCRQ_API_MAX_UPLOADS are taken in at once (uploads.py, UploadSlots).
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from ocrq.api.client import Client, Delivery
from ocrq.api.request_checks import known_query
from ocrq.api.schemas import validation_messages
from ocrq.api.uploads import (
    Uploads,
    UploadSlots,
    checked_head,
    display_name,
    stored_or_refused,
)
from ocrq.core.contract import MAX_BATCH_CHARS, MAX_NEW_TOKENS_LIMIT, JobRequest
from ocrq.core.doc_formats import document_kind
from ocrq.core.settings import Settings

MAX_TASK_CHARS = 4000
DOCUMENT_TYPES = ("application/pdf", "image/tiff", "application/octet-stream")
DOCUMENT_HEAD = 1024  # bytes that tell a PDF or TIFF (core/doc_formats.py)

# The handler reads the raw body itself (FastAPI declares no body for it), so the schema says
# what it takes: the document's bytes; the type is told from the bytes, not the header.
UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "description": "The document's bytes: a PDF or a (multi-page) TIFF, at most "
        "OCRQ_MAX_IMAGE_BYTES. Recognised by its bytes, whatever the Content-Type says.",
        "content": {t: {"schema": {"type": "string", "format": "binary"}} for t in DOCUMENT_TYPES},
    }
}


class DocumentAccepted(BaseModel):
    job_id: str  # the document's job; its id is the document's id
    document_id: str


def router(client: Client, settings: Settings, slots: UploadSlots | None = None) -> APIRouter:
    routes = APIRouter(tags=["documents"])
    uploads = (
        Uploads(settings.upload_dir, settings.max_image_bytes) if settings.upload_dir else None
    )
    slots = slots or UploadSlots(settings.api_max_uploads)
    most = settings.max_image_bytes

    def a_document(head: bytes) -> None:
        if document_kind(head[:DOCUMENT_HEAD]) is None:
            raise HTTPException(415, "not a PDF or TIFF document")

    async def stored(request: Request) -> dict[str, str]:
        """The document as the job's image: streamed to its upload's path, or read whole and
        sent inline without a folder (capped as it arrives, either way)."""
        chunks = checked_head(request.stream(), DOCUMENT_HEAD, a_document)
        if uploads is not None:
            return {"path": str(await stored_or_refused(uploads, chunks))}
        body = bytearray()
        async for chunk in chunks:
            if len(body) + len(chunk) > most:
                raise HTTPException(413, f"document over {most} bytes (OCRQ_MAX_IMAGE_BYTES)")
            body += chunk
        return {"b64": base64.b64encode(body).decode("ascii")}

    @routes.post(
        "/documents",
        status_code=202,
        response_model=DocumentAccepted,
        openapi_extra=UPLOAD_BODY,
        dependencies=[known_query("task", "batch", "max_new_tokens", "job_id", "file_name")],
        responses={
            200: {"model": DocumentAccepted, "description": "already recorded (a retry)"},
            409: {"description": "job_id already used for a different document or task"},
            413: {"description": "over OCRQ_MAX_IMAGE_BYTES"},
            415: {"description": "not a PDF or TIFF document"},
        },
    )
    async def upload_document(
        request: Request,
        task: Annotated[str, Query(min_length=1, max_length=MAX_TASK_CHARS)] = "text",
        batch: Annotated[
            str | None, Query(min_length=1, max_length=MAX_BATCH_CHARS, description="its batch")
        ] = None,
        max_new_tokens: Annotated[
            int | None,
            Query(ge=1, le=MAX_NEW_TOKENS_LIMIT, description="every page's cap on new tokens"),
        ] = None,
        job_id: Annotated[
            str | None,
            Query(description="a UUID of yours: a retry with it records the document once"),
        ] = None,
        file_name: Annotated[
            str | None, Query(description="the file's own name, shown with the document")
        ] = None,
    ) -> JSONResponse:
        """Upload a PDF or multi-page TIFF as the request body; its pages become page jobs.
        Read the result with `GET /documents/{document_id}` (or `GET /jobs/{job_id}`). With
        `job_id`, a retry after a timeout records the document once (200 then), as
        `POST /jobs` does."""
        if "\x00" in task or (batch is not None and "\x00" in batch):
            raise HTTPException(422, "NUL characters are not allowed")
        given = {"task": task, "job_id": job_id, "batch": batch, "max_new_tokens": max_new_tokens}
        fields = {k: v for k, v in given.items() if v is not None}
        try:  # the worker's rules (a job_id that is no UUID...), checked before anything is kept
            JobRequest.model_validate({"image": {"path": "/"}, **fields})
        except ValidationError as exc:
            raise HTTPException(422, validation_messages(exc)) from None
        with slots.slot():
            image = await stored(request)
        request = JobRequest.model_validate({"image": image, **fields})
        delivery = Delivery(file_name=display_name(file_name))  # display only
        (done,) = await run_in_threadpool(client.submit_many, [request], [delivery])
        answer = DocumentAccepted(job_id=done.job_id, document_id=done.job_id)
        return JSONResponse(answer.model_dump(), status_code=202 if done.created else 200)

    @routes.get("/documents/{document_id}", responses={404: {"description": "no such document"}})
    def get_document(document_id: str) -> dict[str, Any]:
        """The document with every page (text, lines with boxes in the page's pixels)."""
        try:
            key = str(uuid.UUID(document_id))
        except ValueError:
            raise HTTPException(404, "no such document") from None
        view = client.documents.view(key)
        if view is None:
            raise HTTPException(404, "no such document")
        row = client.store.get([key]).get(key)  # its own job's: an upload's own name
        return {**view, "file_name": row.get("file_name") if row else None}

    return routes
