"""The wire contract between producers and workers.

Producers send `ocrq.recognize` with plain JSON kwargs and never import this project, so the
names and shapes here are the public API: change them only compatibly.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TASK_NAME = "ocrq.recognize"
DEFAULT_QUEUE = "ocr"

# The task names a job may ask for; any other task string is a free prompt. Each engine holds
# its own prompt for a name (HunyuanOCR's official ones per version:
# ocrq/models/hunyuan/prompts.py);
# a name the loaded model lacks fails its job.
TASKS = (
    "text", "spotting", "parse", "table", "formula", "subtitles",  # HunyuanOCR 1.0 and 1.5
    "spotting_json", "layout", "layout_parse", "chart",  # 1.5 only
    "translate_doc_zh", "translate_en", "translate_zh",
)  # fmt: skip
# A job's optional cap on the pixels the model sees: one 32x32 block up to 4096² (1.5's limit).
MAX_PIXELS_RANGE = (32 * 32, 4096 * 4096)
# The most new tokens a job may ask for, and a worker's OCRQ_MAX_NEW_TOKENS too (one bound, so
# the api never accepts a cap the worker would refuse).
MAX_NEW_TOKENS_LIMIT = 131_072

# A job's lane: interactive jobs go to their own queue (`queue_for`) and are admitted before
# bulk ones inside the worker (ocrq/core/lanes.py `LaneRule`); bulk is the default.
Priority = Literal["interactive", "bulk"]
INTERACTIVE: Priority = "interactive"
BULK: Priority = "bulk"
PRIORITIES: tuple[Priority, ...] = (INTERACTIVE, BULK)
INTERACTIVE_SUFFIX = ".interactive"

JobStatus = Literal["queued", "running", "done", "failed", "cancelled", "expired"]
# A page job's row source is its document's source plus this mark and the page number.
PAGE_MARK = "#page="
MAX_DOCUMENT_PAGE = 1_000_000
MAX_NAME_CHARS = 8400  # a reference of up to 8192 characters plus a page mark
NAME_REFUSED = (
    "image.name is set by ocrq for a document's page jobs only: a producer cannot name a job "
    "(its row shows the path, the redacted URL or b64:<chars>)"
)

DOCUMENT_REFUSED = (
    "image.document is set by ocrq for the page jobs of a document it stored only: it names "
    "no page of that document here"
)

MAX_BATCH_CHARS = 128  # a producer's batch name (ocr_jobs.batch, migrations/0008)

# Query parameters whose values are secrets in common signed/tokened URLs (S3 and GCS presigned
# URLs, OAuth access tokens, API keys): masked wherever a URL is shown or stored.
_SECRET_PARAM = re.compile(r"sig|token|key|secret|passw|pwd|auth|credential|session", re.I)
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def redact_url(url: str) -> str:
    """The URL as it may be stored, logged and shown: `user:pass@` becomes `***@`, and values of
    query parameters named like secrets (signature, token, key, ...) become `***`.

    The rest of the query stays, so a user can still tell which object a failed job named.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # unparseable (a bad IPv6 literal, say): strip anything like userinfo
        return _USERINFO.sub(r"\1***@", url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _redact_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}=***" if eq and _SECRET_PARAM.search(name) else param


_URLSAFE = str.maketrans("-_", "+/")


def b64_body(text: str) -> str:
    """The base64 of an inline image with its wrapping taken off: producers send it line-wrapped
    (MIME), as a `data:image/...;base64,` URL, in the URL-safe alphabet or without padding, and
    each of those is the same image. Returns the standard alphabet, unpadded; ValueError for a
    data: URL that is not base64-encoded.

    One rule for the worker (ocrq/intake/images.py) and the api, so the api refuses exactly
    the payloads a worker would fail."""
    body = text.strip()
    if body[:5].lower() == "data:":
        header, comma, body = body.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ValueError("invalid base64 image: a data: URL must be ';base64,' encoded")
    return "".join(body.split()).translate(_URLSAFE).rstrip("=")


def decode_b64_body(body: str) -> bytes:
    """The bytes of a `b64_body`; ValueError naming why it is not base64 (never its text)."""
    try:
        return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64 image: {exc}") from None


EMPTY_IMAGE = "image is empty (0 bytes): 'b64' holds no data"


