"""The wire contract between producers and workers.

Producers send `ocrq.recognize` with plain JSON kwargs and never import this project, so the
names and shapes here are the public API: change them only compatibly.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

TASK_NAME = "ocrq.recognize"
DEFAULT_QUEUE = "ocr"

# HunyuanOCR's official prompts, verbatim: the model was trained on exactly these strings.
TASK_PRESETS: dict[str, str] = {
    "text": "提取图中的文字。",
    "spotting": "检测并识别图片中的文字，将文本坐标格式化输出。",
    "parse": (
        "提取文档图片中正文的所有信息用 markdown 格式表示，其中页眉、页脚部分忽略，"
        "表格用 html 格式表达，文档中公式用 latex 格式表示，按照阅读顺序组织进行解析。"
    ),
    "table": "把图中的表格解析为 HTML。",
    "formula": "识别图片中的公式，用 LaTeX 格式表示。",
    "subtitles": "提取图片中的字幕。",
}

JobStatus = Literal["queued", "running", "done", "failed"]


class ImageRef(BaseModel):
    """Where the image comes from: exactly one of a path, a URL or inline base64."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str | None = None
    url: str | None = None
    b64: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> ImageRef:
        given = [k for k in ("path", "url", "b64") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("image must give exactly one of 'path', 'url' or 'b64'")
        return self

    def describe(self) -> str:
        """A short, loggable description of the source (never the inline bytes)."""
        if self.path:
            return self.path
        if self.url:
            return self.url
        return f"b64:{len(self.b64 or '')} chars"


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

    @field_validator("job_id", mode="before")
    @classmethod
    def _canonical_id(cls, value: object) -> str:
        return canonical_job_id(value)  # ValueError -> a clear validation error

    @field_validator("task")
    @classmethod
    def _storable_task(cls, value: str) -> str:
        return _storable(value, "task")

    @model_validator(mode="after")
    def _storable_image(self) -> JobRequest:
        for key in ("path", "url", "b64"):
            value = getattr(self.image, key)
            if value is not None:
                _storable(value, f"image.{key}")
        return self

    @property
    def prompt(self) -> str:
        """The prompt a VLM sees: a preset's text, or the free prompt itself."""
        return TASK_PRESETS.get(self.task, self.task)


def job_kwargs(image: dict[str, str], task: str = "text", job_id: str | None = None) -> dict:
    """Build send_task kwargs; a producer may equally write this dict by hand."""
    return {
        "image": image,
        "task": task,
        "job_id": canonical_job_id(job_id) if job_id else str(uuid.uuid4()),
    }
