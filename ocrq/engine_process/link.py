"""The worker's side of its engine process (ocrq/engine_process/host.py says why there is one).

`EngineLink.start` starts the process and waits until its engine has loaded; it then offers the
two things a JobRunner holds, with the surfaces it already knows:

* `RemoteEngine`: the engine's name, pixel cap and page sizes (what claiming and decoding need);
  its preprocessing runs in the engine process, next to the batcher;
* `RemoteBatcher`: `submit(item) -> Future[ItemOutcome]`, `stop`, `pending`, `records`.

One thread here reads the pipe: outcomes resolve their futures, batch records run the worker's
hooks (log, metrics, recycler) with the engine process's readings. If that process dies, its
rows cannot be finished here: the worker exits too (`on_lost`), its messages unacked, so Redis
delivers them again and its supervisor starts a fresh pair. The process is started with
`subprocess` (fork and exec), never a bare fork, so no CUDA state or lock is inherited.
"""

from __future__ import annotations

import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

from ocrq.core import metrics
from ocrq.core.pixel_budget import PixelBudget
from ocrq.core.process import STATE
from ocrq.core.procfs import rss_bytes
from ocrq.core.settings import Settings
from ocrq.engine_process import wire
from ocrq.models.base import PreparedImage
from ocrq.models.costs import CostModel
from ocrq.scheduling.vocabulary import BatchConfig, BatchRecord, ItemOutcome

log = logging.getLogger(__name__)

LOST_EXIT_CODE = 70  # EX_SOFTWARE: the engine process died; the supervisor restarts the worker
START_TIMEOUT_S = 1800.0  # a large checkpoint from a slow disk, plus CUDA graphs captured
STOP_TIMEOUT_S = 600.0


class EngineStartError(RuntimeError):
    """The engine process could not load its engine: the worker does not start."""


def _exit_worker() -> None:
    os._exit(LOST_EXIT_CODE)


