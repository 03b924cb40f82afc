"""The results viewer: a page that draws a job's (or a document's pages') lines as boxes over
its image, with the text beside it, like olmOCR's and PaddleOCR's viewers.

`/view/{job_id}` and `/view/documents/{document_id}` serve the same small static page, openly:
it holds no data, only the script that fetches the job, the document and the image from the
api's authenticated routes with the bearer token, which the page takes from `#token=...` in
its address (a fragment never reaches the server or its logs; the script removes it from the
address bar and the history) or asks for. So the viewer needs no session or cookie of its own,
and nothing it shows is readable without the token. OCR output is untrusted: the script sets
text only as text, and the page's Content-Security-Policy runs no script but its own file.

`GET /jobs/{job_id}/image` is the job's image as a JPEG (view_images.py says which images the
api will read).
"""

from __future__ import annotations

import asyncio
import html
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from ocrq.api import view_images
from ocrq.api.client import Client
from ocrq.api.request_checks import declared_query
from ocrq.core.settings import Settings

PREFIX = "/view/"
STATIC = "/view/static"
FOLDER = Path(__file__).parent / "viewer_static"
# Images decoded at once for GET /jobs/{id}/image (each may hold ~10 bytes per pixel of a
# file up to OCRQ_MAX_IMAGE_PIXELS for a moment), and more jobs' images that may wait.
DECODES = 2
WAITING = 32
# No inline script or style, nothing from elsewhere; images only from the api or the blob URLs
# the script makes of them.
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
    "connect-src 'self'; form-action 'none'; base-uri 'none'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def open_prefixes() -> tuple[str, ...]:
    """Paths served without the token: the page and its script and style (no data)."""
    return (PREFIX,)


def _page(request: Request, status_code: int = 200) -> HTMLResponse:
    root = html.escape(request.scope.get("root_path", "").rstrip("/"), quote=True)
    text = (FOLDER / "viewer.html").read_text().replace("{static}", root + STATIC)
    return HTMLResponse(text, status_code=status_code, headers=PAGE_HEADERS)


def _no_such_page(request: Request, rest: str) -> HTMLResponse:
    """Any other address under /view/: the page again, as a 404, so that its script takes a
    `#token=` out of the address bar there too (a JSON 404 left it in the address and the
    history) and says where the viewer is."""
    return _page(request, 404)


class Decodes:
    """The image route's decodes, bounded: at most DECODES at once, one per job however many
    ask for it at the same time (they share its answer), and at most WAITING jobs waiting
    beyond those (a 503 with Retry-After past them).

    Why: decoding a 36 MP PNG (a 370 KB file) takes ~300 MB for a moment; 20 requests for it
    at once took the api from 97 MB to 3.2 GB and answered 500 MemoryError. Nothing is kept
    after the answer, so a file rewritten since is read afresh (its digest checked again).
    """

    def __init__(self) -> None:
        self.slots = asyncio.Semaphore(DECODES)
        self.running: dict[str, asyncio.Future[bytes]] = {}

    async def run(self, key: str, read: Callable[[], bytes]) -> bytes:
        shared = self.running.get(key)
        if shared is None:
            if len(self.running) >= DECODES + WAITING:
                raise HTTPException(
                    503,
                    "too many images being drawn at once, try again shortly",
                    headers={"Retry-After": "2"},
                )
            shared = asyncio.ensure_future(self._decode(read))
            self.running[key] = shared
            shared.add_done_callback(lambda _: self.running.pop(key, None))
        # A client that goes away does not cancel the decode the others wait on.
        return await asyncio.shield(shared)

    async def _decode(self, read: Callable[[], bytes]) -> bytes:
        async with self.slots:
            return await run_in_threadpool(read)


def router(settings: Settings, client: Client) -> APIRouter:
    routes = APIRouter()
    decodes = Decodes()

    @routes.get(PREFIX + "documents/{document_id}", include_in_schema=False)
    def view_document(request: Request, document_id: str) -> HTMLResponse:
        return _page(request)

    @routes.get(PREFIX + "{job_id}", include_in_schema=False)
    def view_job(request: Request, job_id: str) -> HTMLResponse:
        return _page(request)

    @routes.get(
        "/jobs/{job_id}/image",
        tags=["jobs"],
        response_class=Response,
        dependencies=[Depends(declared_query)],
        responses={
            200: {"content": {"image/jpeg": {}}, "description": "the image the job read"},
            404: {"description": "no such job, or its image cannot be shown (detail says why)"},
        },
    )
    async def job_image(job_id: str) -> Response:
        """The job's image (a page job: its page, drawn from its document) as a JPEG of at
        most 3 MP, for the viewer: only a path image or upload under the api's own allowed
        roots whose SHA-256 is still the one the job read; 404 naming why otherwise."""
        try:
            key = str(uuid.UUID(job_id))
        except ValueError:
            raise HTTPException(404, "no such job") from None

        def read() -> bytes:
            row = client.store.get([key]).get(key)
            if row is None:
                raise HTTPException(404, "no such job")
            document: dict[str, Any] | None = None
            if row.get("page") is not None and row.get("document_id"):
                document = client.documents.get([row["document_id"]]).get(row["document_id"])
            try:
                return view_images.job_image(row, document, settings)
            except view_images.NotShown as exc:
                raise HTTPException(404, f"no image to show: {exc}") from None

        data = await decodes.run(key, read)
        return Response(data, media_type="image/jpeg", headers={"Cache-Control": "private"})

    return routes


def mount(app: FastAPI) -> None:
    app.mount(STATIC, StaticFiles(directory=FOLDER), name="viewer-static")
    # After the static files, which it would otherwise shadow.
    app.add_api_route(PREFIX + "{rest:path}", _no_such_page, include_in_schema=False)
