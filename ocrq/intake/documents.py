"""Documents (PDF, multi-page TIFF): tell one from an image, count its pages, render one page.

A document is never held whole in memory as pixels: the splitting job only counts pages, and
each page job renders its own page in its task thread. A path document is read through the
same allowed-roots opener as images (ocrq/intake/images.py), lazily: PDFium and Pillow read the
parts of the file a page needs from the descriptor. A URL or inline document is read once by
its splitting job, which stores it once in the database; its page jobs name it and read it
from there (ocrq/intake/splitting.py, ocrq/intake/stored.py).

Each refusal is a DocumentError (an ImageError: the job fails alone with its message), raised
before the expensive step: the page count against OCRQ_MAX_PDF_PAGES before any page job is
made; a page's size at its render DPI against the image caps before it is rendered.

PDFs are read with pypdfium2 (PDFium, Chrome's renderer: maintained, permissive licence,
wheels with no system libraries). PDFium is not thread-safe, so every call into it in the worker
holds one process-wide lock; those calls only parse (open, count, size, copy a page). Drawing a
page, whose cost no parse can bound (a PDF bomb), happens in a render process under a memory
cap and a deadline (ocrq/intake/render_pool.py), outside the lock. A page renders in 10-50 ms at
144-200 dpi, far below an OCR page's time (bench/results/documents/documents_rapid.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import math
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image, ImageOps

from ocrq.core.contract import ImageRef
from ocrq.core.doc_formats import DocumentKind, claims_pdf, document_kind
from ocrq.core.pixel_budget import PixelBudget, Stage
from ocrq.core.settings import Settings
from ocrq.intake import images, render_pool
from ocrq.intake.images import ImageError, LoadedImage

log = logging.getLogger(__name__)

# Every call into PDFium holds this (the library keeps global state and is not thread-safe).
PDFIUM = threading.Lock()
DEFAULT_DPI = 200.0  # engines without a resolution preset (the CPU engine)
POINTS_PER_INCH = 72.0
# Reads a stored document's bytes by its id (ocrq/intake/stored.py); None: none stored.
Stored = Callable[[str], bytes | None]


class DocumentError(ImageError):
    """This document (or this page of it) cannot be processed; the message says why."""


@dataclass
class Document:
    """An opened document: a file read lazily (a path) or bytes (a URL or inline)."""

    kind: DocumentKind
    data: BinaryIO | bytes
    source: str  # the request's description, for messages

    def stream(self) -> BinaryIO:
        if isinstance(self.data, bytes):
            return io.BytesIO(self.data)
        self.data.seek(0)
        return self.data

    def close(self) -> None:
        if not isinstance(self.data, bytes):
            self.data.close()

    def __enter__(self) -> Document:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def take(ref: ImageRef, settings: Settings, stored: Stored | None = None) -> Document | bytes:
    """The request's bytes, read once: a Document, or an image's bytes for images.decode.

    A single-frame TIFF is an image; a file whose name says PDF but whose bytes do not is
    refused as such (rather than as "not an image"). `stored` reads a stored document's bytes
    (ocrq/intake/stored.py), for a page job that names one.
    """
    if ref.document:
        data = stored(ref.document) if stored is not None else None
        if data is None:
            raise DocumentError(
                f"the stored copy of document {ref.document} is gone (it goes when the "
                "document is done, cancelled or pruned): submit the document again"
            )
        kind = _document_kind(io.BytesIO(data))
        if kind is None:
            raise DocumentError(f"the stored copy of document {ref.document} is no document")
        return Document(kind, data, ref.describe())
    if ref.path:
        fh = images.open_path(ref.path, settings)
        try:
            kind = _document_kind(fh)
            if kind is None:
                if claims_pdf(ref.path):
                    raise DocumentError(f"not a PDF: {ref.describe()} has no %PDF- header")
                fh.seek(0)
                data = images.read_capped(fh, ref.path, settings.max_image_bytes)
                fh.close()
                if not data:
                    raise images.ImageError(f"empty image: {ref.describe()} has 0 bytes")
                return data
            size = os.fstat(fh.fileno()).st_size
            if size > settings.max_document_bytes:
                raise DocumentError(
                    f"document too large: {size} bytes > limit {settings.max_document_bytes} "
                    "(OCRQ_MAX_DOCUMENT_BYTES)"
                )
            return Document(kind, fh, ref.describe())
        except BaseException:
            fh.close()
            raise
    data = images.read_bytes(ref, settings)
    stream = io.BytesIO(data)
    kind = _document_kind(stream)
    if kind is not None:
        return Document(kind, data, ref.describe())
    if ref.url and claims_pdf(ref.url):
        raise DocumentError(f"not a PDF: {ref.describe()} has no %PDF- header")
    return data


def _document_kind(fh: BinaryIO) -> DocumentKind | None:
    fh.seek(0)
    kind = document_kind(fh.read(1024))
    if kind == "tiff" and _tiff_frames(fh, 2) < 2:
        kind = None  # one frame: an ordinary image
    fh.seek(0)
    return kind


def _tiff_frames(fh: BinaryIO, limit: int) -> int:
    """Frames of a TIFF, counted up to `limit` (IFD headers only, no pixel is decoded); 0 when
    Pillow cannot read it (the image path then says why)."""
    fh.seek(0)
    try:
        with _pillow_errors(), Image.open(fh, formats=["TIFF"]) as tiff:
            count = 1
            while count < limit:
                try:
                    tiff.seek(count)
                except EOFError:
                    break
                count += 1
            return count
    except Exception:
        return 0


@contextlib.contextmanager
def _pillow_errors() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


# ------------------------------------------------------------------------------------ whole


def digest(document: Document) -> str:
    """sha256 of the document's bytes, streamed (a path document is never read whole)."""
    if isinstance(document.data, bytes):
        return hashlib.sha256(document.data).hexdigest()
    fh = document.stream()
    h = hashlib.sha256()
    for chunk in iter(lambda: fh.read(1 << 20), b""):
        h.update(chunk)
    fh.seek(0)
    return h.hexdigest()


