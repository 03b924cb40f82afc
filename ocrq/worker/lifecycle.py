"""Run the Celery worker in this process, and supervise such processes on bare metal.

A recycle is a warm shutdown the worker asks of itself: Celery stops consuming, the task
threads in flight finish (the batcher runs their batches and their rows are stored), messages
reserved but not started go back to the queue, and the process exits with RECYCLE_EXIT_CODE.
Whatever supervises it starts a fresh one: Docker (`restart: always`), systemd
(`Restart=always`), Kubernetes, or `ocrq worker` itself, which runs each worker as a new
interpreter (never a fork, so CUDA is never initialised in a forked process): ocrq/worker/main.py.
With `--gpus` it supervises one such process per GPU, each on its own (`supervise`).

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ocrq.worker import metrics
from ocrq.worker.gpus import Gpu, GpuSelectionError
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


REPEAT_SIGNAL_S = 1.0  # a stop signal again within this long is the same stop, delivered twice
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def guard_stop_signals(signums: Sequence[int] = STOP_SIGNALS) -> None:
    """Let Celery's handlers for SIGTERM/SIGINT run one at a time, and ignore a repeat within
    REPEAT_SIGNAL_S. Called once Celery has installed them (at worker_ready).

    Why: a stop reaches a worker twice, from its process group (systemd's control-group kill,
    a terminal's Ctrl-C, `kill -- -PGID`) and from its supervisor, which forwards it. Celery's
    handler sends `worker_shutting_down` under a lock that is not re-entrant; the second signal,
    handled inside the first, waited for that lock forever. A worker hung in its warm shutdown
    until it was killed, its heartbeat row left behind (seen in tests/test_liveness.py, with
    the stacks of its threads). A repeated SIGINT would also turn one Ctrl-C into a cold stop.
    """
    state = {"busy": False}
    last: dict[int, float] = {}

    def guard(handler: Callable[[int, object], object]) -> Callable[[int, object], None]:
        def guarded(signum: int, frame: object) -> None:
            now = time.monotonic()
            if state["busy"] or now - last.get(signum, -REPEAT_SIGNAL_S) < REPEAT_SIGNAL_S:
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


@dataclass(frozen=True)
class Child:
    """One worker process the supervisor keeps running: `python -m ocrq.worker.main ARGV`."""

    argv: tuple[str, ...]  # `celery worker` arguments, its --hostname included
    env: Mapping[str, str]  # its whole environment (it reads its Settings from it once)
    label: str | None = None  # "gpu0" with --gpus; None: the one worker of a plain supervisor


def node_with_label(node: str, label: str) -> str:
    """The Celery node name of one GPU's worker: `ocrq-rapid-7@%h` -> `ocrq-rapid-7-gpu0@%h`."""
    name, sep, host = node.partition("@")
    return f"{name}-{label}{sep}{host}"


def child_env(
    base: Mapping[str, str],
    given: Mapping[str, object],
    gpu: Gpu | None = None,
) -> dict[str, str]:
    """The environment a worker process is started with: `base` (the supervisor's), plus the
    options given on the command line as their OCRQ_* variables, plus, on one GPU of several,
    what makes it that GPU's worker. The one place a child's environment is built.

    On a GPU: CUDA_VISIBLE_DEVICES names it alone (so its engine, its default memory budget and
    its tuned profile, keyed by the device's name, are that GPU's); CUDA_DEVICE_ORDER=PCI_BUS_ID
    unless set, so indices are nvidia-smi's; OCRQ_DEVICE `auto` becomes `cuda:0`, so a GPU that
    is not there fails at start-up (exit 78) instead of running the model on the CPU. (Metrics:
    the supervisor serves each child's, see `supervise`.)
    """
    env = {**base, **{f"OCRQ_{k.upper()}": str(v) for k, v in given.items() if v is not None}}
    if gpu is None:
        return env
    env.pop("OCRQ_GPUS", None)  # the child is one worker, not a supervisor
    env["CUDA_VISIBLE_DEVICES"] = gpu.visible
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    device = env.get("OCRQ_DEVICE", "auto").strip().lower() or "auto"
    if device == "auto":
        env["OCRQ_DEVICE"] = "cuda:0"
    elif device not in ("cuda", "cuda:0"):
        raise GpuSelectionError(
            f"OCRQ_DEVICE={device} with --gpus: each worker sees only its own GPU, as cuda:0; "
            "leave OCRQ_DEVICE unset (auto)"
        )
    return env


def worker_children(
    argv: Sequence[str],
    node: str,
    base_env: Mapping[str, str],
    given: Mapping[str, object],
    gpus: Sequence[Gpu] = (),
) -> list[Child]:
    """The worker processes to supervise: one, or one per GPU (its label in its node name)."""
    if not gpus:
        return [Child((*argv, "--hostname", node), child_env(base_env, given))]
    return [
        Child(
            (*argv, "--hostname", node_with_label(node, gpu.label)),
            child_env(base_env, given, gpu),
            gpu.label,
        )
        for gpu in gpus
    ]


def _say(child: Child, message: str) -> None:
    prefix = "ocrq supervisor: " + (f"{child.label}: " if child.label else "")
    print(prefix + message, file=sys.stderr, flush=True)


class _Metrics:
    """The supervisor's side of a child's metrics and health (ocrq/worker/metrics.py): a
    multiprocess folder the child's processes write to, served by this process on `port`, so
    counters outlive recycles. One per child: with --gpus each GPU's worker has its own port
    (OCRQ_METRICS_PORT + its index), so its health and figures are its own."""

    def __init__(self, settings: Settings, port: int, alive: Callable[[], bool]) -> None:
        from ocrq.worker import monitor

        self.folder = tempfile.mkdtemp(prefix="ocrq-metrics-")  # fresh: no stale files summed
        registry = monitor.multiprocess_registry(self.folder)
        try:
            monitor.serve(
                monitor.Monitor(registry, settings, process_alive=alive),
                port,
                settings.metrics_address,
            )
        except OSError:
            self.close()
            raise

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        out = {k: v for k, v in env.items() if k.upper() != "OCRQ_METRICS_PORT"}
        out["PROMETHEUS_MULTIPROC_DIR"] = self.folder
        return out

    def exited(self, pid: int) -> None:  # its gauges go; its counters and histograms stay
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.folder)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def supervise(
    children: Sequence[Child], settings: Settings | None = None, max_crash_backoff_s: float = 30.0
) -> int:
    """Keep each child running: start it again after a recycle or a crash, on its own.

    Each child has a thread that starts it, waits for it and decides; the children's fates are
    independent (one recycling, crashing or being killed leaves the others' processes alone).
    A recycle restarts at once; a crash restarts after a growing pause, so a worker that dies
    at start-up does not spin. A child that exits STARTUP_FAILED_EXIT_CODE is not restarted
    (restarting will not help) and the others go on: a broken GPU must not take the host's
    other GPUs offline, and a configuration error common to all (a missing model, an unmigrated
    database) stops every child the same way, so the supervisor then exits 78 too. SIGTERM/SIGINT
    are forwarded to every child (a warm shutdown each) and the supervisor returns once all have
    exited. The exit code is the first failure's (78 if a child gave up), else 0.
    With `settings.metrics_port`, this process serves each child's metrics and health (`_Metrics`).
    """
    stopping = threading.Event()
    running: dict[int, subprocess.Popen[bytes]] = {}
    lock = threading.Lock()  # taken by the child threads and the handler, never held by main

    def alive(slot: int) -> Callable[[], bool]:
        def check() -> bool:
            proc = running.get(slot)
            return proc is not None and proc.poll() is None

        return check

    served: list[_Metrics | None] = [None] * len(children)
    if settings is not None and settings.metrics_port is not None:
        try:
            served = [
                _Metrics(settings, settings.metrics_port + i, alive(i))
                for i in range(len(children))
            ]
        except OSError as exc:  # the port is taken: a config error, not worth restarting
            print(
                f"ocrq supervisor: cannot serve OCRQ_METRICS_PORT={settings.metrics_port}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return STARTUP_FAILED_EXIT_CODE

    def forward(signum: int, _frame: object) -> None:
        stopping.set()
        with lock:
            live = list(running.values())
        for proc in live:
            if proc.poll() is None:
                proc.send_signal(signum)

    def keep(slot: int, child: Child) -> int:
        backoff = 1.0
        recycles = 0
        watch = served[slot]
        env = dict(child.env) if watch is None else watch.child_env(child.env)
        while True:
            started = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "ocrq.worker.main", *child.argv], env=env
            )
            with lock:
                running[slot] = proc
            if stopping.is_set():  # a stop that came while it was being started
                proc.send_signal(signal.SIGTERM)
            _say(child, f"started worker process pid {proc.pid}")
            code = proc.wait()
            with lock:
                running.pop(slot, None)
            if watch is not None:
                watch.exited(proc.pid)
            if stopping.is_set():
                return 0 if code in (0, RECYCLE_EXIT_CODE, -signal.SIGTERM) else code
            if code == STARTUP_FAILED_EXIT_CODE:
                others = len(children) - 1
                _say(
                    child,
                    "worker cannot start (see above); not restarting"
                    + (f" it (the other {others} go on)" if others else ""),
                )
                return code
            if code == RECYCLE_EXIT_CODE:
                recycles += 1
                _say(child, f"worker recycled ({recycles} so far); starting a new one")
                backoff = 1.0
                continue
            # Any other exit that we did not ask for (a crash, an unrecoverable broker error, a
            # remote shutdown) gets a new worker: a supervisor's job is to keep one running.
            if time.monotonic() - started > 60:
                backoff = 1.0
            _say(child, f"worker exited with {code}; restarting in {backoff:.0f} s")
            if stopping.wait(backoff):
                return code
            backoff = min(backoff * 2, max_crash_backoff_s)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: list[int | None] = [None] * len(children)

    def run(slot: int, child: Child) -> None:
        codes[slot] = keep(slot, child)

    threads = [
        threading.Thread(target=run, args=(i, c), name=f"ocrq-child-{c.label or i}", daemon=True)
        for i, c in enumerate(children)
    ]
    if any(c.label for c in children):
        port = settings.metrics_port if settings is not None else None
        gpus = (
            f"{c.label} (CUDA_VISIBLE_DEVICES={c.env.get('CUDA_VISIBLE_DEVICES')}"
            + (f", metrics on :{port + i})" if port is not None else ")")
            for i, c in enumerate(children)
        )
        print(
            "ocrq supervisor: one worker process per GPU: " + ", ".join(gpus),
            file=sys.stderr,
            flush=True,
        )
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)  # short waits: the signal handler runs in this thread
    finally:
        for watch in served:
            if watch is not None:
                watch.close()
    failed = [c for c in codes if c]
    if STARTUP_FAILED_EXIT_CODE in failed:
        return STARTUP_FAILED_EXIT_CODE
    return failed[0] if failed else 0
