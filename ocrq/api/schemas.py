"""The HTTP api's request and response bodies, as pydantic models: they are the OpenAPI schema.

Every request field is checked here with the worker's own rules (ocrq.core.contract), so a
request the worker would refuse is a 422 at the door, never a 500 or a row that cannot be stored.
"""

from __future__ import annotations

import copy
import datetime as dt
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from ocrq.core.contract import (
    EMPTY_IMAGE,
    MAX_BATCH_CHARS,
    NAME_REFUSED,
    ImageRef,
    JobRequest,
    b64_body,
    canonical_job_id,
    decode_b64_body,
    require_storable,
)

MAX_REF_CHARS = 8192  # a path or URL longer than this is not a real reference
DEFAULT_MAX_ITEMS = 1000  # OCRQ_API_MAX_BATCH's default; `capped` builds the configured models



def _storable_batch(value: str | None) -> str | None:
    return None if value is None else require_storable(value, "batch")


# A batch name as a route reads it (path, query or body): a NUL cannot be stored or looked up
# in PostgreSQL text, and was a 500 on five routes; now the 422 says so.
StoredBatch = Annotated[str, AfterValidator(_storable_batch)]
# The producer's grouping of jobs; not `batch_id`, the engine batch that ran a job.
BatchName = Annotated[
    str | None, Field(min_length=1, max_length=MAX_BATCH_CHARS), AfterValidator(_storable_batch)
]
Status = Literal["queued", "running", "done", "failed", "cancelled", "expired"]
# A document (PDF, multi-page TIFF) is shown by its own job id; `partial`: some pages failed.
JobStatus = Status | Literal["partial"]


# The job fields a producer sets through the api: JobRequest's own, with its types, limits and
# defaults (`retry`, which ocrq sets, is left out; `job_id` is JobIn's own, optional), so the
# api and the worker cannot disagree on what a job is, and a field added to JobRequest is an
# api field too (tests/test_job_request.py).
JOB_FIELDS = {
    name: (field.annotation, copy.deepcopy(field))
    for name, field in JobRequest.model_fields.items()
    if name not in (*JobRequest.INTERNAL, "job_id")
}
_JobFields = create_model("_JobFields", __module__=__name__, **JOB_FIELDS)  # type: ignore[call-overload]


# What JobIn adds to a job's fields: how it is delivered.
DELIVERY_FIELDS = ("expires_at", "callback_url")


def _is_http(url: str) -> bool:
    return url.lower().startswith(("http://", "https://"))


def validation_messages(exc: ValidationError) -> str:
    """A model's errors as one line, without pydantic's "Value error, " prefixes."""
    return "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())


def _http_callback(value: str | None) -> str | None:
    """A job's or a batch's webhook: http(s) only (the address policy is checked when sent)."""
    if value is not None and not _is_http(value):
        raise ValueError("callback_url must be an http or https URL")
    return value


