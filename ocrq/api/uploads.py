"""Uploaded images on a folder that the api and every worker share (OCRQ_UPLOAD_DIR).

The api writes each upload once, under the SHA-256 of its bytes (`ab/abcdef...`), and sends the
worker an ordinary `{"path": ...}` job; the folder is one of the worker's allowed roots. Why:

- messages stay small (Redis holds references, never megabytes of base64);
- the row's `source` is the file's path, so `ocrq requeue` can send an uploaded job again;
- one file per content: the same image uploaded twice is stored once, and the same `job_id`
  with the same bytes names the same path, which is how an idempotent retry is recognised;
- a file appears under its final name only when complete (written beside it, then renamed), so a
  worker never reads half an upload.

Object storage maps onto this as a mounted bucket (s3fs / gcsfuse / a CSI driver) at the same
path on the api and the workers; docs/api.md says more. Files are never deleted here:
retention (ocrq/core/retention.py: `ocrq prune`, OCRQ_RETENTION_DAYS) removes old unreferenced ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from ocrq.core.upload_paths import upload_path

FILE_MODE = 0o644  # workers may run as another user of the same group or none
CHUNK = 1 << 20


RETRY_AFTER_S = "5"
MAX_NAME_CHARS = 255  # ocr_jobs.file_name (migrations/0012)


def display_name(raw: str | None) -> str | None:
    """The client's name for an upload, fit to show and nothing else: its last path part only
    (`C:\\scans\\a.png` and `../../a.png` are `a.png`), no control or unprintable characters
    (NUL, newlines, escapes, lone surrogates), at most 255 characters; None when nothing is
    left. Files are stored under their SHA-256 whatever this says; a job showed only that."""
    if not raw:
        return None
    name = raw.replace("\\", "/").rsplit("/", 1)[-1]
    name = "".join(c for c in name if c.isprintable()).strip()
    if name in ("", ".", ".."):
        return None
    return name[:MAX_NAME_CHARS]


class UploadTooLarge(Exception):
    pass


class UploadSlots:
    """How many uploads the api takes in at once (OCRQ_API_MAX_UPLOADS), one count for every
    route that takes one. Past it a request is refused with a 503 and Retry-After before a byte
    of its body is read: 64 slow 48 MiB documents at once had been buffered whole (47 x 500,
    3.78 GB of a 4 GiB cap). Counted on the event loop's thread only: no lock needed."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.taken = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        from fastapi import HTTPException

        if self.taken >= self.most:
            raise HTTPException(
                503,
                f"{self.most} uploads are being taken in already (OCRQ_API_MAX_UPLOADS): "
                f"try again in a few seconds",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        self.taken += 1
        try:
            yield
        finally:
            self.taken -= 1


async def checked_head(
    chunks: AsyncIterator[bytes], size: int, check: Callable[[bytes], None]
) -> AsyncIterator[bytes]:
    """The chunks as they come, with `check` run on the first `size` bytes (or all, if fewer)
    before any is passed on: a document's type is known from its head, so a body that is not
    one is refused before the rest is read or stored."""
    head, checked = b"", False
    async for chunk in chunks:
        if checked:
            yield chunk
            continue
        head += chunk
        if len(head) >= size:
            check(head)
            checked = True
            yield head
    if not checked:  # fewer than `size` bytes in all
        check(head)
        if head:
            yield head


class Uploads:
    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = folder.expanduser().resolve()
        self.max_bytes = max_bytes

    def path_for(self, digest: str) -> Path:
        return Path(upload_path(self.folder, digest))

    async def store(self, chunks: AsyncIterator[bytes]) -> Path:
        """Write the bytes to their content-addressed file and return its path.

        Raises UploadTooLarge as soon as more than max_bytes arrived (the partial file is
        removed); an empty body is stored too and fails its job on the worker like any other
        unreadable image.
        """
        incoming = self.folder / ".incoming"
        await run_in_threadpool(incoming.mkdir, parents=True, exist_ok=True)
        partial = incoming / uuid.uuid4().hex
        digest = hashlib.sha256()
        size = 0
        fh = await run_in_threadpool(partial.open, "wb")
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_bytes:
                    raise UploadTooLarge(f"image larger than {self.max_bytes} bytes")
                digest.update(chunk)
                await run_in_threadpool(fh.write, chunk)
            await run_in_threadpool(fh.flush)
            await run_in_threadpool(os.fsync, fh.fileno())
        except BaseException:
            fh.close()
            with contextlib.suppress(OSError):
                partial.unlink()
            raise
        fh.close()
        return await run_in_threadpool(self._publish, partial, digest.hexdigest())

    def _publish(self, partial: Path, digest: str) -> Path:
        final = self.path_for(digest)
        final.parent.mkdir(exist_ok=True)
        partial.chmod(FILE_MODE)
        # The same bytes again replace the first copy (atomically: a reader keeps the file it
        # opened). Always written, never only touched: the file is fresh before the job's row
        # names it, which is what lets retention keep an upload re-used while it prunes
        # (ocrq/core/retention.py); a touch could find the file just moved aside.
        os.replace(partial, final)
        return final

    async def store_bytes(self, data: bytes) -> Path:
        async def once() -> AsyncIterator[bytes]:
            yield data

        return await self.store(once())


async def stored_or_refused(uploads: Uploads, chunks: AsyncIterator[bytes]) -> Path:
    """`Uploads.store` with its failures as the answers a producer can act on: 413 past the
    size cap, 503 naming OCRQ_UPLOAD_DIR for a folder the api cannot write (was a 500)."""
    from fastapi import HTTPException

    try:
        return await uploads.store(chunks)
    except UploadTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except OSError as exc:  # a read-only or missing volume
        raise HTTPException(
            503,
            f"cannot store the upload in OCRQ_UPLOAD_DIR ({uploads.folder}): "
            f"{exc.strerror or type(exc).__name__}",
        ) from None