def count_pages(document: Document, settings: Settings) -> int:
    """Its page count, after the checks that fail the whole document: unreadable, encrypted,
    no pages, more than OCRQ_MAX_PDF_PAGES."""
    limit = settings.max_pdf_pages
    if document.kind == "pdf":
        with _pdf(document) as pdf:
            pages = len(pdf)
    else:
        pages = _tiff_frames(document.stream(), limit + 1)
        if pages == 0:
            raise DocumentError(f"corrupt or unreadable TIFF: {document.source}")
    if pages == 0:
        raise DocumentError(f"document has no pages: {document.source}")
    if pages > limit:
        shown = f"{pages}" if pages <= limit or document.kind == "pdf" else f"over {limit}"
        raise DocumentError(
            f"document has too many pages: {shown} > limit {limit} (OCRQ_MAX_PDF_PAGES): "
            f"{document.source}"
        )
    return pages


@contextlib.contextmanager
def _pdf(document: Document) -> Iterator[object]:
    """The PDF opened under the PDFium lock, closed before the lock is let go."""
    import pypdfium2 as pdfium

    with PDFIUM:
        try:
            pdf = pdfium.PdfDocument(document.stream())
        except pdfium.PdfiumError as exc:
            if _declares_no_pages(document):  # PDFium refuses to open a page-less PDF at all
                raise DocumentError(f"document has no pages: {document.source}") from None
            raise DocumentError(_pdf_refusal(str(exc), document.source)) from None
        try:
            yield pdf
        finally:
            pdf.close()


_NO_PAGES = re.compile(rb"/Type\s*/Pages\b[^>]*?/Count\s+0\b|/Count\s+0\b[^>]*?/Type\s*/Pages\b")


