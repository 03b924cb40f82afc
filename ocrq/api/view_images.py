"""The image behind a job's result, as the viewer shows it: read only where the job read it.

The api reads a job's image again only when the row says exactly which file that was and the
file is still the one the job read: a path under the api's own allowed roots (OCRQ_ALLOWED_ROOTS
plus OCRQ_UPLOAD_DIR, so uploads always qualify), opened through the intake's path policy
(ocrq/intake/images.py: resolved, walked down from its root with O_NOFOLLOW, regular files
only), and whose SHA-256 is the one in the row (for a page, its document's). A row names a
file, so a job can never make the api read more than a job could; the hash check means a
renamed or rewritten file, or a producer's `name` standing for another file, shows nothing
rather than the wrong picture. URLs are not fetched again and inline images are not kept:
their boxes are drawn on a blank page of the row's size.

Decoding and rendering reuse the intake as the worker runs it (the header checks before
decoding, PDF pages drawn in a capped render process), which is why this module alone in the
api imports ocrq.intake (pyproject.toml, [tool.importlinter]). The browser gets a fresh JPEG,
never the stored bytes: whatever the file was, what reaches the page is a plain picture.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image

from ocrq.core.contract import PAGE_MARK, ImageRef
from ocrq.core.settings import Settings
from ocrq.intake import documents, images
from ocrq.intake.images import ImageError

# Largest picture sent to a browser: enough to read a page's words under their boxes.
VIEW_MAX_PIXELS = 3_000_000
JPEG_QUALITY = 88


class NotShown(Exception):
    """The api will not (or cannot) show this job's image; the message says why."""


def _decoded_path_image(row: dict[str, Any], settings: Settings) -> Image.Image:
    source = str(row["source"] or "")
    if not source.startswith("/"):
        raise NotShown(
            "the api keeps no copy of inline images and does not fetch URLs again; "
            "only path images and uploads are shown"
        )
    try:
        with images.open_path(source, settings) as fh:
            data = images.read_capped(fh, source, settings.max_image_bytes)
    except ImageError:
        raise NotShown(
            "the image is not readable by the api: it reads only files under its own "
            "OCRQ_ALLOWED_ROOTS and OCRQ_UPLOAD_DIR"
        ) from None
    loaded = images.decode(data, settings, source, VIEW_MAX_PIXELS)
    if loaded.sha256 != row["sha256"]:
        raise NotShown("the file changed since the job read it")
    return loaded.image


def _rendered_page(
    row: dict[str, Any], document: dict[str, Any], settings: Settings
) -> Image.Image:
    page = int(row["page"])
    source = str(document.get("source") or "")
    if not source.startswith("/") or PAGE_MARK in source:
        raise NotShown(
            "the api keeps no copy of inline documents and does not fetch URLs again; "
            "only path documents are shown"
        )
    try:
        taken = documents.take(ImageRef(path=source), settings)
    except ImageError:
        raise NotShown(
            "the document is not readable by the api: it reads only files under its own "
            "OCRQ_ALLOWED_ROOTS and OCRQ_UPLOAD_DIR"
        ) from None
    if isinstance(taken, bytes):
        raise NotShown("the file is no longer a document")
    with taken:
        if documents.digest(taken) != document.get("sha256"):
            raise NotShown("the document changed since the job read it")
        if taken.kind == "pdf":
            # Drawn at about the size the worker drew it (its row's pixels), capped for display.
            pixels = min(int(row["width"] or 0) * int(row["height"] or 0), VIEW_MAX_PIXELS)
            image = documents.render_pdf_page(taken, page, settings, pixels or None)
        else:
            image = documents.tiff_frame(taken, page, settings)
    if image.width * image.height > VIEW_MAX_PIXELS:
        image = images.downscale(image, VIEW_MAX_PIXELS)
    return image


def job_image(row: dict[str, Any], document: dict[str, Any] | None, settings: Settings) -> bytes:
    """The JPEG of a finished job's image (or page), or NotShown saying why there is none.

    `document` is the page's document row (None for an image job). Blocking: call it from a
    thread."""
    if row["status"] != "done":
        raise NotShown(f"the job is {row['status']}: only done jobs have an image to show")
    if row.get("page") is None and row.get("document_id") == row["id"]:
        # Its own row read no image, only the file it split: "the job is done: only done
        # jobs have an image to show" was said of it.
        raise NotShown(
            f"{row['id']} is a document: its pages have the images "
            f"(GET /documents/{row['id']}, or /view/documents/{row['id']})"
        )
    if not row.get("sha256"):
        raise NotShown("the job kept no digest of what it read: nothing to verify it by")
    try:
        if row.get("page") is not None:
            if document is None:
                raise NotShown("a page job sent without its document: nothing to verify it by")
            image = _rendered_page(row, document, settings)
        else:
            image = _decoded_path_image(row, settings)
    except ImageError as exc:  # read but refused now (caps, corrupt): the intake's own words
        raise NotShown(str(exc)) from None
    out = io.BytesIO()
    image.convert("RGB").save(out, "JPEG", quality=JPEG_QUALITY)
    return out.getvalue()
