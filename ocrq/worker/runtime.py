"""Wire settings -> engine -> batcher -> job runner, once per process.

The Celery app and embedded mode both build a Runtime; it is created after Celery has set up
its pool, in the process that will run the engine, so CUDA is never initialised before a fork.
Its parts are components (ocrq/core/components.py), started in the order `build_runtime` lists
them and stopped in reverse by `Runtime.close`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ocrq.core import metrics
from ocrq.core.components import Component, Components
from ocrq.core.db import engine_for
from ocrq.core.process import STATE
from ocrq.core.settings import BatchingSettings, DeliverySettings, Settings
from ocrq.core.store import JobStore
from ocrq.engine_process.link import EngineLink, RemoteBatcher
from ocrq.intake.splitting import SendPage
from ocrq.models.base import EngineFront
from ocrq.models.costs import CostModel, GiB
from ocrq.models.memory import memory_of
from ocrq.scheduling.engine_side import EngineSide, load_engine
from ocrq.scheduling.recycle import RecyclePolicy, Recycler
from ocrq.scheduling.vocabulary import BatchConfig, Batcher, BatchRecord
from ocrq.worker import engine_start
from ocrq.worker.engine_start import engine_in_own_process
from ocrq.worker.heartbeat import Heartbeat, unique_worker_name
from ocrq.worker.jobs import JobRunner
from ocrq.worker.retention_pass import RetentionPass

if TYPE_CHECKING:
    from ocrq.core.broker_scan import BrokerNotes

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
    # What `build_runtime` started, in order; `close` stops them in reverse.
    components: Components = field(default_factory=lambda: Components("worker"))

    @property
    def task_threads(self) -> int:
        """How many task threads keep this runtime's batches full (see `task_threads`)."""
        return task_threads(self.settings, self.runner.prefetch_images)

    def close(self) -> None:
        self.components.stop()


FETCH_HEADROOM = 8  # task threads beyond the decoded-image cap: claiming and fetching the next


def task_threads(settings: BatchingSettings, prefetch_images: int) -> int:
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


def recycle_policy(settings: DeliverySettings) -> RecyclePolicy:
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


class _Parts:
    """What the worker's components start, each reading what those before it started: the
    steps of `build_runtime`, one method pair per component."""

    def __init__(
        self,
        settings: Settings,
        store: JobStore | None,
        name: str,
        on_recycle: Callable[[str], None] | None,
        send_page: SendPage | None,
    ) -> None:
        self.settings, self.store, self.name = settings, store, name
        self.on_recycle, self.send_page = on_recycle, send_page
        self.link: EngineLink | None = None
        self.side: EngineSide | None = None
        self.engine: EngineFront | None = None
        self.config: BatchConfig | None = None
        self.model: CostModel | None = None
        self.recycler: Recycler | None = None
        self.batcher: Batcher | None = None
        self.runner: JobRunner | None = None
        self.heartbeat: Heartbeat | None = None
        self.retention: RetentionPass | None = None
        # A Celery worker's: the broker's notes on jobs other workers hold (JobRunner).
        self.broker: BrokerNotes | None = None

    def start_engine(self) -> None:
        """Load the engine, here or in an engine process (OCRQ_ENGINE_PROCESS), or take the one
        the worker's entry point started already (ocrq/worker/engine_start.py)."""
        settings = self.settings
        early = engine_start.take(settings)
        if early is not None:
            started = early.result()
            self.link, self.side = started.link, started.side
        elif engine_in_own_process(settings):
            self.link = EngineLink.start(settings)
        else:
            self.side = load_engine(settings)
        if self.link is not None:
            link = self.link
            self.engine, self.config, self.model = link.engine, link.config, link.cost_model
        else:
            side = self.side
            assert side is not None
            self.engine, self.config, self.model = side.engine, side.config, side.choice.model
        metrics.CONFIGURED_BUDGET_BYTES.set(self.config.budget_bytes)
        metrics.BUDGET_BYTES.set(self.config.budget_bytes)

    def stop_engine(self) -> None:
        assert self.engine is not None
        self.engine.close()

    def start_heartbeat(self) -> None:
        with STATE.timeline.phase("heartbeat"):
            self.heartbeat = start_heartbeat(self.settings, self.name)

    def stop_heartbeat(self) -> None:
        assert self.heartbeat is not None
        self.heartbeat.stop()
        log.info("shutdown: heartbeat row of %s retired", self.heartbeat.name)

    def start_retention(self) -> None:
        with STATE.timeline.phase("retention"):
            self.retention = RetentionPass(engine_for(self.settings), self.settings).start()

    def stop_retention(self) -> None:
        assert self.retention is not None
        self.retention.stop()

    def start_jobs(self) -> None:
        """The batcher (with the recycler watching its batches) and the job runner in front of
        it. One component: the runner's webhooks give up only once the batcher has stopped, and
        the runner is built on the batcher."""
        settings, engine, config, model = self.settings, self.engine, self.config, self.model
        assert engine is not None and config is not None and model is not None
        if self.link is not None:
            link = self.link
            if self.on_recycle is not None:
                self.recycler = Recycler(
                    recycle_policy(settings), self.on_recycle, rss=link.rss_bytes,
                    fragmentation=link.fragmentation_bytes,
                )
            link.on_batch = batch_hooks(self.recycler, model.fixed_bytes)
            self.batcher = link.batcher
        else:
            assert self.side is not None
            if self.on_recycle is not None:  # it watches the loaded engine's memory
                fragmentation = memory_of(engine).fragmentation_bytes  # type: ignore[arg-type]
                self.recycler = Recycler(
                    recycle_policy(settings), self.on_recycle, fragmentation=fragmentation
                )
            self.batcher = self.side.start(batch_hooks(self.recycler, model.fixed_bytes))
        prefetch = settings.prefetch_images or 2 * config.max_items
        try:
            with STATE.timeline.phase("job runner"):
                store = self.store or JobStore(engine_for(settings))
                self.runner = JobRunner(
                    settings, engine, self.batcher, store, self.name, prefetch_images=prefetch,
                    send_page=self.send_page, broker=self.broker,
                )
                if self.broker is not None:  # a Celery worker (build_runtime's `liveness`)
                    self.runner.watch_batches()
        except BaseException:  # a component that fails leaves nothing of its own running
            self.batcher.stop()
            raise
        log.info(
            "engine %s loaded%s; batches up to %d images within %.2f GiB above %.2f GiB fixed "
            "(%s)",
            engine.name,
            " in its own process" if isinstance(self.batcher, RemoteBatcher) else "",
            config.max_items,
            config.budget_bytes / GiB,
            model.fixed_bytes / GiB,
            model.source,
        )

    def stop_jobs(self) -> None:
        assert self.batcher is not None
        log.info("shutdown: stopping the batcher (%d rows waiting)", self.batcher.pending())
        self.batcher.stop()
        if self.runner is not None:
            self.runner.close()