class ImageRef(BaseModel):
    """Where the image comes from: exactly one of a path, a URL or inline base64."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = None
    url: str | None = None
    b64: str | None = None
    # One page (1-based) of a document (PDF, multi-page TIFF) named by path, URL or b64: a
    # page job. A document's own splitting job sends these; a producer may send one too.
    page: Annotated[int | None, Field(ge=1, le=MAX_DOCUMENT_PAGE)] = None
    # What the job's row calls this image instead of the reference itself: a page of a URL or
    # inline document travels inline as a one-page document, named after its document's page.
    # Set by ocrq's document splitting only: a worker honours it only for a page row its
    # document already recorded under that name (NAME_REFUSED otherwise), and the api refuses
    # it, so no producer can give a job a name that reads like another file's path.
    name: Annotated[str | None, Field(max_length=MAX_NAME_CHARS)] = None
    # A page of a URL or inline document whose bytes ocrq stored once, when it split it (the
    # document's id; ocrq/core/documents_store.py): what its page jobs name instead of
    # carrying the document again, each of them. Set by ocrq's document splitting only: a
    # worker honours it only on that document's own page row (DOCUMENT_REFUSED otherwise).
    document: str | None = None

    @field_validator("document")
    @classmethod
    def _document_id(cls, value: str | None) -> str | None:
        return None if value is None else canonical_job_id(value)

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageRef:
        given = [k for k in ("path", "url", "b64", "document") if getattr(self, k)]
        if not given and self.b64 == "":  # e.g. Client.submit(b""): not a missing field
            raise ValueError(EMPTY_IMAGE)
        if not given and "" in (self.path, self.url):
            raise ValueError(f"image {'path' if self.path == '' else 'url'} is empty")
        if len(given) != 1:
            raise ValueError("image must give exactly one of 'path', 'url' or 'b64'")
        if self.document is not None and self.page is None:
            raise ValueError("image.document names a stored document: 'page' is needed too")
        return self

    def describe(self) -> str:
        """A short, loggable description of the source: never the inline bytes, never a URL's
        credentials (this is what the job's row stores and the API returns)."""
        if self.name:
            return self.name
        if self.path:
            where = self.path
        elif self.url:
            where = redact_url(self.url)
        elif self.document:
            where = f"document:{self.document}"
        else:
            where = f"b64:{len(self.b64 or '')} chars"
        return where if self.page is None else f"{where}{PAGE_MARK}{self.page}"

    def unnamed(self) -> ImageRef:
        """The same image without its `name`: what a refused name's row is recorded under."""
        return self.model_copy(update={"name": None})

    def reference(self) -> dict[str, Any] | None:
        """The image exactly as submitted, for re-sends from its row (`ocrq requeue`, the stall
        sweep): the path or the whole URL, credentials included (the row's `reference` column,
        never shown; `source` is the redacted display), and the page. None for inline bytes: a
        row holds none, so an inline job's own message is its only copy. Never the `name`:
        the display name is not a reference. A stored document's page is one: its bytes are
        kept while its document may need them (docs/documents.md)."""
        for key in ("path", "url", "document"):
            value = getattr(self, key)
            if value:
                return {key: value} if self.page is None else {key: value, "page": self.page}
        return None


def queue_for(priority: str, queue: str = DEFAULT_QUEUE) -> str:
    """The broker queue of a lane: `ocr.interactive` for interactive jobs, `ocr` for bulk ones
    (with OCRQ_QUEUE=`q`: `q.interactive` and `q`). Workers consume the interactive queue first."""
    return f"{queue}{INTERACTIVE_SUFFIX}" if priority == INTERACTIVE else queue


def lane_of_queue(queue: object) -> Priority:
    """The lane a message's queue stands for, when its kwargs name none."""
    return INTERACTIVE if isinstance(queue, str) and queue.endswith(INTERACTIVE_SUFFIX) else BULK


def canonical_job_id(value: object) -> str:
    """The one spelling of a job id, used for rows, task ids and messages alike.

    `uuid.UUID` accepts braces, `urn:uuid:`, upper case and no dashes; stored as given, those
    spellings made separate rows for one job. Raises ValueError for anything that is not a UUID.
    """
    if isinstance(value, uuid.UUID):
        return str(value)
    if not isinstance(value, str) or len(value) > 64:
        raise ValueError("job_id must be a UUID string")
    return str(uuid.UUID(value))


def message_job_id(kwargs: object, task_id: object) -> str:
    """The job an `ocrq.recognize` message runs: its kwargs' `job_id` when given, else its
    Celery task id, canonical (`canonical_job_id`). Raises ValueError when that is no UUID.

    One rule for every place that names a message's job before the task runs (the holder
    entry, ocrq/worker/broker.py; an expired message's row, ocrq/worker/tasks.py): two
    spellings of it could name one message's job two ways."""
    given = kwargs.get("job_id") if isinstance(kwargs, dict) else None
    return canonical_job_id(given or task_id)


def require_storable(value: str, what: str) -> str:
    """PostgreSQL text holds neither NUL nor a lone surrogate (not UTF-8): refuse them here, so
    the job fails with a clear error instead of its row failing to be written at all."""
    if "\x00" in value:
        raise ValueError(f"{what} contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} contains a lone surrogate (not valid Unicode text)") from None
    return value


def storable_text(value: object, limit: int = 200) -> str:
    """Any value as text a row can hold: NUL and lone surrogates escaped, length capped.

    For what a refused request is recorded under (its source and task)."""
    text = value if isinstance(value, str) else repr(value)
    text = text[:limit].replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class JobRequest(BaseModel):
    """One job: the only spelling of its fields. The kwargs of an `ocrq.recognize` message are
    `message()`, its row's columns `columns()`, a re-send from its row `from_row()`; the api's
    `JobIn` takes its fields from here (ocrq/api/schemas.py) and a document's page jobs are
    copies of their document's request (ocrq/intake/splitting.py). A new field added here
    travels every one of those ways without another edit (tests/test_job_request.py)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    image: ImageRef
    task: Annotated[str, Field(min_length=1, max_length=4000)] = "text"
    job_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    # Optional: fewer pixels than the engine's per-task default (or more, up to the model's).
    max_pixels: Annotated[int | None, Field(ge=MAX_PIXELS_RANGE[0], le=MAX_PIXELS_RANGE[1])] = None
    # Optional: the job's own cap on new tokens, within the worker's OCRQ_MAX_NEW_TOKENS (a word
    # crop needs few; the running loop frees its slot when it is reached).
    max_new_tokens: Annotated[int | None, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] = None
    # Its lane: "interactive" jobs are admitted before "bulk" ones (FIFO within a lane; a bulk
    # job is never starved: ocrq/core/lanes.py `LaneRule`).
    priority: Priority = BULK
    # Optional: the producer's own grouping of jobs (`GET /batches/{batch}`, `ocrq wait`,
    # `ocrq export --batch`). Not `batch_id`, which names the engine batch that ran the job.
    batch: Annotated[str | None, Field(min_length=1, max_length=MAX_BATCH_CHARS)] = None
    # The user re-run this message belongs to (`ocrq retry` sends the row's count of re-runs):
    # a failed row runs again only for a new re-run, never for a late copy of an old message.
    retry: Annotated[int, Field(ge=0, le=1_000_000)] = 0

    # Fields every message names even at their default, so a message reads as the README's.
    ALWAYS_SENT: ClassVar[tuple[str, ...]] = ("image", "task", "job_id")
    # Fields whose ocr_jobs column has another name (`image` is stored as `reference`, the
    # image exactly as submitted, and shown as `source`).
    COLUMN_OF: ClassVar[dict[str, str]] = {"job_id": "id", "retry": "retries"}
    # Set by ocrq itself, never by a producer through the api (`ocrq retry` bumps it).
    INTERNAL: ClassVar[tuple[str, ...]] = ("retry",)

    @field_validator("job_id", mode="before")
    @classmethod
    def _canonical_id(cls, value: object) -> str:
        return canonical_job_id(value)  # ValueError -> a clear validation error

    @field_validator("task")
    @classmethod
    def _storable_task(cls, value: str) -> str:
        return require_storable(value, "task")

    @field_validator("batch")
    @classmethod
    def _storable_batch(cls, value: str | None) -> str | None:
        return None if value is None else require_storable(value, "batch")

    @model_validator(mode="after")
    def _storable_image(self) -> JobRequest:
        for key in ("path", "url", "b64", "name"):
            value = getattr(self.image, key)
            if value is not None:
                require_storable(value, f"image.{key}")
        return self

    @property
    def prompt(self) -> str:
        """The free prompt a VLM sees, when the task names none of TASKS; else "" (the engine
        holds the named task's own prompt)."""
        return "" if self.task in TASKS else self.task

    def message(self) -> dict[str, Any]:
        """The `ocrq.recognize` kwargs of this job (plain JSON), to send to
        `queue_for(self.priority)`: every field but those at their default, which the worker
        fills in again (image, task and job id always)."""
        fields = self.model_dump(mode="json", exclude_none=True)
        for name, field in type(self).model_fields.items():
            if name not in self.ALWAYS_SENT and name in fields and fields[name] == field.default:
                del fields[name]
        return fields

    def columns(self) -> dict[str, Any]:
        """The job's own columns of its ocr_jobs row (what a producer records before sending):
        every field, so that `from_row` sends the same job again."""
        row = {
            self.COLUMN_OF.get(name, name): getattr(self, name)
            for name in type(self).model_fields
            if name != "image"
        }
        row["source"] = self.image.describe()
        row["reference"] = self.image.reference()
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JobRequest:
        """The job its row records, for a re-send (`ocrq requeue`, `ocrq retry`, the recovery
        sweep): the image exactly as submitted and every field of `columns()`; a NULL column (a
        row from before it existed) is the field's default. Raises ValueError for a row with
        no reference (an inline image: its row holds no bytes to send again)."""
        if row.get("reference") is None:
            raise ValueError(f"job {row.get('id')} has no reference: it cannot be re-sent")
        fields: dict[str, Any] = {"image": row["reference"]}
        for name in cls.model_fields:
            value = row.get(cls.COLUMN_OF.get(name, name))
            if name != "image" and value is not None:
                fields[name] = value
        return cls.model_validate(fields)


def job_kwargs(image: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """send_task kwargs for one job, validated (`JobRequest(...).message()`); a producer may
    equally write this dict by hand (send it to `queue_for(priority)`)."""
    given = {k: v for k, v in fields.items() if v is not None}  # None: the field's default
    return JobRequest.model_validate({"image": image, **given}).message()
