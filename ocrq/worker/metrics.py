"""Prometheus metrics of a worker process; served on OCRQ_METRICS_PORT when it is set."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from ocrq.core.settings import Settings

JOBS = Counter("ocrq_jobs_total", "Jobs finished by this worker", ["status"])
BATCHES = Counter("ocrq_batches_total", "Engine batches run")
BATCH_SIZE = Histogram(
    "ocrq_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
BATCH_SECONDS = Histogram("ocrq_batch_seconds", "Engine time per batch")
# The planner's `deferred`: images that waited on when the last batch was planned. Above zero
# with batches below OCRQ_MAX_BATCH, the memory budget (not the count) is what closes batches.
DEFERRED = Gauge("ocrq_batch_deferred_images", "Images left waiting by the last batch planned")
BUDGET_BYTES = Gauge("ocrq_batch_budget_bytes", "Memory budget batches are planned to now")
RECYCLES = Counter("ocrq_recycles_total", "Worker recycles requested", ["reason"])
OOM_EVENTS = Counter("ocrq_oom_events_total", "Device out-of-memory events recovered from")


def serve(settings: Settings) -> bool:
    """Serve this process's metrics on `settings.metrics_port` (the one place it is read);
    whether a server was started."""
    if settings.metrics_port is None:
        return False
    start_http_server(settings.metrics_port)
    return True