class JobIn(_JobFields):  # type: ignore[misc,valid-type]
    """One job. `job_id` (a UUID) makes a retry idempotent: the same id with the same image
    and task returns the job already recorded; with another image it is a 409."""

    model_config = ConfigDict(extra="forbid")

    job_id: str | None = None  # absent: the api makes one up
    # A deadline: a job not started by then is never run and ends `expired` (Celery's
    # `expires`). A time without a zone is UTC.
    expires_at: dt.datetime | None = None
    # A webhook: POSTed the job's outcome, signed, once its row is final (docs/api.md).
    callback_url: Annotated[str | None, Field(max_length=MAX_REF_CHARS)] = None

    @field_validator("job_id")
    @classmethod
    def _canonical(cls, value: str | None) -> str | None:
        return None if value is None else canonical_job_id(value)

    @field_validator("expires_at")
    @classmethod
    def _aware(cls, value: dt.datetime | None) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.UTC)
        return value

    _http = field_validator("callback_url")(_http_callback)

    @field_validator("image")
    @classmethod
    def _readable(cls, image: ImageRef) -> ImageRef:
        """What no worker could ever read would be queued and fail only in the worker: the
        producer hears it now, and nothing is recorded or sent. A relative path (a worker
        reads paths on its own machine), a URL other than http(s) (ocrq/intake/fetch.py), and
        inline bytes that are not base64, by the worker's own decoder rule (contract.b64_body,
        so every form it takes still passes)."""
        if image.path is not None and not image.path.startswith("/"):
            raise ValueError(
                "image.path must be absolute: a worker reads it on its own machine, under "
                "OCRQ_ALLOWED_ROOTS"
            )
        if image.url is not None and not _is_http(image.url):
            raise ValueError("image.url must be an http or https URL")
        if image.b64 is not None:
            try:
                data = decode_b64_body(b64_body(image.b64))
            except ValueError as exc:
                raise ValueError(f"image.b64: {exc}") from None
            if not data:  # a bare data: URL, or only whitespace
                raise ValueError(EMPTY_IMAGE)
        return image

    @model_validator(mode="after")
    def _storable(self) -> JobIn:
        image: ImageRef = self.image
        if image.name is not None:
            raise ValueError(NAME_REFUSED)
        for name in ("path", "url"):
            value = getattr(image, name)
            if value and len(value) > MAX_REF_CHARS:
                raise ValueError(f"image.{name} is longer than {MAX_REF_CHARS} characters")
        try:  # NUL, lone surrogates, ...: the worker's rules, as a 422 that echoes no value
            self.request()
        except ValidationError as exc:
            raise ValueError(validation_messages(exc)) from None
        return self

    def request(self) -> JobRequest:
        """The job itself: its JobRequest fields, validated by the worker's own model."""
        fields = self.model_dump(include={*JOB_FIELDS, "job_id"}, exclude_none=True)
        return JobRequest.model_validate(fields)


class BatchIn(BaseModel):
    """Many jobs in one request: recorded all or none, then sent."""

    model_config = ConfigDict(extra="forbid")

    # The cap is in the schema so that a longer list fails on its length alone, before any item
    # is validated: checked after the items, a list of a million bad items was a million errors.
    jobs: Annotated[list[JobIn], Field(min_length=1, max_length=DEFAULT_MAX_ITEMS)]
    # The batch of every job that names none of its own; when absent the api makes one up
    # (a UUID) and returns it.
    batch: BatchName = None
    # The batch's webhook: POSTed once, signed, when every job of the batch is final, with
    # the batch's counts (batch.finished, docs/api.md). Each job's own is its `callback_url`.
    callback_url: Annotated[str | None, Field(max_length=MAX_REF_CHARS)] = None

    _http = field_validator("callback_url")(_http_callback)


class Accepted(BaseModel):
    job_id: str
    # False: the id was already recorded for this image and task (a retry); nothing was sent.
    created: bool
    status: Status


class BatchAccepted(BaseModel):
    jobs: list[Accepted]
    batch: str  # `GET /batches/{batch}` follows it


