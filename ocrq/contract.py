"""The wire contract between producers and workers.

Producers send `ocrq.recognize` with plain JSON kwargs and never import this project, so the
names and shapes here are the public API: change them only compatibly.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

TASK_NAME = "ocrq.recognize"
DEFAULT_QUEUE = "ocr"

# The task names a job may ask for; any other task string is a free prompt. Each engine holds
# its own prompt for a name (HunyuanOCR's official ones: models/hunyuan/prompts.py).
TASKS = ("text", "spotting", "parse", "table", "formula", "subtitles")

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


class JobRequest(BaseModel):
    """The kwargs of one `ocrq.recognize` message, validated on the worker side."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    image: ImageRef
    task: Annotated[str, Field(min_length=1, max_length=4000)] = "text"
    job_id: str = Field(default_factory=lambda: str(uuid.uuid4()))

    @model_validator(mode="after")
    def _valid_id(self) -> JobRequest:
        uuid.UUID(self.job_id)  # raises ValueError with a clear message
        return self

    @property
    def prompt(self) -> str:
        """The free prompt a VLM sees, when the task names none of TASKS; else "" (the engine
        holds the named task's own prompt)."""
        return "" if self.task in TASKS else self.task


def job_kwargs(image: dict[str, str], task: str = "text", job_id: str | None = None) -> dict:
    """Build send_task kwargs; a producer may equally write this dict by hand."""
    return {"image": image, "task": task, "job_id": job_id or str(uuid.uuid4())}
