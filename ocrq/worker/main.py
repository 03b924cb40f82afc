"""The worker process: `python -m ocrq.worker.main CELERY_WORKER_ARGS...`, what `ocrq worker` runs.

Why an entry point of its own: run as `__main__`, a module's globals are not the ones other
modules import, and the exit state that the Celery app's signal handlers set lives in
ocrq/worker/lifecycle.py; here it is only imported, so both see one module. Its Settings are read
once, from the environment the supervisor built for it (or handed in by `ocrq worker
--no-supervise`), and everything below is given them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

from ocrq.core.settings import Settings
from ocrq.worker import lifecycle, metrics, runtime


def run(argv: Sequence[str], settings: Settings) -> int:
    """Checks, then the Celery worker with these settings; the process's exit code."""
    metrics.STARTED_AT.set(time.time())
    if settings.metrics_port is not None:  # --no-supervise (a supervisor serves its children)
        try:
            serve_own_metrics(settings)
        except OSError as exc:  # the port is taken: a config error, not worth restarting
            logging.getLogger(__name__).critical(
                "worker cannot start: OCRQ_METRICS_PORT=%s: %s", settings.metrics_port, exc
            )
            return lifecycle.STARTUP_FAILED_EXIT_CODE
    refused = lifecycle.preflight(settings)
    if refused is not None:
        return refused
    runtime.configure(settings)  # the engine, batcher and heartbeat are built from these
    from ocrq.worker.celery_app import make_app  # after the checks: nothing is consumed before them

    return lifecycle.run_celery(make_app(settings), argv)


def serve_own_metrics(settings: Settings) -> None:
    """/metrics, /healthz, /readyz of this process, from its start (probes then say
    "starting"), on the port a supervisor would otherwise serve them on."""
    from prometheus_client import REGISTRY

    from ocrq.worker import monitor

    multiproc = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    registry = monitor.multiprocess_registry(multiproc) if multiproc else REGISTRY
    assert settings.metrics_port is not None
    monitor.serve(
        monitor.Monitor(registry, settings), settings.metrics_port, settings.metrics_address
    )


def main(argv: Sequence[str]) -> int:
    try:
        settings = Settings()
    except Exception as exc:
        logging.getLogger(__name__).critical("worker cannot start: invalid settings: %s", exc)
        return lifecycle.STARTUP_FAILED_EXIT_CODE
    return run(argv, settings)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(main(sys.argv[1:]))
