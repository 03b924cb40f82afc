"""One typed settings object, read from OCRQ_* variables once and passed down.

Nothing deep in the code reads the environment: tests and embedded mode build a Settings of
their own and hand it in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    # hide_input_in_errors: a bad setting's error must not print the others (tokens, passwords).
    model_config = SettingsConfigDict(env_prefix="OCRQ_", extra="ignore", hide_input_in_errors=True)

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

    # Liveness (worker/heartbeat.py). Each worker process refreshes its row in ocr_workers
    # every heartbeat_s; a worker silent for stalled_after_s is dead and its `running` jobs are
    # re-sent by `ocrq requeue --stalled` and by every live worker's sweep (every
    # stalled_sweep_s). stalled_after_s must cover a few missed beats (a GC pause, a slow
    # database), or a live worker's jobs would be run a second time (still one row).
    heartbeat_s: float = Field(default=10.0, ge=0.2, le=600)
    stalled_after_s: float = Field(default=60.0, ge=1.0, le=86_400)
    stalled_sweep_s: float = Field(default=30.0, ge=0.5, le=3600)

    # HTTP api (api/http.py). Without a token the api refuses to start, unless
    # api_allow_no_auth says an authenticating proxy stands in front of it.
    api_token: SecretStr | None = None
    api_allow_no_auth: bool = False
    # Largest request body, checked while it is read: a 50 MiB image in base64 is ~67 MiB.
    api_max_body_bytes: int = Field(default=70 * 2**20, ge=1024, le=2**31)

    # HunyuanOCR.
    model: str = "tencent/HunyuanOCR"
    model_revision: str | None = None
    model_subfolder: str | None = "v1.0"
    max_new_tokens: int = 1024
    attention: str = "sdpa"
    dtype: str = "bfloat16"
    device: str = "auto"

    @model_validator(mode="after")
    def _liveness_margin(self) -> Settings:
        if self.stalled_after_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"OCRQ_STALLED_AFTER_S ({self.stalled_after_s}) must be at least three "
                f"heartbeats (OCRQ_HEARTBEAT_S={self.heartbeat_s}), or live workers look dead"
            )
        return self

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p] if value else []
        return value

    def roots(self) -> list[Path]:
        """Resolved allowed roots; the working directory when none are configured."""
        return [p.expanduser().resolve() for p in (self.allowed_roots or [Path.cwd()])]
