"""Wire settings -> engine -> batcher -> job runner, once per process.

The Celery app and embedded mode both build a Runtime; it is created after Celery has set up
its pool, in the process that will run the engine, so CUDA is never initialised before a fork.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ocrq.core import metrics
from ocrq.core.db import engine_for
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.engine_process.link import EngineLink, RemoteBatcher
from ocrq.intake.splitting import SendPage
from ocrq.models.base import EngineFront
from ocrq.models.costs import GiB
from ocrq.models.memory import memory_of
from ocrq.scheduling.engine_side import load_engine
from ocrq.scheduling.recycle import RecyclePolicy, Recycler
from ocrq.scheduling.vocabulary import Batcher, BatchRecord
from ocrq.worker.broker import set_holder
from ocrq.worker.gpus import has_nvidia_gpu
from ocrq.worker.heartbeat import Heartbeat, unique_worker_name
from ocrq.worker.jobs import JobRunner
from ocrq.worker.retention_pass import RetentionPass

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    engine: EngineFront
    batcher: Batcher
    runner: JobRunner
    recycler: Recycler | None = None
    heartbeat: Heartbeat | None = None
    retention: RetentionPass | None = None

    @property
    def task_threads(self) -> int:
        """How many task threads keep this runtime's batches full (see `task_threads`)."""
        return task_threads(self.settings, self.runner.prefetch_images)

    def close(self) -> None:
        # Each step logged: a warm shutdown that hangs says where.
        log.info("shutdown: stopping the batcher (%d rows waiting)", self.batcher.pending())
        self.batcher.stop()
        log.info("shutdown: closing the engine")
        self.engine.close()
        if self.heartbeat is not None:  # after the batcher: no job of ours is running now
            self.heartbeat.stop()
            log.info("shutdown: heartbeat row of %s retired", self.heartbeat.name)
        if self.retention is not None:
            self.retention.stop()
        self.runner.close()


FETCH_HEADROOM = 8  # task threads beyond the decoded-image cap: claiming and fetching the next


def task_threads(settings: Settings, prefetch_images: int) -> int:
    """Celery task threads for a worker holding `prefetch_images` decoded images at once.

    Why from the batch cap rather than a fixed 16: a thread holds its image from the claim to
    the ack, so the threads are the images in flight; with fewer than two batches' worth the
    batcher runs short batches while the GPU wants 64-256 rows (on an H200 the defaults of 16
    threads took 72.7 s for 486 jobs, 512 threads 46.7 s: issue 13). Threads beyond the
    decoded-image cap only wait on its semaphore, so the cap, not the threads, bounds memory.
    """
    if settings.concurrency is not None:
        return settings.concurrency
    return prefetch_images + FETCH_HEADROOM


def recycle_policy(settings: Settings) -> RecyclePolicy:
    def gib(value: float | None) -> int | None:
        return None if value is None else int(value * GiB)

    return RecyclePolicy(
        max_images=settings.max_images,
        max_rss_bytes=gib(settings.max_rss_gib),
        max_fragmentation_bytes=gib(settings.max_fragmentation_gib),
        patience=settings.recycle_patience,
    )


def batch_hooks(
    recycler: Recycler | None, fixed_bytes: int
) -> Callable[[BatchRecord], None]:
    """What the worker does after each batch: log it, count it, let the recycler look."""
    hooks: list[Callable[[BatchRecord], None]] = [
        _log_batch,
        lambda record: _count_batch(record, fixed_bytes),
    ]
    if recycler is not None:
        hooks.append(recycler.after_batch)

    def on_batch(record: BatchRecord) -> None:
        for hook in hooks:
            hook(record)

    return on_batch


