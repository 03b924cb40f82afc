"""The Celery app of the worker: delivery guarantees are set here, in one place.

- acks_late + reject_on_worker_lost: a message is acked only after the task returned, i.e.
  after its row was committed; a worker that dies mid-batch leaves its messages to redelivery.
- prefetch multiplier 1 with the threads pool: the worker reserves exactly as many messages as
  it has task threads, which is how many images can be prefetching or waiting for the batcher.
  It also keeps the lanes apart: a larger multiplier would park bulk messages in the thread
  pool's own FIFO queue, where an interactive message fetched later waits behind them; with 1,
  the next free thread takes the next message Redis gives, interactive queue first.
- visibility_timeout: Redis redelivers an unacked message after this long, so it must exceed
  the worst delivery-to-ack time (queue wait inside the worker + batch time).
- task events on, so Flower lists every image's task: received, started, succeeded/failed.
- a result backend (the broker's Redis by default, OCRQ_RESULT_BACKEND): the task's result is
  the job's result dict, so a bare Celery producer's `AsyncResult(job_id).get()` returns it.
- malformed messages are rejected by the transport (ocrq/worker/broker.py), never crash the worker.
- a `sentinel://` broker URL: the same transport through Redis Sentinel, and the result backend
  too when it follows the broker (ocrq/core/broker_redis.py).
"""

from __future__ import annotations

import logging

from celery import Celery, bootsteps, signals

from ocrq.core.broker_redis import celery_options, is_redis, is_sentinel
from ocrq.core.contract import DEFAULT_QUEUE, INTERACTIVE, TASK_NAME, queue_for
from ocrq.core.settings import Settings, result_backend_url

log = logging.getLogger(__name__)

# What `worker_main` imports on its way to consuming (`preload`): its command line (click), the
# worker, its consumer and the threads pool.
PRELOADED = ("celery.bin.celery", "celery.apps.worker", "celery.worker.consumer",
             "celery.concurrency.thread")


def make_app(settings: Settings) -> Celery:
    backend = result_backend_url(settings)
    app = Celery(
        "ocrq", broker=settings.broker_url, backend=backend, include=["ocrq.worker.tasks"]
    )
    if is_redis(settings.broker_url):
        from ocrq.worker.broker import SENTINEL_TRANSPORT, TRANSPORT

        # survives a Redis restart (see ocrq/worker/broker.py), and a failover under Sentinel
        app.conf.broker_transport = (
            SENTINEL_TRANSPORT if is_sentinel(settings.broker_url) else TRANSPORT
        )
    ha = celery_options(settings, backend)  # Sentinel's master name (ocrq/core/broker_redis.py)
    app.conf.update(
        task_default_queue=settings.queue or DEFAULT_QUEUE,
        task_routes={TASK_NAME: {"queue": settings.queue or DEFAULT_QUEUE}},
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        task_ignore_result=backend is None,
        result_expires=settings.result_expires_s,
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        broker_transport_options={
            "visibility_timeout": settings.visibility_timeout_s,
            # The lock that serialises restoring expired unacked messages outlives a Redis
            # restart (the append-only file keeps it): a short expiry lets the reconnected
            # worker restore them within a minute instead of kombu's default five.
            "unacked_mutex_expire": 60,
            # Scan for unacked messages past the visibility timeout every 10 s (kombu's
            # unacked_restore_interval) rather than every 10th time (~100 s): a message whose
            # worker died comes back soon after the timeout. One ZRANGE per scan.
            "unacked_restore_throttle": 1,
            # Messages on these queues must be these tasks, in Celery's protocol: anything
            # else is rejected with one log line before Celery sees it (ocrq/worker/envelope.py).
            # Not `celery` (OCRQ_CONSUME_DEFAULT_QUEUE): another app's tasks there meet Celery's
            # own unregistered-task handling; the envelope is checked on every queue.
            "ocrq_task_queues": [
                settings.queue or DEFAULT_QUEUE,
                queue_for(INTERACTIVE, settings.queue or DEFAULT_QUEUE),
            ],
            # Poll the queues in the order the worker names them (`--queues`, interactive lane
            # first: ocrq/worker/queue_depth.py `consumed_queues`), not kombu's default round
            # robin: one BRPOP over all of them returns the first non-empty one in that order,
            # so an interactive message never waits behind a bulk one in Redis; except that a
            # bulk lane not served for OCRQ_BULK_MAX_WAIT_S is then fetched every other time
            # until a lane runs dry (ocrq/worker/lane_fetch.py).
            "queue_order_strategy": "priority",
            "ocrq_bulk_max_wait_s": settings.bulk_max_wait_s,
            "ocrq_task_names": [TASK_NAME],
            # ETAs farther ahead, and links to tasks OCRQ_LINK_TASKS does not name (or not
            # plain, or not to OCRQ_LINK_QUEUES), fail the job instead (envelope.task_refusal,
            # ocrq/worker/links.py).
            "ocrq_max_eta_s": settings.eta_bound_s,
            "ocrq_link_tasks": list(settings.link_tasks),
            "ocrq_link_queues": list(settings.link_queues),
            **ha.get("broker_transport_options", {}),
        },
        result_backend_transport_options=ha.get("result_backend_transport_options", {}),
        task_serializer="json",
        accept_content=["json"],
    )
    app.steps["worker"].add(GuardStopSignals)
    return app


