"""Prometheus metrics of a worker process; served on OCRQ_METRICS_PORT when it is set."""

from __future__ import annotations

from prometheus_client import Counter, Histogram, start_http_server

JOBS = Counter("ocrq_jobs_total", "Jobs finished by this worker", ["status"])
BATCHES = Counter("ocrq_batches_total", "Engine batches run")
BATCH_SIZE = Histogram(
    "ocrq_batch_images", "Images per batch", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)
)
BATCH_SECONDS = Histogram("ocrq_batch_seconds", "Engine time per batch")
RECYCLES = Counter("ocrq_recycles_total", "Worker recycles requested", ["reason"])
OOM_EVENTS = Counter("ocrq_oom_events_total", "Device out-of-memory events recovered from")


def serve(port: int | None) -> None:
    if port:
        start_http_server(port)
