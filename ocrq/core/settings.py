"""One typed settings object, read from OCRQ_* variables once and passed down, declared as groups.

Nothing deep in the code reads the environment: tests and embedded mode build a Settings of
their own and hand it in.

Each field is declared once, in the group it belongs to (IntakeSettings, BatchingSettings,
DeliverySettings, ApiSettings, and one group per engine: HunyuanSettings, VllmSettings,
OpenAISettings). `Settings` inherits every group, so it stays flat: one `OCRQ_<FIELD>` variable
per field, validated once, and `settings.max_batch` works as before. `settings.hunyuan` (and
`.intake`, `.batching`, ...) is that group's typed view of the validated values: an engine is
built from its own group only (ocrq/models/registry.py) and cannot read the api's token or the
broker's URL. Why flat at the root rather than nested models: every OCRQ_* name, every
`settings.<field>` access and every `Settings(field=...)` in tests and benches keeps working,
and a field moves between groups without renaming its variable.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal, Self, TypeVar

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ocrq.core.contract import MAX_NEW_TOKENS_LIMIT

# HunyuanOCR's generation loop: ocrq's own (ocrq/models/hunyuan/decode.py) or transformers'
# generate().
DecodeMode = Literal["fast", "generate"]
# The fast loop's decode attention: Triton on CUDA when installed ("auto"), or forced.
DecodeAttention = Literal["auto", "triton", "torch"]
KvCacheDtype = Literal["auto", "fp8"]
VisionGemmDtype = Literal["auto", "fp8"]
# The vision tower's attention: FlashAttention-4 where usable ("auto"), or forced
# (ocrq/models/hunyuan/vision_attention.py).
VisionAttention = Literal["auto", "fa4", "sdpa"]
PreprocessMode = Literal["tensor", "processor"]
# How rows share the device: whole batches run to their longest row ("static"), or the running
# loop, where finished rows leave at once and waiting ones take their slots ("continuous",
# ocrq/models/hunyuan/running.py).
Scheduler = Literal["auto", "static", "continuous"]
# When the running loop prefills waiting rows (ocrq/models/hunyuan/running.py says how each goes).
PrefillSchedule = Literal["alternate", "chunked"]
# Where HunyuanOCR's image-token numerics follow the code the model was trained with ("trained")
# or transformers' HunYuanVL ("transformers"); ocrq/models/hunyuan/fidelity.py says how they differ.
HunyuanNumerics = Literal["trained", "transformers"]
# Engine rapid's model sets: the names of ocrq/models/rapid/models.py's MODEL_SETS (a test keeps
# the two lists equal; core may not import the engine).
RapidModels = Literal["v6-small", "v4"]

G = TypeVar("G", bound="SettingsGroup")


class SettingsGroup(BaseModel):
    """A group of settings: declared as fields of its own, inherited by the flat `Settings`."""

    @classmethod
    def of(cls, settings: SettingsGroup) -> Self:
        """This group's fields of `settings` (the flat Settings, or any group that holds them),
        as this group alone: what a part that may see only this group keeps. `settings` itself
        when it is exactly this group; otherwise a copy of already validated values."""
        if type(settings) is cls:
            return settings
        return cls.model_construct(**{name: getattr(settings, name) for name in cls.model_fields})


class ServiceSettings(SettingsGroup):
    """Where the service's state lives (broker, database, results) and which engine and queue a
    worker serves: read by every process."""

    # The Celery broker (Redis): `redis://[:password@]host:port/db`, or Redis Sentinel for a
    # broker that survives losing its master, one `;`-separated entry per sentinel:
    # `sentinel://[:password@]host1:26379/db;sentinel://host2:26379` (the password and db of
    # the first entry are the master's), with OCRQ_BROKER_MASTER_NAME (docs/operations.md).
    broker_url: str = "redis://localhost:6379/0"
    # With a `sentinel://` broker: the name the sentinels monitor the master under (`sentinel
    # monitor <name> ...` in their config; kombu's `master_name` transport option). Required then.
    broker_master_name: str | None = None
    # With a `sentinel://` broker: the password of the sentinels themselves (their
    # `requirepass`; kombu's `sentinel_kwargs`), when they have one. The master's password is in
    # the URL.
    broker_sentinel_password: SecretStr | None = None
    # The job table's database (`ocrq run` uses --db, a temporary SQLite file by default).
    database_url: str = "postgresql+psycopg://postgres@127.0.0.1:5432/ocrq"
    # Off when OCRQ_DATABASE_URL points at PgBouncer in transaction mode (Debian 12's 1.18, or
    # any without `max_prepared_statements`): psycopg then prepares no statements, which such a
    # bouncer cannot follow from one server connection to the next. docs/operations.md.
    database_prepared_statements: bool = True
    # PostgreSQL connections each process keeps (a worker, the api): a worker's claim and
    # finish hold one for a statement each, so 10 are plenty (4 ran within the spread of 10's
    # runs: bench/results/control_plane/control_plane_cpu_run2.md). Overflow connections are opened
    # past the pool and closed when returned (a new PostgreSQL session every few jobs, half of
    # PostgreSQL's CPU in that bench): keep 0 unless the pool is the bottleneck.
    database_pool_size: int = Field(default=10, ge=1, le=1000)
    database_max_overflow: int = Field(default=0, ge=0, le=1000)
    # How long a starting worker waits for a database that does not answer (compose and
    # Kubernetes start it beside PostgreSQL), saying so once, before it exits 1 for its
    # supervisor to start it again.
    database_wait_s: float = Field(default=60.0, ge=0, le=3600)
    # A name of ocrq/models/registry.py's ENGINES: rapid, hunyuan, vllm or openai.
    engine: str = "rapid"
    # The queue workers consume (and `ocrq submit` and the api send to).
    queue: str = "ocr"
    # Also consume Celery's default queue `celery`, where a producer's bare
    # `send_task("ocrq.recognize", ...)` without `queue=` lands (it would wait there forever).
    # Turn off when the broker database is shared with another Celery app that uses that queue:
    # this worker would take (and drop as unregistered) that app's tasks. docs/producers.md.
    consume_default_queue: bool = True
    # Where each task's result (the job's result dict, or its failure) is kept, so that
    # `AsyncResult(job_id).get()` works for a bare Celery producer: "broker" (the broker's Redis,
    # the default), "none" (no result backend), or any Celery result-backend URL.
    result_backend: str = "broker"
    # How long a result stays in the backend; the job's row in PostgreSQL stays for good. An
    # hour: ~7.4 KB a job, so at ~30 images/s a GPU keeps ~0.8 GB in Redis (a day would be
    # ~19 GB; bench/results/control_plane/control_plane_cpu.md).
    result_expires_s: int = Field(default=3_600, ge=60, le=90 * 86_400)

    @model_validator(mode="after")
    def _sentinel_master(self) -> ServiceSettings:
        from ocrq.core.broker_redis import is_sentinel

        if is_sentinel(self.broker_url) and not (self.broker_master_name or "").strip():
            raise ValueError(
                "OCRQ_BROKER_URL is a sentinel:// URL: set OCRQ_BROKER_MASTER_NAME to the name "
                "the sentinels monitor the master under (`sentinel monitor <name> ...`)"
            )
        return self


class IntakeSettings(SettingsGroup):
    """What a job's image or document may be and where it may come from (ocrq/intake): the
    security surface, checked before anything is decoded."""

    # Path images.
    # Directories that {"path": ...} images may be read from. Empty: every path is refused, and
    # a worker will not start (nor with `/` among them) unless allow_any_path says so; there is
    # no fallback to the working directory, which is `/` under systemd. Separated by ':'
    # (os.pathsep), not ','. A worker logs its roots as it starts and warns of one that does
    # not exist (it still starts: a mount may come later) or that holds a comma.
    allowed_roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # The explicit opt-out: a worker may start with `/` among the roots, or with none (then `/`).
    allow_any_path: bool = False

    # Image intake limits: a job over them fails alone with a clear error.
    max_image_bytes: int = Field(default=50 * 1024 * 1024, ge=1, le=2**34)
    # 4961x7016 receipts (34.8 MP) pass.
    max_image_pixels: int = Field(default=40_000_000, ge=1, le=2_000_000_000)
    # Checked on the header before decoding: a 1x100000 strip costs nothing to refuse.
    max_image_side: int = Field(default=20_000, ge=1, le=1_000_000)
    # Longer side / shorter side. 200 passes a 13340x124 text line (108) with room to spare and
    # a 6400x32 line (about 300 characters at the smallest legible height); the engines tile
    # long strips, so intake only refuses absurd shapes.
    max_aspect_ratio: float = Field(default=200.0, ge=1.0, le=1_000_000.0)
    # Pillow formats Image.open may try (raster only: EPS would run Ghostscript).
    image_formats: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["PNG", "JPEG", "WEBP", "TIFF", "BMP", "GIF", "PPM"]
    )
    # Documents (PDF, multi-page TIFF; ocrq/intake/documents.py): one job per page.
    # More pages than this fail the whole document before any page job is sent.
    max_pdf_pages: int = Field(default=1000, ge=1, le=1_000_000)
    # A path document is read lazily, page by page, so it may be larger than an image.
    max_document_bytes: int = Field(default=1024**3, ge=1, le=2**40)
    # Render DPI of PDF pages. None: follow the engine's resolution preset for the job's task
    # (HunyuanOCR: an A4 page for `parse` at ~157 dpi), or 200 dpi for engines without one;
    # always within pdf_min_dpi..pdf_max_dpi. A page's size at that DPI meets the image caps
    # above before it is rendered.
    pdf_dpi: float | None = Field(default=None, ge=10, le=1200)
    pdf_min_dpi: float = Field(default=72.0, ge=10, le=1200)
    pdf_max_dpi: float = Field(default=300.0, ge=10, le=1200)
    # Pages are drawn in render processes (ocrq/intake/render_pool.py), each under this
    # address-space cap, for at most this many seconds a page: what a PDF bomb may cost. A
    # healthy page draws in 10-50 ms at 144-200 dpi (bench/results/documents); the cap leaves
    # room for the largest page the image caps admit (40 MP x 4 bytes) and PDFium's own needs.
    pdf_render_timeout_s: float = Field(default=20.0, gt=0, le=3600)
    pdf_render_max_bytes: int = Field(default=2 * 1024**3, ge=256 * 1024**2, le=2**40)
    # Render processes per worker process, started as pages need them.
    pdf_render_processes: int = Field(default=4, ge=1, le=64)
    url_timeout_s: float = Field(default=15.0, gt=0, le=600)  # per connect / read / write
    url_deadline_s: float = Field(default=30.0, gt=0, le=3600)  # whole fetch, redirects included
    url_max_redirects: int = Field(default=5, ge=0, le=20)  # each checked like the first request
    # Addresses URLs may reach although internal (loopback, private, link-local, ...): e.g.
    # "10.0.0.0/8,127.0.0.1/32". Empty: public addresses only.
    url_allow_networks: Annotated[list[ipaddress.IPv4Network | ipaddress.IPv6Network], NoDecode] = (
        Field(default_factory=list)
    )

    @field_validator("allowed_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(os.pathsep) if p] if value else []
        return value

    @field_validator("image_formats", mode="before")
    @classmethod
    def _split_formats(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            formats = [str(f).strip().upper() for f in value if str(f).strip()]
            from PIL import Image  # only when the setting is given: loading every plugin costs

            Image.init()
            unknown = [f for f in formats if f not in Image.OPEN]
            if unknown or not formats:
                raise ValueError(
                    f"unknown image formats {unknown}: choose among {', '.join(sorted(Image.OPEN))}"
                )
            return formats
        return value

    @field_validator("url_allow_networks", mode="before")
    @classmethod
    def _split_networks(cls, value: object) -> object:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            return [ipaddress.ip_network(str(v).strip(), strict=False) for v in value]
        return value


class BudgetSettings(SettingsGroup):
    """The batch cap and the memory budget. The batcher plans to them, and an engine that sizes
    its own loop or pool from them (HunyuanOCR's running loop, vLLM's KV cache) reads them too:
    every engine's group carries them, declared here once."""

    # Batch cap and memory budget.
    # Hard cap on images per engine call, whatever the budget allows; None: the knee `ocrq tune
    # --images` wrote into the tuned profile, else the engine's own
    # (`EngineCore.preferred_max_batch`: 256 for HunyuanOCR on a GPU, 32 otherwise).
    max_batch: int | None = Field(default=None, ge=1, le=4096)
    # Total memory the engine may use, fixed part included; None: the engine's default budget.
    memory_budget_gib: float | None = Field(default=None, gt=0, le=65_536)
    # Share of that budget batches are planned to; the rest is the allocator's slack.
    memory_utilization: float = Field(default=0.85, gt=0.1, le=1.0)


