"""Which bytes are a document (PDF, TIFF) rather than an image, from their first bytes.

Shared by the worker (which splits documents into page jobs) and the api (which refuses an
upload that is neither before anything is queued). Decided by content, never by a file name:
a name only says what a file claims to be.
"""

from __future__ import annotations

from typing import Literal

DocumentKind = Literal["pdf", "tiff"]
# PDF 1.7 (ISO 32000-1, 7.5.2) lets readers find the header anywhere in the first 1024 bytes.
PDF_HEADER_WINDOW = 1024
_TIFF_MAGIC = (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+")  # classic and BigTIFF


def document_kind(head: bytes) -> DocumentKind | None:
    """ "pdf", "tiff" (a document only when it has several pages) or None."""
    if b"%PDF-" in head[:PDF_HEADER_WINDOW]:
        return "pdf"
    if head[:4] in _TIFF_MAGIC:
        return "tiff"
    return None


def claims_pdf(name: str) -> bool:
    """Whether a path or URL names a PDF (its last path component ends in .pdf)."""
    path = name.split("?", 1)[0].split("#", 1)[0]
    return path.lower().endswith(".pdf")