def build_runtime(
    settings: Settings,
    store: JobStore | None = None,
    worker_name: str | None = None,
    on_recycle: Callable[[str], None] | None = None,
    send_page: SendPage | None = None,
    *,
    liveness: bool = False,
) -> Runtime:
    """Start the runtime's components in order: the engine (here, or in an engine process:
    OCRQ_ENGINE_PROCESS); with `liveness` (a Celery worker) its heartbeat and, with
    OCRQ_RETENTION_DAYS, the retention pass; then the batcher and the job runner. `close` stops
    them in reverse: the batcher first (no job of ours runs after it), the heartbeat after it,
    the engine last. `on_recycle`: watch for recycling too; `send_page`: where documents' page
    jobs go (default: the broker)."""
    name = worker_name or unique_worker_name(settings.engine)
    parts = _Parts(settings, store, name, on_recycle, send_page)
    order = [Component("engine", parts.start_engine, parts.stop_engine)]
    if liveness:
        parts.broker = broker_notes(settings)
        order.append(Component("heartbeat", parts.start_heartbeat, parts.stop_heartbeat))
        if settings.retention_days is not None:
            order.append(Component("retention", parts.start_retention, parts.stop_retention))
    order.append(Component("jobs", parts.start_jobs, parts.stop_jobs))
    components = Components("worker")
    components.start(order)
    assert parts.engine is not None and parts.batcher is not None and parts.runner is not None
    return Runtime(
        settings, parts.engine, parts.batcher, parts.runner, parts.recycler, parts.heartbeat,
        parts.retention, components,
    )


def broker_notes(settings: Settings) -> BrokerNotes:
    """The broker, asked whether a worker holds a job's message and told of a job given back
    (ocrq/core/broker_scan.py)."""
    from ocrq.core.broker_scan import BrokerNotes
    from ocrq.core.requeue import producer_app

    return BrokerNotes(producer_app(settings))  # connects on first use


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


def configure(settings: Settings, node: str | None = None) -> None:
    """The Settings this worker process runs with, read once by its entry point
    (ocrq/worker/main.py), and its Celery node name; `get_runtime` builds from them. Kept in
    the process's state (ocrq/core/process.py).

    The process's worker name is fixed here, before Celery consumes anything, so that every
    message it takes is recorded as held by it (ocrq/worker/broker.py) under the name its
    heartbeat and rows carry."""
    STATE.settings = settings
    STATE.node = node
    STATE.worker_name = unique_worker_name(settings.engine, node)


def get_runtime(
    settings: Settings | None = None, on_recycle: Callable[[str], None] | None = None
) -> Runtime:
    """The worker process's runtime, built on first use (worker start-up calls this early),
    with its heartbeat; the name it claims jobs under is unique to this process."""
    with STATE.runtime_lock:
        if STATE.runtime is None:
            settings = settings or STATE.settings or Settings()
            name = STATE.worker_name or unique_worker_name(settings.engine, STATE.node)
            STATE.runtime = build_runtime(
                settings, worker_name=name, on_recycle=on_recycle, liveness=True
            )
        runtime: Runtime = STATE.runtime
        return runtime


def shutdown_runtime() -> None:
    with STATE.runtime_lock:
        if STATE.runtime is not None:
            runtime: Runtime = STATE.runtime
            STATE.runtime = None
            runtime.close()
