"""The worker process: `python -m ocrq.worker.main CELERY_WORKER_ARGS...`, what `ocrq worker` runs.

Why an entry point of its own: run as `__main__`, a module's globals are not the ones other
modules import, and the exit state that the Celery app's signal handlers set lives in
ocrq/worker/lifecycle.py; here it is only imported, so both see one module. Its Settings are read
once, from the environment the supervisor built for it (or handed in by `ocrq worker
--no-supervise`), and everything below is given them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from ocrq.core.settings import Settings
from ocrq.worker import lifecycle, runtime


def node_name(argv: Sequence[str]) -> str | None:
    """The Celery node name `argv` asks for (`--hostname`/`-n`), expanded as Celery does
    (`%h` -> this host), so the rows this process writes carry the name Flower shows."""
    value = None
    for i, arg in enumerate(argv):
        if arg in ("--hostname", "-n") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--hostname="):
            value = arg.partition("=")[2]
    if not value:
        return None
    from celery.utils.nodenames import default_nodename, host_format

    return host_format(default_nodename(value))


def run(argv: Sequence[str], settings: Settings) -> int:
    """Checks, then the Celery worker with these settings; the process's exit code."""
    refused = lifecycle.preflight(settings)
    if refused is not None:
        return refused
    # The engine, batcher and heartbeat are built from these.
    runtime.configure(settings, node=node_name(argv))
    from ocrq.worker.celery_app import make_app  # after the checks: nothing is consumed before them

    return lifecycle.run_celery(make_app(settings), argv)


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