def _declares_no_pages(document: Document) -> bool:
    """Whether the page tree's root (in the first MiB, unencoded) says it has no pages."""
    return _NO_PAGES.search(document.stream().read(1 << 20)) is not None


def _pdf_refusal(error: str, source: str) -> str:
    if "password" in error.lower():
        return f"encrypted PDF: a password is needed to open {source} (ocrq takes none)"
    if "security" in error.lower():
        return f"encrypted PDF with an unsupported security handler: {source}"
    return f"corrupt or unreadable PDF: {source} ({error.removesuffix('.')})"


# ------------------------------------------------------------------------------------ pages


def page_dpi(
    width_pt: float,
    height_pt: float,
    pixels: int | None,
    settings: Settings,
    ceiling: int | None = None,
) -> float:
    """The DPI a PDF page renders at: OCRQ_PDF_DPI, else the one that draws the page at
    `pixels` (its pixel budget's render target: what the model sees), else DEFAULT_DPI, at
    most the one that draws it at `ceiling` pixels; within the min/max DPI, unless even the
    minimum would draw more than the image caps let in (`fitting_dpi`): a large-format page
    is then drawn below the minimum, as large as they allow (the model scales it down anyway),
    rather than refused. OCRQ_PDF_DPI is the operator's fixed choice and is never moved."""
    if settings.pdf_dpi is not None:
        return settings.pdf_dpi
    area_in2 = max((width_pt / POINTS_PER_INCH) * (height_pt / POINTS_PER_INCH), 1e-6)
    dpi = math.sqrt(pixels / area_in2) if pixels else DEFAULT_DPI
    if ceiling:
        dpi = min(dpi, math.sqrt(ceiling / area_in2))
    dpi = min(max(dpi, settings.pdf_min_dpi), settings.pdf_max_dpi)
    return min(dpi, fitting_dpi(width_pt, height_pt, settings, ceiling))


def fitting_dpi(
    width_pt: float, height_pt: float, settings: Settings, ceiling: int | None = None
) -> float:
    """The highest DPI whose bitmap meets the image caps the page's size is checked against
    (OCRQ_MAX_IMAGE_PIXELS, or `ceiling` where lower; OCRQ_MAX_IMAGE_SIDE), counting the pixel
    pypdfium2's rounding up may add to each side: with a, b the sides in inches,
    (a·d + 1)(b·d + 1) <= cap. Without that pixel a 33x47 in page drawn to exactly 40 MP came
    out at 40,009,518 pixels and was refused."""
    cap = min(settings.max_image_pixels, ceiling or settings.max_image_pixels)
    a = max(width_pt / POINTS_PER_INCH, 1e-6)
    b = max(height_pt / POINTS_PER_INCH, 1e-6)
    by_pixels = (-(a + b) + math.sqrt((a + b) ** 2 + 4 * a * b * (cap - 1))) / (2 * a * b)
    by_side = settings.max_image_side / max(a, b)
    return min(by_pixels, by_side)


