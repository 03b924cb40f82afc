"""Supervise worker processes on bare metal: `ocrq worker` runs each worker as a new
interpreter (`python -m ocrq.worker.main`), restarts it after a recycle or a crash, and with
`--gpus` runs one such process per GPU, each on its own (`supervise`). The worker process's own
exit state and exit codes are in ocrq/worker/exit_state.py.
"""

from __future__ import annotations

import contextlib
import ctypes
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

from ocrq.scheduling.recycle import RECYCLE_EXIT_CODE
from ocrq.worker.exit_state import STARTUP_FAILED_EXIT_CODE
from ocrq.worker.gpus import Gpu, GpuSelectionError

if TYPE_CHECKING:
    from ocrq.core.settings import Settings

log = logging.getLogger(__name__)

# Set in a worker process's environment to its supervisor's pid: see `die_with_supervisor`.
SUPERVISOR_PID_ENV = "OCRQ_SUPERVISOR_PID"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_supervisor(env: Mapping[str, str] = os.environ) -> bool:
    """In a worker process a supervisor started: ask Linux for SIGTERM (a warm shutdown) when
    the supervisor dies, however it dies. A supervisor killed with -9 left its worker consuming,
    orphaned, with no one serving its metrics or restarting it (issue 31). False when the
    supervisor is gone already (it died before this ran): the caller exits at once.

    The signal follows the thread that started the process; the supervisor's thread for a
    worker waits on it for its whole life, so that is the supervisor's life too."""
    expected = env.get(SUPERVISOR_PID_ENV)
    if not expected:
        return True  # started by systemd, Kubernetes, a test: they own its life
    with contextlib.suppress(Exception):  # not Linux: the orphan case stays as it was
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == int(expected)


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
    """The supervisor's side of a child's metrics and health (ocrq/core/metrics.py): a
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


def _declare_dead(settings: Settings, child: Child, pid: int) -> None:
    """Tell the other workers at once that this child died (its heartbeat row marked dead): its
    running jobs and the messages it held are re-sent by the next sweep, the restarted child's
    among them, instead of after OCRQ_STALLED_AFTER_S (60 s) of silence. The child's worker
    name is its Celery node name, `/`, its pid and a random tag (ocrq/worker/heartbeat.py)."""
    from celery.utils.nodenames import default_nodename, host_format

    from ocrq.core import workers_table
    from ocrq.core.db import get_engine

    argv = list(child.argv)
    node = argv[argv.index("--hostname") + 1] if "--hostname" in argv[:-1] else None
    if node is None:
        return
    prefix = f"{host_format(default_nodename(node))}/{pid}-"
    try:
        marked = workers_table.mark_dead(get_engine(settings.database_url), prefix)
    except Exception as exc:  # the database away: the heartbeat goes stale all the same
        _say(child, f"could not mark the dead worker's row ({type(exc).__name__}: {exc})")
        return
    if marked:
        _say(child, "its jobs are re-sent by the next sweep (marked dead)")


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
        if not stopping.is_set():  # a stop reaches us twice (the group's, a repeat): say it once
            # os.write, not print: a handler that interrupts a print of the main thread's would
            # re-enter the same buffered writer and raise.
            line = f"ocrq supervisor: stopping on {signal.Signals(signum).name}\n"
            with contextlib.suppress(OSError):
                os.write(sys.stderr.fileno(), line.encode())
        stopping.set()
        pass_on(signum, _frame)

    def pass_on(signum: int, _frame: object) -> None:
        """`signum` to every live child. Alone for SIGUSR1 (Celery writes every thread's
        stacks to the log: a worker that seems stuck): sent to `ocrq worker`'s pid, the one an
        operator sees, it killed the supervisor (the signal's default) and with it the worker
        it was meant to look into."""
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
                [sys.executable, "-m", "ocrq.worker.main", *child.argv],
                env={**env, SUPERVISOR_PID_ENV: str(os.getpid())},
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
                _say(child, f"worker exited (code {code})")
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
            if settings is not None:
                _declare_dead(settings, child, proc.pid)
            if time.monotonic() - started > 60:
                backoff = 1.0
            _say(child, f"worker exited with {code}; restarting in {backoff:.0f} s")
            if stopping.wait(backoff):
                return code
            backoff = min(backoff * 2, max_crash_backoff_s)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGUSR1, pass_on)
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
    code = (
        STARTUP_FAILED_EXIT_CODE if STARTUP_FAILED_EXIT_CODE in failed
        else failed[0] if failed else 0
    )
    # The last line of a supervisor's log, so a stop reads as finished, not cut off.
    print(f"ocrq supervisor: stopped (exit {code})", file=sys.stderr, flush=True)
    return code
