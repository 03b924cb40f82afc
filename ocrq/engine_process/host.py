"""The engine process: `python -m ocrq.engine_process.host FD`, started by a worker
(ocrq/engine_process/link.py) with one end of a duplex pipe as file descriptor FD.

Why a process: the thread that keeps the GPU's queue full is Python; in the worker it shares one
GIL with hundreds of task threads, Celery's consumer, kombu's acks and the database driver. On
an H200 the running loop's prefill took 56-61 s of a run in the worker against 42-46 s with the
engine alone (bench/results/service_gpu/service_gpu_reading.md, runs 5-7). Here it shares the GIL
only with the threads that preprocess the images it is about to run: the service then made
1.03-1.05x the engine alone's images/s, against 0.92x with the engine in the worker (runs 10-11).

What runs here: the engine, its batcher (the planner, the OOM governor, the running loop) and a
few preprocessing threads. The worker keeps claiming, fetching, decoding, storing and acking.
The pipe carries decoded images in and outcomes out (ocrq/engine_process/wire.py); the pipe
closing means the worker is gone, and this process exits at once: its rows are the worker's
messages, which Redis delivers again.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

from ocrq.core import metrics
from ocrq.core.components import Component, Components
from ocrq.core.process import STATE, setup_process
from ocrq.core.procfs import rss_bytes
from ocrq.core.settings import Settings
from ocrq.engine_process import wire
from ocrq.models.memory import memory_of
from ocrq.scheduling.engine_side import EngineSide, load_engine
from ocrq.scheduling.recycle import MEMORY_CHECK_S
from ocrq.scheduling.vocabulary import BatchRecord, ItemOutcome

log = logging.getLogger(__name__)

CALLS = ("pixel_budget",)  # what the worker may ask the loaded engine


def prepare_threads() -> int:
    """Threads preprocessing images for the batcher: the engine's own slots bound how many run
    its tensor ops at once (ocrq/models/hunyuan/inputs.py); the rest wait there, unpickled."""
    return max(2, min(16, (os.cpu_count() or 2)))


class EngineHost:
    """The engine process's parts, started as components (ocrq/core/components.py): the
    engine, its batcher, the preprocessing threads; stopped in reverse, and a part that fails to
    start stops those before it."""

    def __init__(self, settings: Settings, conn: Connection) -> None:
        self.conn = conn
        self._send_lock = threading.Lock()
        self.settings = settings
        # Read only for a recycler that watches it: HunyuanOCR's reading empties the CUDA cache,
        # a device sync, and the running loop ends a round every few decode steps.
        self.watch_fragmentation = settings.max_fragmentation_gib is not None
        self._fragmentation: tuple[float, int | None] = (-MEMORY_CHECK_S, None)  # (when, bytes)
        self.components = Components("engine process")
        self.components.start([
            Component("engine", self._start_engine, lambda: self.engine.close()),
            # After the engine: the batcher's hook reads its memory.
            Component("batcher", self._start_batcher, lambda: self.batcher.stop()),
            # Stopped first: every image received reaches the batcher before it stops.
            Component("prepare threads", self._start_pool, lambda: self._pool.shutdown(wait=True)),
        ])

    def _start_engine(self) -> None:
        self.side: EngineSide = load_engine(self.settings)
        self.engine = self.side.engine
        self.memory = memory_of(self.engine)

    def _start_batcher(self) -> None:
        self.batcher = self.side.start(self._on_batch)

    def _start_pool(self) -> None:
        self._pool = ThreadPoolExecutor(prepare_threads(), thread_name_prefix="ocrq-prepare")

    def ready(self) -> wire.Ready:
        return wire.Ready(
            name=self.engine.name,
            model_limit=self.engine.model_limit,
            config=self.side.config,
            cost_model=self.side.choice.model,
            pid=os.getpid(),
            phases=STATE.timeline.taken(),
        )

    def send(self, message: object) -> None:
        with self._send_lock:
            self.conn.send(message)

    def serve(self) -> None:
        """Answer the worker until it says stop (a clean stop) or goes away (exit at once)."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                log.warning("the worker went away; the engine process exits")
                os._exit(1)
            if isinstance(message, wire.Submit):
                self._pool.submit(self._run, message)
            elif isinstance(message, wire.Cancel):
                self.batcher.cancel(set(message.keys))
            elif isinstance(message, wire.Call):
                self.send(self._answer(message))
            elif isinstance(message, wire.Stop):
                self._stop()
                return
            else:
                log.error("unknown message from the worker: %r", type(message).__name__)

    def _run(self, message: wire.Submit) -> None:
        """Preprocess one image here, hand it to the batcher; its outcome goes back by itself."""
        item = message.item
        started = time.perf_counter()
        try:
            self.engine.prepare(item)
        except Exception as exc:  # the engine's preprocessing refuses this image: it alone fails
            outcome = ItemOutcome(None, exc, "", self.engine.name)
            self._done(message.seq, outcome, time.perf_counter() - started)
            return
        prepared = time.perf_counter() - started
        try:
            future = self.batcher.submit(item)
        except Exception as exc:  # stopping
            self._done(message.seq, ItemOutcome(None, exc, "", self.engine.name), prepared)
            return
        future.add_done_callback(lambda f: self._done(message.seq, _outcome_of(f), prepared))

    def _done(self, seq: int, outcome: ItemOutcome, prepare_s: float) -> None:
        if outcome.error is not None and not _round_trips(outcome.error):
            # An exception that will not pickle, or not unpickle in the worker (a class with
            # required arguments): its type's name and message travel instead.
            plain = RuntimeError(f"{type(outcome.error).__name__}: {outcome.error}")
            outcome = _with_error(outcome, plain)
        try:
            self.send(wire.Done(seq, outcome, prepare_s))
        except (BrokenPipeError, EOFError, OSError):
            os._exit(1)  # the worker is gone

    def _answer(self, call: wire.Call) -> wire.Reply:
        if call.method not in CALLS:
            return wire.Reply(call.seq, error=f"no such call: {call.method}")
        try:
            return wire.Reply(call.seq, getattr(self.engine, call.method)(*call.args))
        except Exception as exc:
            return wire.Reply(call.seq, error=f"{type(exc).__name__}: {exc}")

    def _on_batch(self, record: BatchRecord) -> None:
        try:
            self.send(wire.Batch(record, self.readings()))
        except (BrokenPipeError, EOFError, OSError):
            os._exit(1)

    def readings(self) -> wire.Readings:
        loop = getattr(self.engine, "loop_counts", None)
        return wire.Readings(
            oom_events=self.batcher.oom_events,
            loop=dict(loop()) if loop is not None else {},
            gpu=metrics.gpu_memory(),
            fragmentation=self._fragmentation_bytes(),
            rss=rss_bytes(),
        )

    def _fragmentation_bytes(self) -> int | None:
        """Read at most every MEMORY_CHECK_S, as the worker's recycler reads it."""
        if not self.watch_fragmentation:
            return None
        when, value = self._fragmentation
        if time.monotonic() - when >= MEMORY_CHECK_S:
            value = self.memory.fragmentation_bytes()
            self._fragmentation = (time.monotonic(), value)
        return value

    def _stop(self) -> None:
        self.components.stop()  # the prepare threads, the batcher, the engine
        self.send(wire.Stopped())


def _outcome_of(future: Future[ItemOutcome]) -> ItemOutcome:
    exc = future.exception()
    if exc is not None:
        return ItemOutcome(None, exc, "", "")
    return future.result()


def _round_trips(error: BaseException) -> bool:
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return True


def _with_error(outcome: ItemOutcome, error: BaseException) -> ItemOutcome:
    return ItemOutcome(
        None, error, outcome.batch_id, outcome.engine, outcome.waited_s, outcome.run_s
    )


def main(argv: list[str]) -> int:
    STATE.timeline.imported()  # its start's phases go to the worker with `Ready`
    # A terminal's Ctrl-C or a group SIGTERM reaches this process too: the worker's warm
    # shutdown, not the signal, ends it (after its rows), else its pipe closing does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    with STATE.timeline.phase("settings"):
        settings: Settings = conn.recv()
    setup_process(settings)
    try:
        host = EngineHost(settings, conn)
    except Exception as exc:
        log.error("engine process: the engine could not start", exc_info=True)
        conn.send(wire.Failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=5)}"))
        return 1
    conn.send(host.ready())
    host.serve()
    return 0


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s"
    )
    sys.exit(main(sys.argv[1:]))
