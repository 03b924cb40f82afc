"""The process that draws PDF pages for ocrq/intake/render_pool.py: PDFium with a memory cap.

A page's drawing cost is not bounded by its file size: 2 KB of nested Form XObjects draw 10^7
paths (GBs in seconds), 146 KB of line operations draw for minutes. No check before rendering
can tell, so the drawing runs here, in a process of its own under RLIMIT_AS, where running out
of memory (PDFium aborts) or time (the parent kills it) ends this process, never the worker.

Started as `python -m ocrq.intake.render_child <socket fd> <address-space bytes>`. It imports
only pypdfium2 and Pillow, never the worker's modules. One request at a time over a Unix socket
(ocrq/intake/render_wire.py frames them): the document (a file descriptor passed along, or its
bytes), the page and the scale; the answer is the page's raw pixels or an error line.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import socket
import sys

from ocrq.intake import render_wire

PR_SET_PDEATHSIG = 1


def _limit_memory(max_bytes: int) -> None:
    """Lower the address-space limit to `max_bytes` (never raise one a worker already has)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = max_bytes if hard == resource.RLIM_INFINITY else min(max_bytes, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _die_with_parent() -> None:
    """A worker killed with -9 takes its render processes along (Linux prctl)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _render(request: dict[str, object], fd: int | None, data: bytes) -> tuple[dict, bytes]:
    import pypdfium2 as pdfium

    source: object = os.fdopen(fd, "rb", closefd=True) if fd is not None else data
    try:
        pdf = pdfium.PdfDocument(source)
    except pdfium.PdfiumError as exc:
        return {"error": f"corrupt or unreadable PDF ({exc})"}, b""
    try:
        page = pdf[int(request["page"]) - 1]  # type: ignore[call-overload]
        try:
            bitmap = page.render(scale=float(request["scale"]), may_draw_forms=False)  # type: ignore[arg-type]
            image = bitmap.to_pil()
            pixels = image.tobytes()
            header = {"mode": image.mode, "size": list(image.size)}
            bitmap.close()
        finally:
            page.close()
    finally:
        pdf.close()
        if fd is not None and hasattr(source, "close"):
            source.close()  # type: ignore[union-attr]
    return header, pixels


def main(argv: list[str]) -> int:
    sock_fd, max_bytes = int(argv[0]), int(argv[1])
    _die_with_parent()
    _limit_memory(max_bytes)
    sock = socket.socket(fileno=sock_fd)
    import pypdfium2  # noqa: F401  (loaded once, before the first page's clock starts)

    while True:
        got = render_wire.receive(sock)
        if got is None:  # the worker closed its end: it is stopping
            return 0
        request, fds, data = got
        try:
            header, pixels = _render(request, fds[0] if fds else None, data)
        except MemoryError:
            return 3  # the parent reports the budget; nothing is left to answer with
        except Exception as exc:  # PDFium refused the page: an answer, not a crash
            header, pixels = {"error": f"{type(exc).__name__}: {exc}"}, b""
        render_wire.send(sock, header, pixels)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