class BatchingSettings(BudgetSettings):
    """How the batcher gathers images into batches and how many a worker holds
    (ocrq/scheduling)."""

    # Batching.
    # How long the batcher lingers for more items once one is waiting.
    batch_wait_ms: int = Field(default=50, ge=0, le=60_000)
    # A bulk image waiting in the worker this long is admitted among the interactive ones, in
    # arrival order, so an interactive stream never starves the bulk lane (planner.py
    # `LaneRule`; docs/internals.md). Interactive jobs pass younger bulk ones until then.
    bulk_max_wait_s: float = Field(default=30.0, ge=0, le=86_400)
    # Where `ocrq tune` writes cost-model profiles and workers look for theirs at start.
    profile_dir: Path = Path("~/.cache/ocrq/profiles")
    # Celery task threads: images being fetched + waiting for the batcher; None: follow the
    # batch cap (`Runtime.task_threads`: two batches' worth plus room for fetching).
    concurrency: int | None = Field(default=None, ge=1, le=8192)
    # Decoded images held at once (waiting + in the running batch); None: two batches' worth,
    # i.e. the next batch is decoded while the current one runs. max_batch turns prefetch off.
    prefetch_images: int | None = Field(default=None, ge=1, le=100_000)


class DeliverySettings(SettingsGroup):
    """A worker's side of Celery delivery, its lifecycle (recycling, liveness, its process) and
    what happens after a job (callbacks, retention)."""

    # Delivery and lifecycle.
    # Redis redelivers a message not acked within this many seconds: keep it above the worst
    # delivery-to-ack time (96 s for the eval set on the 2-core CPU machine,
    # bench/results/service_accuracy/service_accuracy_rapid.md; docs/internals.md gives the GPU
    # estimate). The fault tests run at 20 s to recover quickly; a week is far past any sane
    # setting.
    visibility_timeout_s: int = Field(default=3600, ge=1, le=7 * 86_400)
    # Furthest ahead a message's ETA (or countdown) may be. A message held for its ETA stays
    # unacked, so Redis delivers it again every visibility timeout until then (an ETA in 9999
    # forever): one farther ahead fails its job at once (ocrq/worker/envelope.py). None: the
    # visibility timeout; at most that.
    max_eta_s: int | None = Field(default=None, ge=0, le=7 * 86_400)
    # Recycle the worker process after this many images ...
    max_images: int | None = Field(default=10_000, ge=1)
    # ... or when host RSS stays above this ...
    max_rss_gib: float | None = Field(default=None, gt=0, le=65_536)
    # ... or when device memory reserved but not allocated stays above this ...
    max_fragmentation_gib: float | None = Field(default=None, gt=0, le=65_536)
    # ... for this many readings in a row (taken after a batch, at most every 5 s).
    recycle_patience: int = Field(default=3, ge=1, le=10_000)
    # The worker's /metrics, /healthz and /readyz on this port when set (ocrq/worker/monitor.py),
    # served by the supervisor (across recycles) or, with --no-supervise, the worker itself.
    metrics_port: int | None = Field(default=None, ge=1, le=65_535)
    # Where they listen: loopback, so a bare host shows them to no one else; "0.0.0.0" where
    # Prometheus or a kubelet must reach a container from outside (the Dockerfile sets it).
    metrics_address: str = "127.0.0.1"
    # `ocrq worker` only: one worker process per GPU, "all" or indices "0,1" (ocrq/worker/gpus.py).
    gpus: str | None = None

    # Liveness (ocrq/worker/heartbeat.py). Each worker process refreshes its row in ocr_workers
    # every heartbeat_s; a worker silent for stalled_after_s is dead and its `running` jobs are
    # re-sent by `ocrq requeue --stalled` and by every live worker's sweep (every
    # stalled_sweep_s). stalled_after_s must cover a few missed beats (a GC pause, a slow
    # database), or a live worker's jobs would be run a second time (still one row).
    heartbeat_s: float = Field(default=10.0, ge=0.2, le=600)
    stalled_after_s: float = Field(default=60.0, ge=1.0, le=86_400)
    stalled_sweep_s: float = Field(default=30.0, ge=0.5, le=3600)

    # Poison messages and stuck jobs (issue 16).
    # Runs of a job that may kill its worker (its first run, then each retry, which runs alone
    # in its worker process: docs/faults.md) before the job is failed instead of run again: a
    # message that kills the worker can't loop.
    max_attempts: int = Field(default=3, ge=1, le=100)
    # Longest a job may take from its claim to its batch's result (a decoded-image slot, the
    # intake, the batch); then it fails with "timed out" and its task thread is free while the
    # batch runs on. Celery's task time limits do not work with the threads pool.
    job_timeout_s: float = Field(default=900.0, ge=1.0, le=86_400.0)
    # How long a job waits out a database that went away (a restart, a failover) before its
    # message goes back to the queue, unacked, for a later delivery to run it (docs/faults.md).
    db_retry_s: float = Field(default=300.0, ge=1.0, le=86_400.0)

    # Callbacks and retention (docs/producers.md, docs/operations.md).
    # A job's Celery `link`/`link_error` may call only tasks matching these fnmatch patterns
    # (e.g. "myapp.*"), never `ocrq.*` or `celery.*`; a job with any other link, a chain or a
    # chord fails without running. Empty: no links at all (ocrq/worker/links.py).
    link_tasks: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Webhooks (`callback_url` on a job): the key their HMAC-SHA256 signature is made with;
    # unset, the api refuses callback_url and workers send none. Set it on the api and workers.
    webhook_secret: SecretStr | None = None
    # Tries per webhook (the first included), and the wait before the first retry, doubling
    # each time (capped at 5 minutes): a receiver down for a few minutes still gets the call.
    webhook_attempts: int = Field(default=6, ge=1, le=50)
    webhook_backoff_s: float = Field(default=2.0, gt=0, le=3600)
    # Retention: the workers delete final jobs, documents and unreferenced uploads older than
    # this many days, once a day for the fleet (the first process to ask after the day is
    # over; ocrq/worker/retention_pass.py); None: kept forever (`ocrq prune`).
    retention_days: float | None = Field(default=None, gt=0, le=36_500)

    # Worker process.
    # The worker's GIL switch interval (sys.setswitchinterval), ms; None keeps Python's 5 ms.
    # A shorter one lets the thread that feeds the GPU take the GIL back sooner from the task
    # and preprocessing threads (bench/service_gpu.py compares).
    switch_interval_ms: float | None = Field(default=None, gt=0, le=100)
    # Run the worker's engine in a process of its own, fed decoded images through a pipe
    # (ocrq/engine_process/link.py): the thread that drives the GPU then shares its GIL with no
    # task thread, Celery consumer or database driver, and the worker never imports torch.
    # None (auto): on for HunyuanOCR where an NVIDIA GPU is present and the device is not the
    # CPU (on the H200 the service went from 0.92x the engine alone's images/s to 1.03-1.05x,
    # bench/results/service_gpu/service_gpu_reading.md, runs 10-11); off elsewhere.
    engine_process: bool | None = None

    @field_validator("link_tasks", mode="before")
    @classmethod
    def _split_link_tasks(cls, value: object) -> object:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        return value

    @model_validator(mode="after")
    def _liveness_margin(self) -> DeliverySettings:
        if self.stalled_after_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"OCRQ_STALLED_AFTER_S ({self.stalled_after_s}) must be at least three "
                f"heartbeats (OCRQ_HEARTBEAT_S={self.heartbeat_s}), or live workers look dead"
            )
        if self.max_eta_s is not None and self.max_eta_s > self.visibility_timeout_s:
            raise ValueError(
                f"OCRQ_MAX_ETA_S ({self.max_eta_s}) must not exceed OCRQ_VISIBILITY_TIMEOUT_S "
                f"({self.visibility_timeout_s}): a message held longer is delivered again"
            )
        return self

    @property
    def eta_bound_s(self) -> int:
        """How far ahead an ETA may be: OCRQ_MAX_ETA_S, else the visibility timeout."""
        return self.visibility_timeout_s if self.max_eta_s is None else self.max_eta_s

    @field_validator("gpus")
    @classmethod
    def _check_gpus(cls, value: str | None) -> str | None:
        """"all", or distinct GPU indices separated by commas (as nvidia-smi numbers them)."""
        if value is None or not value.strip():
            return None
        value = value.strip().lower()
        if value == "all":
            return value
        ids = [v.strip() for v in value.split(",")]
        if not all(v.isdigit() for v in ids) or len(set(map(int, ids))) != len(ids):
            raise ValueError(f"OCRQ_GPUS={value!r}: give `all` or distinct indices, e.g. 0,1")
        return ",".join(str(int(v)) for v in ids)