class EngineLink:
    """One engine process, and the pipe to it."""

    def __init__(
        self, proc: subprocess.Popen[bytes], conn: Connection, ready: wire.Ready,
        on_lost: Callable[[], None],
    ) -> None:
        self.proc = proc
        self.conn = conn
        self.ready = ready
        self.on_lost = on_lost
        self.on_batch: Callable[[BatchRecord], None] | None = None
        self.readings = wire.Readings()
        self._send_lock = threading.Lock()
        self._seq = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self._pending_lock = threading.Lock()
        self._stopped = threading.Event()
        self._stopping = False
        self._loop_last: dict[str, float] = {}
        self.engine = RemoteEngine(self)
        self.batcher = RemoteBatcher(self)
        self._reader = threading.Thread(target=self._read, name="ocrq-engine-link", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls, settings: Settings, on_lost: Callable[[], None] = _exit_worker,
        timeout_s: float = START_TIMEOUT_S,
    ) -> EngineLink:
        """Start the engine process and wait for its engine to load; raises EngineStartError."""
        return cls.spawn(settings).wait(on_lost, timeout_s)

    @staticmethod
    def spawn(settings: Settings) -> Spawned:
        """Start the engine process and hand it its settings, without waiting for it: the worker
        sets up the rest meanwhile (ocrq/worker/engine_start.py), then `Spawned.wait`s."""
        ours, theirs = Pipe(duplex=True)
        env = dict(os.environ)
        # Its metrics reach the worker's registry through this link, not the supervisor's files
        # (they would be counted twice).
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        proc = subprocess.Popen(
            [sys.executable, "-m", "ocrq.engine_process.host", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
        )
        theirs.close()
        try:
            ours.send(settings)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return Spawned(proc, ours)

    # -- what the worker reads -----------------------------------------------------------------

    @property
    def config(self) -> BatchConfig:
        return self.ready.config

    @property
    def cost_model(self) -> CostModel:
        return self.ready.cost_model

    def rss_bytes(self) -> int:
        """The worker's resident bytes and its engine process's (at the last batch)."""
        return rss_bytes() + self.readings.rss

    def fragmentation_bytes(self) -> int | None:
        return self.readings.fragmentation

    # -- the pipe ------------------------------------------------------------------------------

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]:
        return self._ask(lambda seq: wire.Submit(seq, item))

    def call(self, method: str, *args: Any) -> Any:
        reply: wire.Reply = self._ask(lambda seq: wire.Call(seq, method, args)).result(60)
        if reply.error is not None:
            raise RuntimeError(f"engine process: {method}: {reply.error}")
        return reply.value

    def _ask(self, message: Callable[[int], object]) -> Future[Any]:
        if self._stopping:
            raise RuntimeError("batcher is stopping; not accepting new images")
        future: Future[Any] = Future()
        seq = next(self._seq)
        with self._pending_lock:
            if not self._pending:
                metrics.engine_progress(busy=True)
            self._pending[seq] = future
        try:
            with self._send_lock:
                self.conn.send(message(seq))
        except Exception:
            with self._pending_lock:
                self._pending.pop(seq, None)
            raise
        return future

    def pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def cancel(self, keys: Collection[str]) -> None:
        """Tell the engine process' batcher to drop these keys; their `Done` comes back."""
        if self._stopping or not keys:
            return
        try:
            with self._send_lock:
                self.conn.send(wire.Cancel(tuple(keys)))
        except (BrokenPipeError, OSError):
            pass  # the engine process is gone: `_read` fails what it held

    def _read(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                break
            except Exception:  # a message that will not unpickle: this thread must go on
                log.exception("unreadable message from the engine process")
                continue
            if isinstance(message, wire.Done):
                metrics.observe_stage("preprocess", message.prepare_s)
                self._resolve(message.seq, message.outcome)
            elif isinstance(message, wire.Reply):
                self._resolve(message.seq, message)
            elif isinstance(message, wire.Batch):
                self._count(message)
            elif isinstance(message, wire.Stopped):
                self._stopped.set()
                return
        if not self._stopping:
            log.critical(
                "the engine process (pid %d) died with %d rows in it; the worker exits so that "
                "their messages are delivered again", self.proc.pid, self.pending(),
            )
            # Before any future fails: a task thread woken by a failure would store it and
            # ack its message, and the job would be lost instead of delivered again.
            self.on_lost()
        self._fail_pending("the engine process stopped")
        self._stopped.set()

    def _resolve(self, seq: int, value: Any) -> None:
        with self._pending_lock:
            future = self._pending.pop(seq, None)
            metrics.engine_progress(busy=bool(self._pending))
        if future is not None and not future.done():
            future.set_result(value)

    def _fail_pending(self, why: str) -> None:
        with self._pending_lock:
            waiting, self._pending = list(self._pending.values()), {}
        for future in waiting:
            if not future.done():
                future.set_exception(RuntimeError(why))

    def _count(self, message: wire.Batch) -> None:
        """What the batcher and the engine counted there, into this process's metrics."""
        before, now = self.readings, message.readings
        self.readings = now
        self.batcher.records.append(message.record)
        if now.oom_events > before.oom_events:
            metrics.OOM_EVENTS.inc(now.oom_events - before.oom_events)
        self._loop_last = metrics.count_loop(now.loop, self._loop_last)
        metrics.set_gpu_memory(now.gpu)
        if self.on_batch is not None:
            try:
                self.on_batch(message.record)
            except Exception:
                log.exception("on_batch hook failed")

    # -- ending --------------------------------------------------------------------------------

    def stop(self, timeout: float | None = STOP_TIMEOUT_S) -> None:
        """Let the engine process finish what it holds, then end it (a warm shutdown)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            with self._send_lock:
                self.conn.send(wire.Stop())
        except (BrokenPipeError, OSError):
            pass
        self._stopped.wait(timeout)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not exit; killing it")
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class Spawned:
    """An engine process started, its engine loading: `wait` for it, or `kill` it."""

    def __init__(self, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.proc, self.conn = proc, conn

    def wait(
        self, on_lost: Callable[[], None] = _exit_worker, timeout_s: float = START_TIMEOUT_S
    ) -> EngineLink:
        """The link, once the engine has loaded; raises EngineStartError (the process gone)."""
        proc, ours = self.proc, self.conn
        try:
            deadline = time.monotonic() + timeout_s
            while not ours.poll(1.0):
                if proc.poll() is not None:
                    raise EngineStartError(f"the engine process exited ({proc.returncode})")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"the engine did not load in {timeout_s:g} s")
            first = ours.recv()
        except (EOFError, OSError) as exc:
            proc.wait(30)
            raise EngineStartError(f"the engine process exited ({proc.returncode})") from exc
        except BaseException:
            self.kill()
            raise
        if isinstance(first, wire.Failed):
            proc.wait(60)
            raise EngineStartError(first.error)
        assert isinstance(first, wire.Ready), first
        # Its start's phases, beside the worker's own (ocrq/core/startup.py).
        STATE.timeline.extend(first.phases, lane="engine process")
        log.info("engine process %d: %s loaded", first.pid, first.name)
        return EngineLink(proc, ours, first, on_lost)

    def kill(self) -> None:
        """End it now (the worker will not start: nothing of it is needed)."""
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class RemoteEngine:
    """What a JobRunner asks of its engine (`EngineFront`), answered from the engine process;
    estimates and preprocessing happen there, beside its batcher."""

    prepares_here = False

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.name = link.ready.name
        self.model_limit = link.ready.model_limit
        # A budget is a function of (task, job cap) once the engine is loaded: asked over the
        # pipe once per pair, not once per job.
        self._budgets: dict[tuple[str, int | None], PixelBudget] = {}

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
        budget = self._budgets.get((task, job_cap))
        if budget is None:
            budget = self.link.call("pixel_budget", task, job_cap)
            if not isinstance(budget, PixelBudget):
                raise RuntimeError(f"engine process: pixel_budget answered {budget!r}")
            if len(self._budgets) < 4096:  # job caps are the producers' own numbers
                self._budgets[(task, job_cap)] = budget
        return budget

    def prepare(self, item: PreparedImage) -> None:
        """Preprocessing runs in the engine process, beside the batcher."""

    def close(self) -> None:
        self.link.stop()


class RemoteBatcher:
    """The batcher in the engine process, behind the `Batcher` surface
    (ocrq/scheduling/vocabulary.py)."""

    def __init__(self, link: EngineLink) -> None:
        self.link = link
        self.config = link.config
        self.records: deque[BatchRecord] = deque(maxlen=10_000)

    @property
    def budget_bytes(self) -> int:
        last = self.records[-1] if self.records else None
        return last.budget_bytes if last is not None else self.config.budget_bytes

    @property
    def oom_events(self) -> int:
        return self.link.readings.oom_events

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]:
        return self.link.submit(item)

    def pending(self) -> int:
        return self.link.pending()

    def cancel(self, keys: Collection[str]) -> None:
        self.link.cancel(keys)

    def stop(self, timeout: float | None = None) -> None:
        self.link.stop(STOP_TIMEOUT_S if timeout is None else timeout)