class RetryIn(BaseModel):
    """Which failed jobs to run again: those of `batch`, or those of `job_ids`, or both
    filters at once. One of them is required (a re-run of every failed job is
    `ocrq retry --all`)."""

    model_config = ConfigDict(extra="forbid")

    status: Literal["failed"] = "failed"
    batch: BatchName = None
    job_ids: Annotated[list[str] | None, Field(min_length=1, max_length=DEFAULT_MAX_ITEMS)] = None

    @field_validator("job_ids")
    @classmethod
    def _canonical_ids(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else [canonical_job_id(v) for v in value]

    @model_validator(mode="after")
    def _one_filter(self) -> RetryIn:
        if self.batch is None and self.job_ids is None:
            raise ValueError("name a batch or job_ids")
        return self


class Retried(BaseModel):
    job_ids: list[str]  # the jobs sent again (a failed inline job is never re-run)
    # Each named job id not sent again, and why: "no such job", "done, not failed", an inline
    # image whose bytes were not kept.
    not_retried: dict[str, str] = {}


class BatchOut(BaseModel):
    """A batch: its units of work (images and documents' pages) by status, its documents,
    its times, and an ETA from its own measured completion rate."""

    batch: str
    final: bool
    total: int
    finished: int
    jobs: dict[str, int]
    images: dict[str, int]
    pages: dict[str, int]
    documents: dict[str, int]
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    first_finished_at: dt.datetime | None = None
    last_finished_at: dt.datetime | None = None
    rate_per_s: float | None = None
    eta_s: float | None = None


class BatchCancelled(BatchOut):
    """A batch after DELETE /batches/{id}: `cancelled` counts the jobs this request cancelled."""

    cancelled: int


class LookupIn(BaseModel):
    """Many job ids at once; with `wait`, answered once all are final or `wait` s passed."""

    model_config = ConfigDict(extra="forbid")

    job_ids: Annotated[list[str], Field(min_length=1, max_length=DEFAULT_MAX_ITEMS)]
    # Any length: capped at OCRQ_API_MAX_WAIT_S, as docs/api.md says (above 3600 was a 422).
    wait: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.0

    @field_validator("job_ids")
    @classmethod
    def _storable_ids(cls, ids: list[str]) -> list[str]:
        """An id that is not a UUID has no row and is answered `unknown`, but one with a NUL or
        a lone surrogate can be neither looked up nor echoed as UTF-8 (both were a 500)."""
        for job_id in ids:
            require_storable(job_id, "job id")
        return ids


def capped(max_items: int) -> tuple[type[BatchIn], type[LookupIn]]:
    """BatchIn and LookupIn with their lists capped at OCRQ_API_MAX_BATCH (the schema then
    states the cap as `maxItems`)."""
    batch = create_model(
        "BatchIn",
        __base__=BatchIn,
        __doc__=BatchIn.__doc__,
        jobs=(Annotated[list[JobIn], Field(min_length=1, max_length=max_items)], ...),
    )
    lookup = create_model(
        "LookupIn",
        __base__=LookupIn,
        __doc__=LookupIn.__doc__,
        job_ids=(Annotated[list[str], Field(min_length=1, max_length=max_items)], ...),
    )
    return batch, lookup


class JobOut(BaseModel):
    """A job's row. `status` "unknown" only in bulk lookups, for ids with no row."""

    job_id: str
    status: JobStatus | Literal["unknown"]
    path: str | None = None
    text: str | None = None
    # {text, box: [x1, y1, x2, y2] in the original image's pixels, score, and a label for
    # layout regions and figures}
    lines: list[dict[str, Any]] = []
    error: str | None = None
    truncated: Literal["max_tokens", "repetition"] | None = None
    # An upload's name on the producer's side (display only: `path` is where it is stored)
    file_name: str | None = None
    task: str | None = None
    max_pixels: int | None = None
    max_new_tokens: int | None = None  # the job's own cap; None: the worker's
    priority: str | None = None  # its lane; None: a row from before it was kept (bulk)
    engine: str | None = None
    worker: str | None = None
    attempts: int | None = None
    retries: int | None = None  # user re-runs (`ocrq retry`); attempts counts every run
    batch: str | None = None  # the producer's batch
    batch_id: str | None = None  # the engine batch that ran it
    sha256: str | None = None
    width: int | None = None
    height: int | None = None
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    # A page job: its document and page number (1-based). A document's own job: its pages.
    document_id: str | None = None
    page: int | None = None
    pages: int | None = None
    pages_final: int | None = None
    pages_failed: int | None = None
    page_results: list[dict[str, Any]] | None = None
    expires_at: dt.datetime | None = None
    callback_url: str | None = None


class CancelOut(JobOut):
    """The job's row after DELETE /jobs/{id}: `cancelled` True when this request cancelled it."""

    cancelled: bool = False


class JobList(BaseModel):
    jobs: list[JobOut]
    # Pass as `cursor` for the next page; None on the last one.
    next_cursor: str | None = None


class JobsFound(BaseModel):
    """POST /jobs/lookup's answer: the ids asked for, all of them (no pages, so no cursor)."""

    jobs: list[JobOut]