def build_runtime(
    settings: Settings,
    store: JobStore | None = None,
    worker_name: str | None = None,
    on_recycle: Callable[[str], None] | None = None,
    send_page: SendPage | None = None,
) -> Runtime:
    """Load the engine (here, or in an engine process: OCRQ_ENGINE_PROCESS) and start its
    batcher; with `on_recycle`, watch for recycling too; `send_page`: where documents' page
    jobs go (default: the broker)."""
    engine: EngineFront
    batcher: Batcher
    recycler = None
    if engine_in_own_process(settings):
        link = EngineLink.start(settings)
        engine, batcher, config, model = link.engine, link.batcher, link.config, link.cost_model
        if on_recycle is not None:
            recycler = Recycler(
                recycle_policy(settings), on_recycle, rss=link.rss_bytes,
                fragmentation=link.fragmentation_bytes,
            )
        link.on_batch = batch_hooks(recycler, model.fixed_bytes)
    else:
        side = load_engine(settings)
        engine, config, model = side.engine, side.config, side.choice.model
        if on_recycle is not None:  # it watches the loaded engine's memory
            fragmentation = memory_of(engine).fragmentation_bytes
            recycler = Recycler(recycle_policy(settings), on_recycle, fragmentation=fragmentation)
        batcher = side.start(batch_hooks(recycler, model.fixed_bytes))
    metrics.CONFIGURED_BUDGET_BYTES.set(config.budget_bytes)
    metrics.BUDGET_BYTES.set(config.budget_bytes)
    store = store or JobStore(engine_for(settings))
    name = worker_name or unique_worker_name(settings.engine)
    prefetch = settings.prefetch_images or 2 * config.max_items
    runner = JobRunner(
        settings, engine, batcher, store, name, prefetch_images=prefetch, send_page=send_page
    )
    log.info(
        "engine %s loaded%s; batches up to %d images within %.2f GiB above %.2f GiB fixed (%s)",
        engine.name,
        " in its own process" if isinstance(batcher, RemoteBatcher) else "",
        config.max_items,
        config.budget_bytes / GiB,
        model.fixed_bytes / GiB,
        model.source,
    )
    return Runtime(settings, engine, batcher, runner, recycler)


def engine_in_own_process(settings: Settings) -> bool:
    """OCRQ_ENGINE_PROCESS, or where unset: HunyuanOCR on an NVIDIA GPU (found without CUDA)."""
    if settings.engine_process is not None:
        return settings.engine_process
    return settings.engine == "hunyuan" and settings.device != "cpu" and has_nvidia_gpu()


def start_heartbeat(settings: Settings, name: str) -> Heartbeat:
    """Beat for worker `name`, and sweep other workers' stalled jobs back to the queue."""
    from ocrq.core.requeue import producer_app, recover  # as `ocrq requeue`

    app = producer_app(settings)
    store = JobStore(engine_for(settings))
    return Heartbeat(
        store.engine,
        name,
        settings,
        sweep=lambda: recover(store, app, settings, exclude_worker=name, paced=True),
    ).start()


def _count_batch(record: BatchRecord, fixed_bytes: int) -> None:
    metrics.BATCHES.inc()
    metrics.BATCH_SIZE.observe(record.size)
    metrics.BATCH_SECONDS.observe(record.ended - record.started)
    metrics.DEFERRED.set(record.deferred)
    metrics.BUDGET_BYTES.set(record.budget_bytes)
    metrics.PLANNED_PEAK_BYTES.set(fixed_bytes + record.predicted_bytes)
    if record.measured_peak_bytes is not None:
        metrics.MEASURED_PEAK_BYTES.set(record.measured_peak_bytes)
    metrics.sample_gpu_memory()


def _log_batch(record: BatchRecord) -> None:
    log.info(
        "batch %s: %d images in %.3f s (%d failed, predicted %.3f GiB, %d left waiting, "
        "%d in flight, %.1f row-s)",
        record.batch_id[:8],
        record.size,
        record.ended - record.started,
        record.failed_items,
        record.predicted_bytes / GiB,
        record.deferred,
        record.in_flight,
        record.row_seconds,
    )


_lock = threading.Lock()
_runtime: Runtime | None = None
_settings: Settings | None = None
_node: str | None = None
_name: str | None = None


def configure(settings: Settings, node: str | None = None) -> None:
    """The Settings this worker process runs with, read once by its entry point
    (ocrq/worker/main.py), and its Celery node name; `get_runtime` builds from them.

    The process's worker name is fixed here, before Celery consumes anything, so that every
    message it takes is recorded as held by it (ocrq/worker/broker.py) under the name its
    heartbeat and rows carry."""
    global _settings, _node, _name
    _settings = settings
    _node = node
    _name = unique_worker_name(settings.engine, node)
    set_holder(_name)


def get_runtime(
    settings: Settings | None = None, on_recycle: Callable[[str], None] | None = None
) -> Runtime:
    """The worker process's runtime, built on first use (worker start-up calls this early),
    with its heartbeat; the name it claims jobs under is unique to this process."""
    global _runtime
    with _lock:
        if _runtime is None:
            settings = settings or _settings or Settings()
            name = _name or unique_worker_name(settings.engine, _node)
            runtime = build_runtime(settings, worker_name=name, on_recycle=on_recycle)
            runtime.heartbeat = start_heartbeat(settings, name)
            if settings.retention_days is not None:
                runtime.retention = RetentionPass(runtime.runner.store.engine, settings).start()
            _runtime = runtime
        return _runtime


def shutdown_runtime() -> None:
    global _runtime
    with _lock:
        if _runtime is not None:
            _runtime.close()
            _runtime = None