class GuardStopSignals(bootsteps.StartStopStep):
    """Guard Celery's SIGTERM/SIGINT handlers (ocrq/worker/exit_state.py `guard_stop_signals`)
    as soon as they exist: Celery installs them as its worker starts (`on_start`), before any
    step; this step runs before the consumer, which Celery always starts last.

    Why not at `worker_ready`: that comes only once the consumer has reached its broker. A
    worker still retrying a broker that does not answer was stopped unguarded: the stop from
    its process group and the supervisor's copy entered Celery's handler twice, the second
    waited on the first's lock, and the worker hung in its warm shutdown until killed (seen in
    tests/test_metrics.py's unreachable-broker test, one CI run in several)."""

    label = "ocrq stop-signal guard"

    def start(self, parent: object) -> None:
        from ocrq.worker.exit_state import guard_stop_signals

        guard_stop_signals()


def preload(app: Celery) -> None:
    """What `worker_main` would import and build on its way to consuming, done before it: the
    worker's entry point calls this while its engine loads (ocrq/worker/engine_start.py), so
    Celery's own start after the engine is shorter. Connects to nothing."""
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    app.loader.import_default_modules()  # ocrq.worker.tasks, its task registered
    app.finalize(auto=True)
    if app.conf.result_backend:
        app.backend  # noqa: B018  (the backend's class and its client, made once)


@signals.worker_init.connect
def _tolerant_transport_after_reconnects(**_: object) -> None:
    from ocrq.worker.broker import keep_transport_on_reconnect

    keep_transport_on_reconnect()


@signals.worker_ready.connect
def _load_engine_at_start(**_: object) -> None:
    """Load the model before the first message, so a missing model fails at start-up."""
    from ocrq.core import metrics
    from ocrq.core.process import STATE
    from ocrq.worker.exit_state import request_recycle, startup_failed
    from ocrq.worker.runtime import get_runtime

    timeline = STATE.timeline
    timeline.end("celery start")
    try:
        get_runtime(on_recycle=request_recycle)
    except Exception as exc:  # a missing model or bad settings: stop now, loudly
        startup_failed(exc)
        return
    metrics.READY.set(1)
    timeline.log_ready()  # the start-up's phases, then `startup: ready at` (ocrq/core/startup.py)


@signals.worker_shutting_down.connect
def _not_ready(sig: object = None, **_: object) -> None:
    """A warm shutdown (a recycle, SIGTERM) stops consuming: not ready from now on."""
    from ocrq.core import metrics
    from ocrq.core.process import STATE

    metrics.READY.set(0)
    STATE.stopping = str(sig or "a stop")
    global _warm_stop
    if _warm_stop is None and STATE.settings is not None:
        from ocrq.worker.exit_state import WarmStopReport

        _warm_stop = WarmStopReport(STATE.settings.job_timeout_s).start()


_warm_stop = None  # what the warm shutdown waits for, said until Celery stops


@signals.worker_shutdown.connect
def _close_engine(**_: object) -> None:
    from ocrq.worker.runtime import shutdown_runtime

    if _warm_stop is not None:
        _warm_stop.done()
    log.info("shutdown: Celery has stopped; closing the runtime")
    shutdown_runtime()