def render_pdf_page(
    document: Document,
    page: int,
    settings: Settings,
    pixels: int | None,
    ceiling: int | None = None,
) -> Image.Image:
    """Page `page` (1-based) as RGB, drawn at about `pixels` (None: DEFAULT_DPI) and at most
    `ceiling` (`page_dpi`), its rendered size checked against the image caps first, drawn in a
    render process within OCRQ_PDF_RENDER_MAX_BYTES and OCRQ_PDF_RENDER_TIMEOUT_S."""
    with _pdf(document) as pdf:
        count = len(pdf)  # type: ignore[arg-type]
        _check_page_number(page, count, document.source)
        width_pt, height_pt = pdf.get_page_size(page - 1)  # type: ignore[attr-defined]
        dpi = page_dpi(width_pt, height_pt, pixels, settings, ceiling)
        if settings.pdf_dpi is None and dpi < settings.pdf_min_dpi:
            log.warning(
                "%s page %d (%.0fx%.0f in) drawn at %.1f dpi, below OCRQ_PDF_MIN_DPI (%g), "
                "to fit the image caps (OCRQ_MAX_IMAGE_PIXELS, OCRQ_MAX_IMAGE_SIDE)",
                document.source, page, width_pt / POINTS_PER_INCH, height_pt / POINTS_PER_INCH,
                dpi, settings.pdf_min_dpi,
            )  # fmt: skip
        scale = dpi / POINTS_PER_INCH
        # pypdfium2 sizes its bitmap as ceil(points x scale): the same arithmetic here.
        size = (math.ceil(width_pt * scale), math.ceil(height_pt * scale))
        _check_page_size(size, page, dpi, settings)
    renderer = render_pool.pool(
        render_pool.Budget(settings.pdf_render_max_bytes, settings.pdf_render_timeout_s),
        settings.pdf_render_processes,
    )
    try:
        if isinstance(document.data, bytes):
            image = renderer.render(page, scale, size, data=document.data)
        else:
            image = renderer.render(page, scale, size, fd=document.stream().fileno())
    except render_pool.RenderError as exc:
        raise DocumentError(f"{exc}: {document.source}") from None
    return images.to_rgb(image)


def tiff_frame(document: Document, page: int, settings: Settings) -> Image.Image:
    """Frame `page` (1-based) of a TIFF as RGB, its header checked before it is decoded."""
    fh = document.stream()
    try:
        with _pillow_errors(), Image.open(fh, formats=["TIFF"]) as tiff:
            try:
                tiff.seek(page - 1)
            except EOFError:
                count = _tiff_frames(document.stream(), settings.max_pdf_pages + 1)
                _check_page_number(page, count, document.source)
                raise
            images.check_header(*tiff.size, settings)
            tiff.load()
            frame = ImageOps.exif_transpose(tiff) or tiff
            return images.to_rgb(frame)
    except ImageError as exc:
        raise DocumentError(f"page {page}: {exc}") from None
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as exc:
        raise DocumentError(
            f"corrupt or truncated TIFF page {page}: {document.source} ({exc})"
        ) from None


def _check_page_number(page: int, count: int, source: str) -> None:
    if not 1 <= page <= count:
        raise DocumentError(f"no page {page} in {source}: it has {count} page(s)")


def _check_page_size(size: tuple[int, int], page: int, dpi: float, settings: Settings) -> None:
    try:
        images.check_header(*size, settings)
    except ImageError as exc:
        raise DocumentError(f"page {page} at {dpi:.0f} dpi: {exc}") from None


def load_page(
    ref: ImageRef, settings: Settings, budget: PixelBudget | None, stored: Stored | None = None
) -> LoadedImage:
    """A page job's image: page `ref.page` of its document, rendered here (this is the
    prefetch thread) at the pixels `budget` targets (`render_target`; None: the default DPI),
    within its render stage, then kept within its decode stage like an image
    (ocrq/core/pixel_budget.py). Page 1
    of a plain image is the image itself (one-frame TIFF pages travel as such)."""
    assert ref.page is not None
    budget = budget or PixelBudget()
    keep = budget.at(Stage.DECODE)
    source = ref.describe()
    taken = take(ref, settings, stored)
    if isinstance(taken, bytes):
        if ref.page != 1:
            raise DocumentError(f"no page {ref.page} in {source}: an image has one page")
        return images.decode(taken, settings, source, keep)
    with taken:
        if taken.kind == "pdf":
            image = render_pdf_page(
                taken, ref.page, settings, budget.render_target(), budget.at(Stage.RENDER)
            )
        else:
            image = tiff_frame(taken, ref.page, settings)
    # The page's pixels identify what the engine saw (hashing a large document per page
    # would cost more than rendering it).
    digest_ = hashlib.sha256(image.tobytes()).hexdigest()
    original = image.size
    if keep:
        image = images.downscale(image, keep)
    return LoadedImage(image=image, original_size=original, sha256=digest_, source=source)
