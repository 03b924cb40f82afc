"""Run the Celery worker in this process, and supervise such processes on bare metal.

A recycle is a warm shutdown the worker asks of itself: Celery stops consuming, the task
threads in flight finish (the batcher runs their batches and their rows are stored), messages
reserved but not started go back to the queue, and the process exits with RECYCLE_EXIT_CODE.
Whatever supervises it starts a fresh one: Docker (`restart: always`), systemd
(`Restart=always`), Kubernetes, or `ocrq worker` itself, which runs each worker as a new
interpreter (never a fork, so CUDA is never initialised in a forked process): ocrq/worker/main.py.

This module holds the process's exit state and never imports the Celery app: the app's signal
handlers call in here (`request_recycle`, `startup_failed`), and the entry point hands the app
to `run_celery`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ocrq.worker import metrics
from ocrq.worker.recycle import RECYCLE_EXIT_CODE

if TYPE_CHECKING:
    from celery import Celery

    from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

STARTUP_FAILED_EXIT_CODE = 78  # EX_CONFIG: restarting will not help (a missing model, say)
DATABASE_WAIT_S = 60.0  # how long a starting worker waits for an unreachable database

_exit_code: int | None = None
_exit_lock = threading.Lock()


def _request_exit(code: int, reason: str) -> bool:
    """Ask this worker process for a warm shutdown (SIGTERM is Celery's), remembering why."""
    global _exit_code
    with _exit_lock:
        if _exit_code is not None:
            return False
        _exit_code = code
    log.warning("worker exit requested (%d): %s", code, reason)
    os.kill(os.getpid(), signal.SIGTERM)
    return True


def request_recycle(reason: str) -> None:
    """Recycle: a fresh process replaces this one (see the module docstring)."""
    if _request_exit(RECYCLE_EXIT_CODE, f"recycle: {reason}"):
        metrics.RECYCLES.labels(reason.split(" ")[0]).inc()


def startup_failed(exc: BaseException) -> None:
    """The engine could not be loaded: exit with a code that tells supervisors not to retry."""
    log.critical("worker cannot start: %s: %s", type(exc).__name__, exc)
    _request_exit(STARTUP_FAILED_EXIT_CODE, f"startup failed: {exc}")


def check_database(settings: Settings) -> int | None:
    """Before the worker touches the broker: the database at the Alembic head.

    Returns an exit code to stop with, or None to go on. A worker on an unmigrated database
    would take each message, fail to claim its row and ack it: the job would be lost. Checked
    here, before Celery starts, no message is ever fetched (at `worker_ready` the consumer has
    already subscribed). Waits out a database still starting (compose, Kubernetes).
    """
    from sqlalchemy.exc import OperationalError
    from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

    from ocrq.core.migrate import SchemaNotAtHead, check_at_head

    check = retry(
        retry=retry_if_exception_type(OperationalError),
        wait=wait_exponential(multiplier=0.5, max=5),
        stop=stop_after_delay(DATABASE_WAIT_S),
        reraise=True,
    )(check_at_head)
    try:
        check(settings.database_url)
    except SchemaNotAtHead as exc:
        log.critical("worker cannot start: %s", exc)
        return STARTUP_FAILED_EXIT_CODE
    except OperationalError as exc:  # still down: exit, and let the supervisor try again
        log.critical(
            "worker cannot start: database unreachable or missing (`ocrq migrate` creates it): %s",
            exc.orig or exc,
        )
        return 1
    return None


def preflight(settings: Settings) -> int | None:
    """Before the worker touches the broker: safe roots, database at the Alembic head. An exit
    code to stop with, or None to go on."""
    try:  # a worker that could read any host file does not start
        settings.require_safe_roots()
    except ValueError as exc:
        log.critical("worker cannot start: %s", exc)
        return STARTUP_FAILED_EXIT_CODE
    return check_database(settings)


def run_celery(app: Celery, argv: Sequence[str]) -> int:
    """Run `celery worker` in this process until it stops; the exit code says whether this was
    a recycle (or why it could not start)."""
    code = 0
    try:
        app.worker_main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return _exit_code if _exit_code is not None else code


def supervise(
    child_argv: Sequence[str],
    env: Mapping[str, str],
    settings: Settings | None = None,
    max_crash_backoff_s: float = 30.0,
) -> int:
    """Start the worker as a child interpreter; start it again after a recycle or a crash.

    `env` is the child's whole environment, built by the caller with the options it was given
    (the child reads its Settings from it once); this process's own environment is left alone.
    A recycle restarts at once; a crash restarts after a growing pause, so a worker that dies
    at start-up (a missing model, say) does not spin. SIGTERM/SIGINT stop child and supervisor.
    With `settings.metrics_port`, this process serves the children's metrics and health there
    (it outlives them: counters keep counting across recycles; see ocrq/worker/metrics.py).
    """
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None
    multiproc: str | None = None
    if settings is not None and settings.metrics_port is not None:
        from ocrq.worker import monitor

        multiproc = tempfile.mkdtemp(prefix="ocrq-metrics-")  # fresh: no stale files summed
        env = {k: v for k, v in env.items() if k.upper() != "OCRQ_METRICS_PORT"}
        env["PROMETHEUS_MULTIPROC_DIR"] = multiproc
        registry = monitor.multiprocess_registry(multiproc)
        alive = lambda: child is not None and child.poll() is None  # noqa: E731
        try:
            monitor.serve(
                monitor.Monitor(registry, settings, process_alive=alive),
                settings.metrics_port,
                settings.metrics_address,
            )
        except OSError as exc:  # the port is taken: a config error, not worth restarting
            print(
                f"ocrq supervisor: cannot serve OCRQ_METRICS_PORT={settings.metrics_port}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(multiproc, ignore_errors=True)
            return STARTUP_FAILED_EXIT_CODE

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    backoff = 1.0
    recycles = 0
    try:
        while True:
            started = time.monotonic()
            child = subprocess.Popen(
                [sys.executable, "-m", "ocrq.worker.main", *child_argv], env=dict(env)
            )
            print(
                f"ocrq supervisor: started worker process pid {child.pid}",
                file=sys.stderr,
                flush=True,
            )
            code = child.wait()
            if multiproc is not None:  # its gauges go; its counters and histograms stay
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(child.pid, multiproc)
            if stopping.is_set():
                return 0 if code in (0, RECYCLE_EXIT_CODE, -signal.SIGTERM) else code
            if code == STARTUP_FAILED_EXIT_CODE:
                print(
                    "ocrq supervisor: worker cannot start (see above); not restarting",
                    file=sys.stderr,
                    flush=True,
                )
                return code
            if code == RECYCLE_EXIT_CODE:
                recycles += 1
                print(
                    f"ocrq supervisor: worker recycled ({recycles} so far); starting a new one",
                    file=sys.stderr,
                    flush=True,
                )
                backoff = 1.0
                continue
            # Any other exit that we did not ask for (a crash, an unrecoverable broker error, a
            # remote shutdown) gets a new worker: a supervisor's job is to keep one running.
            if time.monotonic() - started > 60:
                backoff = 1.0
            print(
                f"ocrq supervisor: worker exited with {code}; restarting in {backoff:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            if stopping.wait(backoff):
                return code
            backoff = min(backoff * 2, max_crash_backoff_s)
    finally:
        if multiproc is not None:
            shutil.rmtree(multiproc, ignore_errors=True)
