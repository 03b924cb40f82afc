"""The job runner's second stage: a claimed job's bytes to an item the batcher can run.

Fetch and decode happen in the task thread, before the batcher sees the job: this is the
prefetch (while the engine runs one batch, the next batch's images are read). The bytes are
an image (decoded within the job's pixel budget, then preprocessed by the engine here when it
prepares in this process), a page of a stored document (rendered at the budget's DPI), or a
document: then the job is split into page jobs (ocrq/intake/splitting.py) instead of run.

`prepare` says which with its return value (`Prepared`, `Refused` or a `documents.Document`):
a document used to be told apart by raising, an exception used for control flow in the middle
of the one `try` that turns a bad image into a failed job. Nothing here writes the job's row:
what becomes of a refused image or a split document is the completion's (ocrq/worker/
completing.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ocrq.core import metrics
from ocrq.core.contract import JobRequest
from ocrq.core.pixel_budget import Stage
from ocrq.core.settings import Settings
from ocrq.intake import documents, images, splitting
from ocrq.intake.stored import StoredDocuments
from ocrq.models.base import EngineFront, PreparedImage
from ocrq.worker.job_rows import JobRows


@dataclass(frozen=True)
class ImageFacts:
    """What the row keeps of the decoded image: stored with the job's outcome, whatever it is."""

    sha256: str
    width: int
    height: int

    def fields(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "width": self.width, "height": self.height}


@dataclass(frozen=True)
class Prepared:
    """An image ready for the batcher. The caller lets go of it once submitted (the item holds
    the pixels the model will see; the task thread must not keep them while it waits)."""

    item: PreparedImage
    facts: ImageFacts


@dataclass(frozen=True)
class Refused:
    """The job's bytes cannot run: a bad image or document, or one the engine's preprocessing
    refuses. The job fails with `error`."""

    error: str


class Preparing:
    def __init__(
        self,
        settings: Settings,
        engine: EngineFront,
        rows: JobRows,
        send_page: splitting.SendPage | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.rows = rows
        # Where a document's page jobs go (ocrq/intake/splitting.py): the broker, or `ocrq run`'s
        # own threads; built on first use, so image-only runs never connect for it.
        self._send_page = send_page
        # The bytes of URL and inline documents, which their page jobs name (stored once when
        # they were split): read once a document, kept for its next pages.
        self._stored = StoredDocuments(self._read_stored, max_bytes=2 * settings.max_image_bytes)

    def prepare(
        self, request: JobRequest, source: str, task: str
    ) -> Prepared | Refused | documents.Document:
        """The job's item (decoded, and preprocessed when the engine prepares here), the reason
        it cannot run, or the document it is (to be split, not run)."""
        try:
            with metrics.stage_timer("fetch_decode"):
                # The one budget of this image's pixels (ocrq/core/pixel_budget.py): the intake
                # asks it here, the engine and the planner ask it of the item.
                budget = replace(
                    self.engine.pixel_budget(task, request.max_pixels),
                    intake_limit=self.settings.max_image_pixels,
                )
                if request.image.page is not None:  # a page job: render its page here
                    loaded = documents.load_page(
                        request.image, self.settings, budget, self._stored.get
                    )
                else:
                    taken = documents.take(request.image, self.settings)
                    if isinstance(taken, documents.Document):
                        return taken
                    keep = budget.at(Stage.DECODE)
                    loaded = images.decode(taken, self.settings, source, keep)
            item = PreparedImage(
                key=request.job_id,
                image=loaded.image,
                original_size=loaded.original_size,
                task=task,
                prompt=request.prompt,
                job_cap=request.max_pixels,
                max_new_tokens=request.max_new_tokens,
                priority=request.priority,
            )
            if self.engine.prepares_here:  # else timed in the engine process
                with metrics.stage_timer("preprocess"):
                    self.engine.prepare(item)  # CPU preprocessing, in the prefetch thread
        except Exception as exc:  # bad image, or one the engine's preprocessing refuses
            message = (
                str(exc) if isinstance(exc, images.ImageError) else f"{type(exc).__name__}: {exc}"
            )
            return Refused(message)
        width, height = loaded.original_size
        return Prepared(item, ImageFacts(loaded.sha256, width, height))

    def split(self, request: JobRequest, document: documents.Document) -> int | Refused:
        """A document's page jobs made and sent: how many, or why it cannot be split. Its own
        row is the completion's to finish (`Completing.split_done`)."""
        if self._send_page is None:
            self._send_page = splitting.celery_sender(self.settings)
        try:
            with document:
                return self.rows.db(splitting.split)(
                    request,
                    document,
                    self.settings,
                    self.rows.documents,
                    self.rows.store,
                    self._send_page,
                )
        except documents.DocumentError as exc:
            return Refused(str(exc))

    def _read_stored(self, document_id: str) -> bytes | None:
        return self.rows.db(self.rows.documents.stored_bytes)(document_id)
