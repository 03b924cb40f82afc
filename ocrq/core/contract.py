"""The wire contract between producers and workers.

Producers send `ocrq.recognize` with plain JSON kwargs and never import this project, so the
names and shapes here are the public API: change them only compatibly.
"""

from __future__ import annotations

import re
import uuid
from typing import Annotated, Any, Literal
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

JobStatus = Literal["queued", "running", "done", "failed"]
# A page job's row source is its document's source plus this mark and the page number.
PAGE_MARK = "#page="
MAX_DOCUMENT_PAGE = 1_000_000
MAX_NAME_CHARS = 8400  # a reference of up to 8192 characters plus a page mark
MAX_BATCH_CHARS = 128  # a producer's batch name (ocr_jobs.batch, migrations/0006)

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
    name: Annotated[str | None, Field(max_length=MAX_NAME_CHARS)] = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageRef:
        given = [k for k in ("path", "url", "b64") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("image must give exactly one of 'path', 'url' or 'b64'")
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
        else:
            where = f"b64:{len(self.b64 or '')} chars"
        return where if self.page is None else f"{where}{PAGE_MARK}{self.page}"


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


def _storable(value: str, what: str) -> str:
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
    """The kwargs of one `ocrq.recognize` message, validated on the worker side."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    image: ImageRef
    task: Annotated[str, Field(min_length=1, max_length=4000)] = "text"
    job_id: str = Field(default_factory=lambda: str(uuid.uuid4()))
    # Optional: fewer pixels than the engine's per-task default (or more, up to the model's).
    max_pixels: Annotated[int | None, Field(ge=MAX_PIXELS_RANGE[0], le=MAX_PIXELS_RANGE[1])] = None
    # Optional: the job's own cap on new tokens, within the worker's OCRQ_MAX_NEW_TOKENS (a word
    # crop needs few; the running loop frees its slot when it is reached).
    max_new_tokens: Annotated[int | None, Field(ge=1, le=131_072)] = None
    # Optional: the producer's own grouping of jobs (`GET /batches/{batch}`, `ocrq wait`,
    # `ocrq export --batch`). Not `batch_id`, which names the engine batch that ran the job.
    batch: Annotated[str | None, Field(min_length=1, max_length=MAX_BATCH_CHARS)] = None
    # The user re-run this message belongs to (`ocrq retry` sends the row's count of re-runs):
    # a failed row runs again only for a new re-run, never for a late copy of an old message.
    retry: Annotated[int, Field(ge=0, le=1_000_000)] = 0

    @field_validator("job_id", mode="before")
    @classmethod
    def _canonical_id(cls, value: object) -> str:
        return canonical_job_id(value)  # ValueError -> a clear validation error

    @field_validator("task")
    @classmethod
    def _storable_task(cls, value: str) -> str:
        return _storable(value, "task")

    @field_validator("batch")
    @classmethod
    def _storable_batch(cls, value: str | None) -> str | None:
        return None if value is None else _storable(value, "batch")

    @model_validator(mode="after")
    def _storable_image(self) -> JobRequest:
        for key in ("path", "url", "b64", "name"):
            value = getattr(self.image, key)
            if value is not None:
                _storable(value, f"image.{key}")
        return self

    @property
    def prompt(self) -> str:
        """The free prompt a VLM sees, when the task names none of TASKS; else "" (the engine
        holds the named task's own prompt)."""
        return "" if self.task in TASKS else self.task


def resend_image(source: str, page: int | None = None) -> dict[str, object]:
    """The image reference of a job rebuilt from its row (path or URL; rows hold no inline
    bytes): a page job's row source ends in its page mark, which becomes `page` again."""
    mark = f"{PAGE_MARK}{page}"
    if page is not None and source.endswith(mark):
        source = source[: -len(mark)]
    key = "url" if source.startswith(("http://", "https://")) else "path"
    image: dict[str, object] = {key: source}
    if page is not None:
        image["page"] = page
    return image


def job_kwargs(
    image: dict[str, Any],
    task: str = "text",
    job_id: str | None = None,
    max_pixels: int | None = None,
    batch: str | None = None,
    retry: int = 0,
) -> dict:
    """Build send_task kwargs; a producer may equally write this dict by hand."""
    kwargs: dict = {
        "image": image,
        "task": task,
        "job_id": canonical_job_id(job_id) if job_id else str(uuid.uuid4()),
    }
    if max_pixels is not None:
        kwargs["max_pixels"] = max_pixels
    if batch is not None:
        kwargs["batch"] = batch
    if retry:
        kwargs["retry"] = retry
    return kwargs