class ApiSettings(SettingsGroup):
    """The HTTP api's (ocrq/api): its auth, its request limits, its upload folder."""

    # HTTP api (ocrq/api/http.py).
    # The secret requests must send as `Authorization: Bearer <token>` (docs/api.md says which
    # paths are open without it): at least 16 characters, e.g. `openssl rand -hex 32`.
    # Without one the api refuses to start, unless api_allow_no_auth is set.
    api_token: SecretStr | None = None
    # Serve without a token: only for an api behind a proxy that authenticates every request
    # itself. A token, when set, is still required.
    api_allow_no_auth: bool = False
    # Largest request body, checked while it is read: a 50 MiB image in base64 is ~67 MiB.
    api_max_body_bytes: int = Field(default=70 * 2**20, ge=1024, le=2**31)
    # Where the api stores uploaded images (multipart and raw bodies), one file per content
    # hash. Set it on the api AND every worker, to one folder shared by all (a volume at the same
    # path): the worker reads it as one more allowed root, no OCRQ_ALLOWED_ROOTS needed for it,
    # and a worker without it fails an uploaded job with a message naming this setting. None:
    # the api refuses uploads (415); JSON jobs with a path, url or b64 still work.
    upload_dir: Path | None = None
    # /docs, /redoc and /openapi.json (assets served from the fastapi-offline wheel, no CDN):
    # "token" behind the bearer token like every path, "public" without it, "off" not served.
    # `ocrq api` on a loopback address sets "public" when this is not set (only this machine
    # reaches it).
    api_docs: Literal["token", "public", "off"] = "token"
    # Longest a long-poll (GET /jobs/{id}?wait=S, POST /jobs/lookup with wait) is held open.
    api_max_wait_s: float = Field(default=60.0, ge=0, le=3600)
    # Most jobs in one batch submit or bulk lookup, and rows in one page of GET /jobs.
    api_max_batch: int = Field(default=1000, ge=1, le=100_000)


