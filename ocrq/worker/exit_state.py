"""Run the Celery worker in this process: its exit state, its preflight, its stop signals.

A recycle is a warm shutdown the worker asks of itself: Celery stops consuming, the task
threads in flight finish (the batcher runs their batches and their rows are stored), messages
reserved but not started go back to the queue, and the process exits with RECYCLE_EXIT_CODE.
Whatever supervises it starts a fresh one: Docker (`restart: always`), systemd
(`Restart=always`), Kubernetes, or `ocrq worker` itself, which runs each worker as a new
interpreter (never a fork, so CUDA is never initialised in a forked process): ocrq/worker/main.py.
With `--gpus` it supervises one such process per GPU, each on its own (ocrq/worker/supervisor.py).

This module holds the process's exit state and never imports the Celery app: the app's signal
handlers call in here (`request_recycle`, `startup_failed`), and the entry point hands the app
to `run_celery`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ocrq.core import metrics
from ocrq.core.process import STATE
from ocrq.scheduling.recycle import RECYCLE_EXIT_CODE

if TYPE_CHECKING:
    from celery import Celery

    from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

STARTUP_FAILED_EXIT_CODE = 78  # EX_CONFIG: restarting will not help (a missing model, say)


def _request_exit(code: int, reason: str, level: int = logging.WARNING) -> bool:
    """Ask this worker process for a warm shutdown (SIGTERM is Celery's), remembering why."""
    with STATE.exit_lock:  # the process's exit state: ocrq/core/process.py
        if STATE.exit_code is not None:
            return False
        STATE.exit_code = code
    log.log(level, "worker exit requested (%d): %s", code, reason)
    os.kill(os.getpid(), signal.SIGTERM)
    return True


def request_recycle(reason: str) -> None:
    """Recycle: a fresh process replaces this one (see the module docstring). Logged at INFO: a
    planned recycle is routine, not an alert.

    A recycle falling due while a stop is already under way (the drain of a SIGTERM finishing
    the batch that reaches --max-images) is not one: the process is ending because it was
    asked to, and its log and exit code say so rather than `recycle`."""
    if STATE.stopping is not None:
        with STATE.exit_lock:
            if STATE.exit_code is not None:
                return
        log.info("recycle due (%s), but a stop (%s) is under way: stopping, not recycling",
                 reason, STATE.stopping)
        return
    if _request_exit(RECYCLE_EXIT_CODE, f"recycle: {reason}", logging.INFO):
        metrics.RECYCLES.labels(reason.split(" ")[0]).inc()


def startup_failed(exc: BaseException, *, signal_self: bool = True) -> None:
    """The engine could not be loaded: exit with a code that tells supervisors not to retry.
    `signal_self=False` before Celery runs: the caller returns the code itself."""
    log.critical("worker cannot start: %s: %s", type(exc).__name__, exc)
    if signal_self:
        _request_exit(STARTUP_FAILED_EXIT_CODE, f"startup failed: {exc}")


def check_database(settings: Settings) -> int | None:
    """Before the worker touches the broker: the database at the Alembic head.

    Returns an exit code to stop with, or None to go on. A worker on an unmigrated database
    would take each message, fail to claim its row and ack it: the job would be lost. Checked
    here, before Celery starts, no message is ever fetched (at `worker_ready` the consumer has
    already subscribed). Waits out a database still starting (compose, Kubernetes), and an
    `ocrq migrate` running (its lock, ocrq/core/migrate.py). A database first unreachable, then
    found behind head, is being set up by a migrate whose lock is not taken yet (between its
    CREATE DATABASE and its upgrade): that too is waited for, within the same minute.
    """
    from sqlalchemy.exc import OperationalError
    from tenacity import retry, stop_after_delay, wait_exponential

    from ocrq.core.migrate import SchemaNotAtHead, check_at_head
    from ocrq.core.problems import infrastructure_problem

    was_away = False

    def again(state: Any) -> bool:
        nonlocal was_away
        error = state.outcome.exception() if state.outcome is not None else None
        if isinstance(error, OperationalError):
            was_away = True
            return True
        return was_away and isinstance(error, SchemaNotAtHead) and error.behind

    def waiting(state: Any) -> None:  # once, so a wait of up to a minute is not silent
        if state.attempt_number == 1:
            error = state.outcome.exception() if state.outcome is not None else None
            if _missing_database(error):  # the server answered: not a reachability problem
                log.warning(
                    "%s; waiting up to %.0f s for `ocrq migrate` to create it",
                    _first_line(error), settings.database_wait_s,
                )
                return
            log.warning(
                "database not reachable yet; waiting up to %.0f s for it: %s",
                settings.database_wait_s, getattr(error, "orig", None) or error,
            )

    check = retry(
        retry=again,
        wait=wait_exponential(multiplier=0.5, max=5),
        stop=stop_after_delay(settings.database_wait_s),
        reraise=True,
        before_sleep=waiting,
    )(lambda url: check_at_head(url, wait_for_migrate=True))
    metrics.DATABASE_WAIT_SINCE.set(time.time())  # /readyz names the wait (worker/health.py)
    try:
        check(settings.database_url)
    except SchemaNotAtHead as exc:
        log.critical("worker cannot start: %s", exc)
        return STARTUP_FAILED_EXIT_CODE
    except OperationalError as exc:  # still down: exit, and let the supervisor try again
        # Said as the CLI says it (ocrq/core/problems.py): a server that does not answer and a
        # database not created yet are told apart, and each says what to do; one message for
        # both had an operator with a mistyped port run `ocrq migrate`, which failed the same.
        problem = infrastructure_problem(exc)
        log.critical("worker cannot start: %s", problem.message if problem else exc.orig or exc)
        if _missing_database(exc):
            # A server that answers "no such database" gives the same answer to every restart:
            # restarted every minute for ever before. Exit EX_CONFIG, which no supervisor of
            # ocrq's restarts (ocrq/worker/supervisor.py; deploy/systemd's
            # RestartPreventExitStatus).
            return STARTUP_FAILED_EXIT_CODE
        return 1
    finally:
        metrics.DATABASE_WAIT_SINCE.set(0)
    return None


def _first_line(error: BaseException | None) -> str:
    text = str(getattr(error, "orig", None) or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _missing_database(error: BaseException | None) -> bool:
    """PostgreSQL answered that the database does not exist (`database "x" does not exist`)."""
    from sqlalchemy.exc import OperationalError

    line = _first_line(error) if isinstance(error, OperationalError) else ""
    return "database" in line and "does not exist" in line


def check_roots(settings: Settings) -> int | None:
    """A worker that could read any host file does not start: an exit code, or None.

    Otherwise the roots are logged, with a warning for each that looks wrong: a mistyped
    OCRQ_ALLOWED_ROOTS showed only later, as every path job failing "outside allowed roots".
    """
    try:
        settings.require_safe_roots()
    except ValueError as exc:
        log.critical("worker cannot start: %s", exc)
        return STARTUP_FAILED_EXIT_CODE
    log.info("allowed roots for path images: %s", ", ".join(map(str, settings.roots())) or "none")
    for warning in settings.root_warnings():
        log.warning("%s", warning)
    return None


def preflight(settings: Settings) -> int | None:
    """Before the worker touches the broker: safe roots, database at the Alembic head. An exit
    code to stop with, or None to go on. (The worker's entry point runs them apart, its engine
    starting in between: ocrq/worker/main.py.)"""
    refused = check_roots(settings)
    return refused if refused is not None else check_database(settings)


def run_celery(app: Celery, argv: Sequence[str]) -> int:
    """Run `celery worker` in this process until it stops; the exit code says whether this was
    a recycle (or why it could not start)."""
    code = 0
    try:
        app.worker_main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    return STATE.exit_code if STATE.exit_code is not None else code


REPEAT_SIGNAL_S = 1.0  # a stop signal again within this long is the same stop, delivered twice
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def guard_stop_signals(signums: Sequence[int] = STOP_SIGNALS) -> None:
    """Let Celery's handlers for SIGTERM/SIGINT run one at a time, and ignore a repeat: of
    SIGTERM always (a warm stop is under way; Celery does nothing more for another), of SIGINT
    within REPEAT_SIGNAL_S (a person's second Ctrl-C, later, still asks for a cold stop).
    Called once Celery has installed them (the worker bootstep `GuardStopSignals`, before the
    consumer connects: ocrq/worker/celery_app.py).

    Why: a stop reaches a worker twice, from its process group (systemd's control-group kill,
    a terminal's Ctrl-C, `kill -- -PGID`) and from its supervisor, which forwards it. Celery's
    handler sends `worker_shutting_down` under a lock that is not re-entrant; the second signal,
    handled inside the first, waited for that lock forever. A worker hung in its warm shutdown
    until it was killed, its heartbeat row left behind (seen in tests/test_liveness.py, with
    the stacks of its threads). A repeated SIGINT would also turn one Ctrl-C into a cold stop.
    A window alone was not enough for SIGTERM: on a loaded machine the supervisor's copy came
    more than a second after the group's, and the warm stop was announced twice.
    """
    state = {"busy": False}
    last: dict[int, float] = {}

    def guard(handler: Callable[[int, object], object]) -> Callable[[int, object], None]:
        def guarded(signum: int, frame: object) -> None:
            now = time.monotonic()
            repeat = signum in last and (
                signum == signal.SIGTERM or now - last[signum] < REPEAT_SIGNAL_S
            )
            if state["busy"] or repeat:
                return
            last[signum] = now
            state["busy"] = True
            try:
                handler(signum, frame)
            finally:
                state["busy"] = False
                again = signal.getsignal(signum)  # Celery installs a new one for SIGINT
                if callable(again) and not getattr(again, "ocrq_guarded", False):
                    signal.signal(signum, guard(again))

        guarded.ocrq_guarded = True  # type: ignore[attr-defined]
        return guarded

    for signum in signums:
        handler = signal.getsignal(signum)
        if callable(handler) and not getattr(handler, "ocrq_guarded", False):
            signal.signal(signum, guard(handler))


class WarmStopReport:
    """What a warm shutdown waits for, said as it starts and every `EVERY_S` until the process
    ends. Why: Celery says nothing between "worker: Warm shutdown" and its exit, and with jobs
    in flight that was 35 s of silence, which an operator reads as a hang (and kills)."""

    EVERY_S = 10.0

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self.started = time.monotonic()
        self._stop = threading.Event()

    def start(self) -> WarmStopReport:
        active, reserved = _requests()
        log.info(
            "warm shutdown: waiting for %d job(s) in progress to finish (at most %.0f s, "
            "OCRQ_JOB_TIMEOUT_S); %d message(s) taken but not started go back to the queue",
            active,
            self.bound_s,
            reserved,
        )
        threading.Thread(target=self._run, name="ocrq-warm-stop", daemon=True).start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.EVERY_S):
            active, _ = _requests()
            log.info(
                "warm shutdown: %d job(s) still in progress after %.0f s",
                active,
                time.monotonic() - self.started,
            )

    def done(self) -> None:
        self._stop.set()
        log.info("warm shutdown: jobs finished after %.1f s", time.monotonic() - self.started)


def _requests() -> tuple[int, int]:
    """Celery's own count of the requests this worker runs and those it holds unstarted."""
    from celery.worker import state

    active = {r.id for r in tuple(state.active_requests)}
    reserved = {r.id for r in tuple(state.reserved_requests)} - active
    return len(active), len(reserved)
