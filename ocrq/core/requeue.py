"""Send jobs again from their rows: the stalled-job sweep, shared by `ocrq requeue --stalled`
(through ocrq/api/client.py) and each worker's heartbeat (ocrq/worker/heartbeat.py), so that a
worker reaches it without importing the api.
"""

from __future__ import annotations

from celery import Celery

from ocrq.core import workers_table
from ocrq.core.broker_redis import celery_options
from ocrq.core.contract import DEFAULT_QUEUE, TASK_NAME, job_kwargs, resend_image
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore


def producer_app(settings: Settings) -> Celery:
    """The Celery app producers send with: the api, `ocrq submit`, the sweep, document pages."""
    app = Celery("ocrq-producer", broker=settings.broker_url)
    app.conf.update(
        task_send_sent_event=True,
        broker_connection_retry_on_startup=True,
        **celery_options(settings, None),  # Sentinel's master name (ocrq/core/broker_redis.py)
    )
    return app


def requeue_stalled(
    store: JobStore,
    app: Celery,
    settings: Settings,
    stalled_after_s: float | None = None,
    exclude_worker: str | None = None,
) -> list[str]:
    """Send again the `running` jobs of workers whose heartbeat is older than
    `stalled_after_s` (default OCRQ_STALLED_AFTER_S): a worker killed mid-job leaves
    them running, and its unacked messages would only come back after the visibility
    timeout. A live worker's jobs are never touched. Each job is flipped to `queued` by
    one UPDATE, so of several concurrent sweeps exactly one re-sends it; the original
    message, if it comes back later, finds the row done (or runs it again: one row).
    """
    after = settings.stalled_after_s if stalled_after_s is None else stalled_after_s
    stalled = workers_table.flip_stalled(store.engine, after, exclude=exclude_worker)
    sent: list[str] = []
    try:
        # The sweep's row carries no max_pixels: read the jobs' own caps.
        caps = {i: r.get("max_pixels") for i, r in store.get([j.id for j in stalled]).items()}
        for job in stalled:
            resend(app, settings, job.id, job.task, job.source, caps.get(job.id), job.page)
            sent.append(job.id)
    finally:  # the broker failed mid-way: leave the rest for the next sweep
        workers_table.unflip(store.engine, [j.id for j in stalled[len(sent) :]])
    workers_table.forget_dead(store.engine, after)
    return sent


def resend(
    app: Celery,
    settings: Settings,
    job_id: str,
    task: str,
    source: str,
    max_pixels: int | None = None,
    page: int | None = None,
) -> None:
    """A job's message rebuilt from its row (path or URL; the row holds no inline bytes)."""
    image = resend_image(source, page)
    app.send_task(
        TASK_NAME,
        kwargs=job_kwargs(image, task, job_id, max_pixels),
        queue=settings.queue or DEFAULT_QUEUE,
        task_id=job_id,
    )
