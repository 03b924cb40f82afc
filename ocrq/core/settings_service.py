"""What an operator sets for the service itself, whichever engine runs: where state lives,
what a job's input may be, how images are batched, how a worker takes and delivers jobs, and
the HTTP api. Each class is one group of ocrq/core/settings.py's `Settings`."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode

from ocrq.core.broker_urls import is_sentinel
from ocrq.core.lanes import BULK_MAX_WAIT_S
from ocrq.core.settings_group import SettingsGroup


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
    # address-space cap, for at most this many CPU seconds a page: what a PDF bomb may cost. A
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
    # (`EngineCore.preferred_max_batch`: 256 for HunyuanOCR on a GPU, 4 for `rapid`, 32 otherwise).
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
    # arrival order, so an interactive stream never starves the bulk lane (ocrq/core/lanes.py
    # `LaneRule`; docs/internals.md). Interactive jobs pass younger bulk ones until then. One
    # bound for the batcher and the running loop: a bulk row waiting this long in the loop's
    # queue is ordered with the interactive rows and no longer held by their lane's limits (it
    # replaced OCRQ_LOOP_BULK_MAX_WAIT_STEPS, counted in decode steps).
    bulk_max_wait_s: float = Field(default=BULK_MAX_WAIT_S, ge=0, le=86_400)
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
    # The queues a link may be sent to (fnmatch patterns; the producer's callback queues, e.g.
    # "myapp"): a link names one as `signature(name, queue=...)`; one naming another queue, an
    # exchange or a routing key, or none, fails its job like a link OCRQ_LINK_TASKS does not
    # name. Empty: no links at all.
    link_queues: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Webhooks (`callback_url` on a job): the key their HMAC-SHA256 signature is made with;
    # unset, the api refuses callback_url and workers send none; empty, nothing starts (a key of
    # b"" is one anyone can sign with). Set it on the api and workers.
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
    # Run the worker's engine in a process of its own, fed decoded images through a pipe
    # (ocrq/engine_process/link.py): the thread that drives the GPU then shares its GIL with no
    # task thread, Celery consumer or database driver, and the worker never imports torch.
    # None (auto): on for HunyuanOCR where an NVIDIA GPU is present and the device is not the
    # CPU (on the H200 the service went from 0.92x the engine alone's images/s to 1.03-1.05x,
    # bench/results/service_gpu/service_gpu_reading.md, runs 10-11); off elsewhere.
    engine_process: bool | None = None

    @field_validator("link_tasks", "link_queues", mode="before")
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
    # Most uploads (POST /jobs with a file or image body, POST /documents) taken in at once;
    # one more is a 503 with Retry-After before its body is read. Each streams to
    # OCRQ_UPLOAD_DIR, but an inline document (no folder) is held whole, ~2.4x its size.
    api_max_uploads: int = Field(default=8, ge=1, le=10_000)
    # Longest pause in a request body: a client that stops sending for this long gets a 408,
    # its connection is closed and its partial upload removed (they were held 150 s and more).
    api_body_idle_s: float = Field(default=30.0, gt=0, le=3600)

