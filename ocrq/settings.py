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
    # Share of that budget batches are planned to; the rest is the allocator's slack.
    memory_utilization: float = Field(default=0.85, gt=0.1, le=1.0)
    # Where `ocrq tune` writes cost-model profiles and workers look for theirs at start.
    profile_dir: Path = Path("~/.cache/ocrq/profiles")
    concurrency: int = 16  # Celery task threads: images being fetched + waiting for the batcher
    # Decoded images held at once (waiting + in the running batch); None: two batches' worth,
    # i.e. the next batch is decoded while the current one runs. max_batch turns prefetch off.
    prefetch_images: int | None = None

    # Delivery and lifecycle.
    # Redis redelivers a message not acked within this many seconds: keep it above the worst
    # delivery-to-ack time (bench/results/delivery_*.md measures it).
    visibility_timeout_s: int = 3600
    max_images: int | None = 10_000  # recycle the worker process after this many images
    max_rss_gib: float | None = None  # ... or when host RSS stays above this
    max_fragmentation_gib: float | None = None  # ... or device reserved-allocated stays above
    recycle_patience: int = 3  # consecutive batches over a threshold before recycling
    metrics_port: int | None = None  # Prometheus metrics on this port when set

    # Poison messages and stuck jobs (issue 16).
    # Claims of a job whose previous attempt never finished (its worker died under it) allowed
    # before the job is failed instead of run again: a message that kills the worker can't loop.
    max_attempts: int = Field(default=3, ge=1, le=100)
    # Longest a job may take from its claim to its batch's result (a decoded-image slot, the
    # intake, the batch); then it fails with "timed out" and its task thread is free while the
    # batch runs on. Celery's task time limits do not work with the threads pool.
    job_timeout_s: float = Field(default=900.0, ge=1.0, le=86_400.0)

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