class RapidSettings(SettingsGroup):
    """OCRQ_ENGINE=rapid: the CPU engine (ocrq/models/rapid)."""

    # The CPU engine rapid (OCRQ_ENGINE=rapid; docs/engines.md).
    # Its model set: "v6-small" (PP-OCRv6 small, multilingual) or "v4" (PP-OCRv4 mobile, the
    # earlier default, kept while v6 proves itself). Empty means "v6-small". Both ship inside
    # pinned wheels of the base install; nothing is downloaded. Measured on the shared eval set
    # in bench/results/rapid_models/; part of a tuned profile's key.
    rapid_models: RapidModels = "v6-small"

    @field_validator("rapid_models", mode="before")
    @classmethod
    def _default_when_empty(cls, value: object) -> object:
        empty = value is None or (isinstance(value, str) and not value.strip())
        return "v6-small" if empty else value


class ModelSettings(BudgetSettings):
    """The model an engine serves, the same for each of the HunyuanOCR engines (ocrq's own,
    in-process vLLM, an OpenAI-compatible server): the base of their groups."""

    # HunyuanOCR, whichever engine serves it. The repository's root holds 1.5 (since July
    # 2026); "v1.0" is the older model. Which version a checkpoint is comes from its
    # config.json (ocrq/models/hunyuan/versions.py).
    model: str = "tencent/HunyuanOCR"
    model_revision: str | None = None
    model_subfolder: str | None = None
    # Tokens generated at most per image; with the prompt it sizes the KV cache.
    max_new_tokens: int = Field(default=1024, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    # Per-task cap on the pixels the model sees, over the engine's defaults
    # (ocrq/models/hunyuan/resolution.py), e.g. "parse=2359296,spotting=4194304"; the task names of
    # ocrq.core.contract.TASKS, or "custom" for free prompts. The model's own limit always applies.
    task_max_pixels: Annotated[dict[str, int], NoDecode] = Field(default_factory=dict)
    # The model's weights and activations (in-process engines): a torch dtype, or "auto"
    # (bfloat16 on CUDA, else float32). Device "auto": cuda:0 when torch sees CUDA, else the
    # CPU; or e.g. "cuda:1".
    dtype: str = "bfloat16"
    device: str = "auto"
    # Static batches or the running loop (continuous batching; the fast loop only).
    # "auto": the running loop where its Triton attention runs (CUDA), static batches elsewhere
    # (on a CPU the loop's torch attention reads the whole KV pool every step: slower).
    scheduler: Scheduler = "auto"

    @field_validator("task_max_pixels", mode="before")
    @classmethod
    def _split_task_pixels(cls, value: object) -> object:
        if isinstance(value, str):
            pairs = [p.split("=", 1) for p in value.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError("OCRQ_TASK_MAX_PIXELS takes task=pixels pairs: parse=2359296,...")
            value = {k.strip(): v.strip() for k, v in pairs}
        return value

    @field_validator("task_max_pixels")
    @classmethod
    def _check_task_pixels(cls, value: dict[str, int]) -> dict[str, int]:
        from ocrq.core.contract import MAX_PIXELS_RANGE, TASKS

        unknown = sorted(set(value) - {*TASKS, "custom"})
        if unknown:
            raise ValueError(f"OCRQ_TASK_MAX_PIXELS: unknown tasks {unknown}")
        low, high = MAX_PIXELS_RANGE
        bad = sorted(k for k, v in value.items() if not low <= v <= high)
        if bad:
            raise ValueError(f"OCRQ_TASK_MAX_PIXELS: {bad} outside {low}..{high} pixels")
        return value


class HunyuanSettings(ModelSettings):
    """OCRQ_ENGINE=hunyuan: ocrq's own HunyuanOCR engine (ocrq/models/hunyuan)."""

    # HunyuanOCR in ocrq's own engine (OCRQ_ENGINE=hunyuan).
    # HunyuanOCR's attention implementation; "eager" is refused (13 GiB for one A4 page).
    attention: str = "sdpa"
    # HunyuanOCR's XD-RoPE layout for image tokens and its ViT position-table interpolation:
    # Tencent's training code by default; "transformers" reproduces transformers' (and vLLM's)
    # outputs. Text tokens and decode steps are the same either way.
    hunyuan_rope: HunyuanNumerics = "trained"
    hunyuan_vit_positions: HunyuanNumerics = "trained"
    # Which loop generates: "fast" (ocrq's, CUDA graphs and Triton kernels; same greedy tokens)
    # or "generate" (transformers'). Part of a tuned profile's key: each holds other memory.
    decode: DecodeMode = "fast"
    # The fast loop's decode attention; "torch" also turns the fused norm/RoPE kernels off.
    decode_attention: DecodeAttention = "auto"
    # The vision tower's attention: "auto" is FlashAttention-4 (`pip install 'ocrq[fa4]'`) on an
    # SM80/SM90/SM100 GPU, else SDPA; "fa4" fails to load where it cannot run; "sdpa" is
    # PyTorch's SDPA (cuDNN on Hopper), one call per run of equal-sized images.
    vision_attention: VisionAttention = "auto"
    # The vision tower's linear layers: "auto" (the model's dtype, as Tencent runs them) or
    # "fp8" (e4m3, per-row and per-channel scales; ocrq/models/hunyuan/vision_fp8.py), which
    # fails to load where it cannot run. Not recommended: on an H200 slower (an A4 page's tower
    # 39.7 against 36.9 ms) and 6x the error of two bf16 kernels (bench/results/vision_fp8/).
    vision_gemm_dtype: VisionGemmDtype = "auto"
    # The running loop's packed text prefill, its causal attention: "auto" is FlashAttention-4
    # where the vision tower could use it (the same install and GPUs), else torch's flash
    # varlen kernel; "fa4" fails to load where it cannot run; "sdpa" is torch's kernel.
    prefill_attention: VisionAttention = "auto"
    # The running loop's KV pool: "auto" (the model's dtype) or "fp8" (e4m3, no scale: half the
    # bytes a decode step reads and twice the rows a pool holds; ocrq/models/hunyuan/kv_cache.py).
    kv_cache_dtype: KvCacheDtype = "auto"
    # With an fp8 pool: the decode kernel multiplies in e4m3 (queries and probabilities rounded
    # to it too) instead of widening every key and value to fp16; two more roundings for a
    # kernel nearer its bandwidth floor (ocrq/models/hunyuan/attention.py, fp8_products). Not
    # recommended: no faster on an H100 or an H200, at 23x the error (bench/results/kv_attention).
    kv_fp8_products: bool = False
    # How HunyuanOCR's prefetch threads make a row's inputs: "tensor" (ocrq's torch ops, equal
    # output, GIL released) or "processor" (transformers' processor, for comparison).
    preprocess: PreprocessMode = "tensor"
    # The running loop: when it prefills ("alternate": one big pass once a quarter of the slots
    # are free; "chunked": a chunk before every decode step), and how many padded prompt tokens
    # a pass / a chunk holds (their activations are reserved in the memory budget).
    prefill_schedule: PrefillSchedule = "chunked"
    prefill_tokens: int = Field(default=16384, ge=256, le=1_048_576)
    # 16,384 packed tokens a chunk, a pass at most every 4 decode steps: fewer, fuller passes,
    # whose host cost is paid per pass (on an H200 1.06x the images/s of 4,096 and every step,
    # GPU busy 97% instead of 95%: bench/results/service_gpu/service_gpu_reading.md, run 16). Its
    # reserve is 2.5 GiB of activations instead of 0.6: lower it on a small GPU to keep the KV pool.
    prefill_chunk_tokens: int = Field(default=16384, ge=256, le=1_048_576)
    # "chunked": decode steps between prefill passes unless a pass is full or nothing decodes.
    prefill_gap_steps: int = Field(default=4, ge=1, le=1024)
    # Prefill passes with their rows packed end to end, no padding: a pass then costs the tokens
    # it holds (ocrq/models/hunyuan/packed.py). On by default: on an H200 the service's mix made
    # 1.23x the images/s of padded passes, the GPU busy 99% instead of 82%
    # (bench/results/service_gpu/service_gpu_reading.md, run 14); false is the padded prefill.
    prefill_packed: bool = True
    # Prefill passes on a second CUDA stream of low priority while decode steps go on on the
    # running loop's own stream of high priority: a memory-bound step overlaps the
    # compute-bound pass, and an interactive row's steps no longer wait behind a whole pass
    # (a pass's rows join at the first step after it is done; ocrq/models/hunyuan/passes.py).
    # Off: on an H200 it cost bulk throughput (0.75x against 0.88x with an interactive stream;
    # bench/results/lanes/lanes_h200_prefill_stream.md); on an H100 it gave bulk 0.818x against
    # 0.78x, and with OCRQ_INTERACTIVE_PASS_STEPS the best pair measured there (one run each;
    # bench/results/lanes/README.md). The tokens are the same either way.
    prefill_stream: bool = False
    # The interactive lane inside the running loop (ocrq/models/lane_pass.py; docs/internals.md).
    # Slots added to the loop that only interactive rows take, so one is prefilled in the next
    # pass however full of bulk rows the loop is; bulk keeps its OCRQ_MAX_BATCH slots. 8: the
    # H200 run's stream (2/s, ~1 s each alone) had ~2 live at once, 8 takes bursts of 4x that;
    # a slot's state is ~8 bytes per new token, and the step widens past OCRQ_MAX_BATCH only
    # while an interactive row holds a slot above the bulk ones (with
    # OCRQ_INTERACTIVE_EXTRA_STEPS they are the lowest slots instead: a full loop's step then
    # runs over all of them). 0: no reserve.
    interactive_slots: int = Field(default=8, ge=0, le=1024)
    # While an interactive row is live: decode steps after each full one over only the smallest
    # graphed bucket of slots holding every live interactive row (the reserve, the lowest
    # slots), so such a row makes up to 1 + this many tokens per full step instead of one
    # (a small step ~2 ms on an H200 against ~9 ms for a full loop's; bulk rows below that
    # bucket get the tokens too). Above 0 the reserved slots are the loop's lowest, bulk rows
    # take those above; an interactive row that finds the reserve full gets no such steps.
    # 4: on an H200 with a bulk backlog the interactive p95 was 2.6x its latency alone (6.8x
    # with 0) and the backlog ran at 0.75x its rate alone while the stream lasted (0.88x with
    # 0; bench/results/lanes/README.md). 0: none, for bulk throughput first.
    interactive_extra_steps: int = Field(default=4, ge=0, le=64)
    # With OCRQ_PREFILL_STREAM: while a prefill pass runs on its side stream and an interactive
    # row of the reserve is live, the loop runs interactive-only steps (a few rows, bound by
    # reading the weights) in the pass's shadow (bound by compute) instead of full steps, which
    # wait for the pass to land as they do without the stream; each pass still gets one full
    # step beside it. So an interactive row decodes while bulk passes run, using the bandwidth
    # they leave over. On an H100 (one run): interactive p95 2.80x its latency alone at bulk
    # 0.817x, against 2.98-3.70x at 0.78x with the defaults (bench/results/lanes/README.md).
    # Off until an H200 run settles it.
    interactive_pass_steps: bool = False
    # While an interactive row waits or decodes: bulk prompt tokens per prefill pass (the pass's
    # first bulk row always goes), so no pass between its decode steps is long. 4,096: ~3 A4
    # pages, a quarter of OCRQ_PREFILL_CHUNK_TOKENS, whose passes of A4 pages took ~55 ms on the
    # H200 beside decode steps of a few ms. 0: no lane budget.
    interactive_prefill_tokens: int = Field(default=4096, ge=0, le=1_048_576)
    # While an interactive row waits or decodes: decode steps between passes that admit bulk
    # rows, full or not (interactive rows go in the next pass regardless). 4: as
    # OCRQ_PREFILL_GAP_STEPS; with the budget above, at most ~1,000 bulk prompt tokens a step
    # on average while the lane is busy (no cap outside it).
    interactive_prefill_gap_steps: int = Field(default=4, ge=1, le=1024)
    # While an interactive row waits or decodes: at most this many live bulk rows (0: no cap).
    # Off: a cap shortens every step an interactive row waits for, but takes bulk throughput
    # directly; set it when the loop's figures (ocrq_loop_lane_decode_seconds /
    # ocrq_loop_lane_steps against an idle loop's step time) say the step, not the prefill
    # passes, is what an interactive row waits for.
    interactive_bulk_rows: int = Field(default=0, ge=0, le=4096)
    # Decode steps a bulk row waits inside the loop before interactive rows stop passing it and
    # the lane's limits stop holding it (the loop's half of OCRQ_BULK_MAX_WAIT_S). 256: ~2-3 s
    # of a full loop on an H200.
    loop_bulk_max_wait_steps: int = Field(default=256, ge=0, le=1_000_000)
    # Seconds the running loop may spend warming up before the worker is ready, on a GPU: a
    # made-up row through it (kernels compiled on first use, FlashAttention-4's ~3 s included)
    # and every decode bucket's CUDA graph captured, which its first jobs would otherwise wait
    # for while the GPU idles (ocrq/models/hunyuan/warm_up.py). A bucket not captured by then is
    # captured on its first use. 0: no warm-up.
    warmup_s: float = Field(default=60.0, ge=0, le=3600)


class VllmSettings(ModelSettings):
    """OCRQ_ENGINE=vllm: HunyuanOCR in vLLM, in the worker's process (ocrq/models/vllm)."""

    # vLLM in the worker (OCRQ_ENGINE=vllm; docs/engines.md).
    # Sequences in flight and tokens per scheduler step (vLLM's own knobs); the context a
    # sequence may take (None: the version's largest image + prompt + new tokens).
    vllm_max_num_seqs: int = Field(default=256, ge=1, le=65_536)
    vllm_max_num_batched_tokens: int = Field(default=16_384, ge=256, le=1_048_576)
    vllm_max_model_len: int | None = Field(default=None, ge=64, le=1_048_576)


class OpenAISettings(ModelSettings):
    """OCRQ_ENGINE=openai: HunyuanOCR behind an OpenAI-compatible server (ocrq/models/openai)."""

    # Remote HunyuanOCR (OCRQ_ENGINE=openai; docs/engines.md): an OpenAI-compatible server
    # (`vllm serve` of HunyuanOCR), e.g. http://gpu-1:8000/v1; the served model's name is
    # OCRQ_MODEL, its version OPENAI_VERSION.
    openai_url: str | None = None
    openai_api_key: SecretStr | None = None
    openai_version: Literal["1.0", "1.5"] = "1.5"
    openai_concurrency: int = Field(default=16, ge=1, le=4096)  # requests in flight per worker
    # One attempt, from sending the request to the answer's last byte (not per read).
    openai_timeout_s: float = Field(default=300.0, gt=0, le=86_400)
    # Largest answer read: a completion of 131,072 tokens, escaped, is a few MB.
    openai_max_response_bytes: int = Field(default=16 * 2**20, ge=1024, le=2**31)
    # How long connection errors and 5xx answers are retried (with backoff) before the job fails.
    openai_retry_s: float = Field(default=600.0, ge=0, le=86_400)


class Settings(
    ServiceSettings,
    IntakeSettings,
    BatchingSettings,
    DeliverySettings,
    ApiSettings,
    RapidSettings,
    HunyuanSettings,
    VllmSettings,
    OpenAISettings,
    BaseSettings,
):
    """Every group flat: one OCRQ_* variable per field, read and validated once per process."""

    # hide_input_in_errors: a bad setting's error must not print the others (tokens, passwords).
    model_config = SettingsConfigDict(env_prefix="OCRQ_", extra="ignore", hide_input_in_errors=True)

    def view(self, group: type[G]) -> G:
        """`group`'s fields of these (validated) settings, as a model of their own: what a part
        that needs only that group is given. A copy: changing it changes nothing here."""
        return group.of(self)

    @property
    def service(self) -> ServiceSettings:
        return self.view(ServiceSettings)

    @property
    def intake(self) -> IntakeSettings:
        return self.view(IntakeSettings)

    @property
    def batching(self) -> BatchingSettings:
        return self.view(BatchingSettings)

    @property
    def delivery(self) -> DeliverySettings:
        return self.view(DeliverySettings)

    @property
    def api(self) -> ApiSettings:
        return self.view(ApiSettings)

    @property
    def rapid(self) -> RapidSettings:
        return self.view(RapidSettings)

    @property
    def hunyuan(self) -> HunyuanSettings:
        return self.view(HunyuanSettings)

    @property
    def vllm(self) -> VllmSettings:
        return self.view(VllmSettings)

    @property
    def openai(self) -> OpenAISettings:
        return self.view(OpenAISettings)

    def roots(self) -> list[Path]:
        """Resolved allowed roots; `/` only when none are set and allow_any_path says so. The
        api's upload folder is always one of them: workers read what the api stored there."""
        roots = list(self.allowed_roots) or ([Path("/")] if self.allow_any_path else [])
        if self.upload_dir is not None:
            roots.append(self.upload_dir)
        return [p.expanduser().resolve() for p in roots]

    def root_warnings(self) -> list[str]:
        """What looks wrong in OCRQ_ALLOWED_ROOTS, one sentence each; said, not refused.

        A wrong root otherwise shows only as every path job failing "outside allowed roots",
        with nothing naming the setting's mistake. Not refused: a network mount may appear
        after the worker starts, and a folder name may hold a comma.
        """
        warnings = []
        for root in self.allowed_roots:
            if "," in str(root):
                warnings.append(
                    f"OCRQ_ALLOWED_ROOTS entry {str(root)!r} contains a comma: the list is "
                    f"separated by {os.pathsep!r}, not ',' (e.g. /srv/a{os.pathsep}/srv/b); "
                    "as given it names one folder"
                )
            if not root.expanduser().is_dir():
                warnings.append(
                    f"OCRQ_ALLOWED_ROOTS entry {str(root)!r} is not an existing folder: path "
                    "images under it fail until it exists (mounted later?); check the spelling"
                )
        return warnings

    def require_safe_roots(self) -> None:
        """Refuse a worker configuration that would read any file on the host.

        Raised at worker start-up, before any message is consumed: a missing OCRQ_ALLOWED_ROOTS
        used to mean the working directory, which is `/` under systemd.
        """
        if self.allow_any_path:
            return
        if not self.allowed_roots and self.upload_dir is None:
            raise ValueError(
                "OCRQ_ALLOWED_ROOTS is not set: set it to the folders that path images may be "
                f"read from ({os.pathsep!r}-separated), or OCRQ_ALLOW_ANY_PATH=true to allow any"
            )
        if Path("/") in self.roots():
            raise ValueError(
                "OCRQ_ALLOWED_ROOTS includes /: every file on the host would be readable; name "
                "the image folders instead, or set OCRQ_ALLOW_ANY_PATH=true to mean it"
            )


def result_backend_url(settings: Settings) -> str | None:
    """The Celery result backend the worker stores task results in, or None for none.

    "broker" follows the broker when it is Redis, through Sentinel too (a result is a few KiB
    kept for OCRQ_RESULT_EXPIRES_S), and means none for other brokers, which hold no results.
    """
    value = settings.result_backend.strip()
    if value.lower() in ("", "none", "off", "disabled"):
        return None
    if value.lower() == "broker":
        from ocrq.core.broker_redis import is_redis

        url = settings.broker_url
        return url if is_redis(url) else None
    return value
