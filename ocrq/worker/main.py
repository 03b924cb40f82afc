"""The worker process: `python -m ocrq.worker.main CELERY_WORKER_ARGS...`, what `ocrq worker` runs.

Why an entry point of its own: run as `__main__`, a module's globals are not the ones other
modules import, and the exit state that the Celery app's signal handlers set lives in
ocrq/worker/exit_state.py; here it is only imported, so both see one module. Its Settings are read
once, from the environment the supervisor built for it (or handed in by `ocrq worker
--no-supervise`), and everything below is given them.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

from ocrq.core import metrics
from ocrq.core.problems import infrastructure_problem
from ocrq.core.process import STATE, setup_process
from ocrq.core.settings import Settings
from ocrq.core.startup import gc_paused
from ocrq.worker import engine_start, exit_state, supervisor


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
    """Checks, then the Celery worker with these settings; the process's exit code.

    The engine starts right after the cheap checks and loads beside the rest of the start (the
    database check, the Celery app): ocrq/worker/engine_start.py says why. Each step is a phase
    of the start-up timeline (ocrq/core/startup.py), logged once the worker is ready."""
    timeline = STATE.timeline
    timeline.imported()
    metrics.STARTED_AT.set(time.time())
    # The CUDA allocator's defaults and the GIL switch interval, before any engine loads.
    setup_process(settings)
    refused = exit_state.check_roots(settings)
    if refused is not None:
        return refused
    # An engine process starts first, its interpreter and imports beside this one's; an engine
    # loaded here, in a thread, starts after this thread's own imports: two threads importing at
    # once may see each other's modules half-imported (importlib lets a concurrent circular
    # import through with a partial module).
    own_process = engine_start.engine_in_own_process(settings)
    early = _start_engine(settings) if own_process else None
    if own_process and early is None:
        return exit_state.STARTUP_FAILED_EXIT_CODE
    if settings.metrics_port is not None:  # --no-supervise (a supervisor serves its children)
        try:
            with timeline.phase("metrics server"):
                serve_own_metrics(settings)
        except OSError as exc:  # the port is taken: a config error, not worth restarting
            logging.getLogger(__name__).critical(
                "worker cannot start: OCRQ_METRICS_PORT=%s: %s", settings.metrics_port, exc
            )
            if early is not None:
                early.abandon()
            return exit_state.STARTUP_FAILED_EXIT_CODE
    with timeline.phase("worker imports"), gc_paused():  # beside an engine process's start
        from ocrq.worker import runtime
    if early is None:
        early = _start_engine(settings)
        if early is None:
            return exit_state.STARTUP_FAILED_EXIT_CODE
    # The engine, batcher and heartbeat are built from these.
    runtime.configure(settings, node=node_name(argv))
    with timeline.phase("database check"):
        refused = exit_state.check_database(settings)
    if refused is not None:
        early.abandon()
        return refused
    with timeline.phase("celery app"):
        # After the checks (nothing is consumed before them); building it consumes nothing.
        from ocrq.worker.celery_app import make_app, preload

        app = make_app(settings)
        preload(app)
    argv = list(argv)
    if "--concurrency" not in argv:
        # The thread count follows the batch cap, known once the engine has loaded; so wait
        # for it before Celery starts (a missing model fails here, as it did at worker_ready).
        try:
            threads = runtime.get_runtime(on_recycle=exit_state.request_recycle).task_threads
        except Exception as exc:
            exit_state.startup_failed(exc, signal_self=False)
            return exit_state.STARTUP_FAILED_EXIT_CODE
        logging.getLogger(__name__).info("task threads: %d (from the batch cap)", threads)
        argv += ["--concurrency", str(threads)]
    timeline.begin("celery start")  # ends at worker_ready (ocrq/worker/celery_app.py)
    return exit_state.run_celery(app, argv)


def _start_engine(settings: Settings) -> engine_start.EngineStart | None:
    """The engine, started now (ocrq/worker/engine_start.py); None where it could not even be
    started (logged as a failed start)."""
    try:
        return engine_start.start_engine(settings)
    except Exception as exc:
        exit_state.startup_failed(exc, signal_self=False)
        return None


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
    if not supervisor.die_with_supervisor():
        logging.getLogger(__name__).critical("worker not started: its supervisor has exited")
        return 1
    STATE.timeline.imported()
    try:
        with STATE.timeline.phase("settings"):
            settings = Settings()
    except Exception as exc:
        problem = infrastructure_problem(exc)  # one line, named by variable, as the CLI says it
        said = problem.message if problem else f"invalid settings: {exc}"
        logging.getLogger(__name__).critical("worker cannot start: %s", said)
        return exit_state.STARTUP_FAILED_EXIT_CODE
    return run(argv, settings)


# Celery keeps its hands off the root logger (`worker_hijack_root_logger=False`), so ocrq's own
# lines (a batch's, the loop's totals: what the benches read back) keep this format all along.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def log_to_stderr() -> None:
    """INFO lines on stderr until Celery takes the root logger over as it starts: the start-up
    lines before that (the cost model and its recommended batch, the task threads, a database
    still away) are the ones an operator reads first. Every way a worker process starts sets
    it: a supervisor's child here, `ocrq worker --no-supervise` in the CLI (before, that one
    set none and they were lost, under every shipped unit and manifest), and the supervisor
    itself (where its metrics are served was dropped there).

    Alembic's INFO lines (its plugins set up, its migration context) come from the schema
    checks at every start and recycle, and every 10 s from /readyz: noise here. `ocrq migrate`
    does not come through here and keeps them."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def announce(settings: Settings) -> None:
    """Once per `ocrq worker`: which database and broker it uses, without their passwords.
    A worker pointed at the wrong one otherwise looked healthy in its log."""
    from ocrq.core.broker_redis import shown_url
    from ocrq.core.db import shown_database

    logging.getLogger(__name__).info(
        "database %s (OCRQ_DATABASE_URL), broker %s (OCRQ_BROKER_URL)",
        shown_database(settings.database_url), shown_url(settings.broker_url),
    )


if __name__ == "__main__":
    log_to_stderr()
    sys.exit(main(sys.argv[1:]))
