"""One typed settings object, read from OCRQ_* variables once and passed down.

Nothing deep in the code reads the environment: tests and embedded mode build a Settings of
their own and hand it in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OCRQ_", extra="ignore")

    broker_url: str = "redis://localhost:6379/0"
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/ocrq"
    engine: str = "rapid"
    queue: str = "ocr"
    # Directories that {"path": ...} images may be read from; empty means the current directory.
    allowed_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)

    # Image intake limits: a job over them fails alone with a clear error.
    max_image_bytes: int = 50 * 1024 * 1024
    max_image_pixels: int = 40_000_000  # 4961x7016 receipts (34.8 MP) still pass
    url_timeout_s: float = 15.0

    # Batching.
    max_batch: int = 32  # hard cap on images per engine call, whatever the budget allows
    batch_wait_ms: int = 50  # how long the batcher lingers for more items once one is waiting
    memory_budget_gib: float | None = None  # None: the engine's default budget
    concurrency: int = 16  # Celery task threads: images being fetched + waiting for the batcher

    # HunyuanOCR.
    model: str = "tencent/HunyuanOCR"
    model_revision: str | None = None
    model_subfolder: str | None = "v1.0"
    max_new_tokens: int = 1024
    attention: str = "sdpa"
    dtype: str = "bfloat16"
    device: str = "auto"

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p] if value else []
        return value

    def roots(self) -> list[Path]:
        """Resolved allowed roots; the working directory when none are configured."""
        return [p.expanduser().resolve() for p in (self.allowed_roots or [Path.cwd()])]
