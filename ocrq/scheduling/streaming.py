"""The batcher for an engine with a running decode loop: rows handed over as room frees up, each
future resolved the moment its row finishes.

The same `Batcher` surface (ocrq/scheduling/vocabulary.py) as the static batcher (submit ->
Future, stop, records, budget), so the job runner and the runtime need not know which one they
hold; same rules: only this thread touches the planner and the engine, every future is resolved
exactly once. What differs:

* the engine sizes its loop once from the budget (`StreamingEngine.open`: slots, a KV pool, one
  prefill pass reserved) and decides, alone, which rows run when: the loop's scheduler
  (ocrq/models/loop/scheduler.py) holds its only waiting queue and KV book, and orders its rows
  by this batcher's lane rule (`BatchConfig.lanes`, handed to `open`: one bound on a bulk row's
  wait, OCRQ_BULK_MAX_WAIT_S; ocrq/core/lanes.py). This batcher hands it every waiting row at
  once, in the lanes' order (`admission_order`), after one check per row (`fit_running`,
  pure): a row too big for the loop alone is downscaled or refused. It keeps no ledger of the
  loop's memory, only the rows handed over (`_handed`, to resolve their futures);
* `engine.poll` runs the loop until some row ends; its job is resolved at once, so its task
  thread stores the row and acks while the other rows decode on. Detokenising and parsing a
  finished row (`Finished.resolve`) run on a finisher thread, not on the thread that keeps the
  GPU's queue full;
* a hand-over runs only when something changed (a row arrived or was requeued);
* every LOOP_LOG_S the loop's running totals (`engine.loop_counts()`: steps, their GPU seconds,
  prefill passes and tokens, live rows per lane) go to the log as one `running loop totals:`
  JSON line, so a bench can read a run's step figures from the worker's log
  (bench/lanes.py `loop_figures`);
* an out-of-memory error from the loop lowers the budget (the governor), reopens the loop smaller
  and puts the rows in flight back at the front of the queue: no job fails for it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from ocrq.core import metrics
from ocrq.models.base import Finished, PreparedImage, StreamingEngine
from ocrq.models.costs import CostModel, GiB
from ocrq.models.memory import memory_of
from ocrq.models.slots import RunningBudget
from ocrq.scheduling.downscaling import Downscaler
from ocrq.scheduling.executor import log_downscale
from ocrq.scheduling.planner import Downscale, admission_order, fit_running
from ocrq.scheduling.vocabulary import (
    BatchConfig,
    BatchRecord,
    Entry,
    ItemOutcome,
    Row,
    cancelled,
    resolve,
)

log = logging.getLogger(__name__)


class _Handed(NamedTuple):
    """A row handed to the engine: its entry (its future), and when it was handed over (with
    the count of rows handed, what Little's law needs: bench/sustained.py)."""

    entry: Entry
    handed: float


POLL_S = 0.05  # longest the loop runs before this thread looks at new arrivals
LOOP_LOG_S = 5.0  # seconds between two `running loop totals:` log lines


class StreamingBatcher:
    def __init__(
        self,
        engine: StreamingEngine,
        config: BatchConfig,
        on_batch: Callable[[BatchRecord], None] | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        if config.max_items < 1 or config.budget_bytes <= 0:
            raise ValueError(f"invalid batch config: {config}")
        self.engine = engine
        self.config = config
        self.cost_model = cost_model or engine.cost_model()
        self.memory = memory_of(engine)
        self.governor = config.start_governor()
        self.loop: RunningBudget = engine.open(config.budget_bytes, self.cost_model,
                                               config.lanes)
        self._on_batch = on_batch
        self._cond = threading.Condition()
        self._waiting: dict[str, Entry] = {}
        # Engine key (the job's) -> the row handed to the engine, waiting in its loop or running.
        self._handed: dict[str, _Handed] = {}
        self._seq = 0
        self._changed = False  # a row arrived or was requeued since the last hand-over
        self._cancels: set[str] = set()  # keys to drop from the loop at its next harvest
        self._loop_counts: dict[str, float] = {}  # the engine's totals at the last count
        self._loop_logged = 0.0  # time.monotonic() of the last `running loop totals:` line
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="ocrq-finish")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="ocrq-streaming", daemon=True)
        self.records: deque[BatchRecord] = deque(maxlen=10_000)

    @property
    def budget_bytes(self) -> int:
        return self.governor.budget_bytes

    @property
    def oom_events(self) -> int:
        return self.governor.oom_events

    def start(self) -> StreamingBatcher:
        self._thread.start()
        return self

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]:
        future: Future[ItemOutcome] = Future()
        try:
            cost = self.engine.estimate(item)
        except Exception as exc:  # an image the engine refuses fails alone
            future.set_result(ItemOutcome(None, exc, "", self.engine.name))
            return future
        with self._cond:
            if self._stopping:
                raise RuntimeError("batcher is stopping; not accepting new images")
            key = f"{item.key}#{self._seq}"
            self._waiting[key] = Entry(Row(item, cost, self._seq), future)
            self._seq += 1
            self._changed = True
            self._cond.notify_all()
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is waiting and in flight, then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # else it may still hand rows to the finisher
            self._finisher.shutdown(wait=True)

    def pending(self) -> int:
        with self._cond:
            return len(self._waiting) + len(self._handed)

    def cancel(self, keys: Collection[str]) -> None:
        """Waiting rows of these keys resolve `Cancelled` now; rows the engine holds are
        dropped by this batcher's thread after the loop's next harvest (`_drop_cancelled`)."""
        with self._cond:
            gone = [k for k, e in self._waiting.items() if e.row.item.key in keys]
            for key in gone:
                resolve(self._waiting.pop(key).future, cancelled(self.engine.name))
            self._cancels.update(keys)
            self._changed = self._changed or bool(gone)
            self._cond.notify_all()

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._handed:
                    if self._stopping:
                        self._log_loop(force=True)
                        return
                    self._cond.wait(0.5)
            try:
                self._hand_over()
                self._drop_cancelled()
                self._collect()
            except Exception:  # never let the thread die with futures waiting
                log.exception("running loop failed")
                self._fail_handed(RuntimeError("the running loop failed; see the worker log"))

    def _log_loop(self, force: bool = False) -> None:
        """The loop's totals as one JSON line, every LOOP_LOG_S (and at the end)."""
        now = time.monotonic()
        if not self._loop_counts or (not force and now - self._loop_logged < LOOP_LOG_S):
            return
        self._loop_logged = now
        totals = {k: round(v, 4) for k, v in sorted(self._loop_counts.items())}
        # Two gauges beside the totals, read without the lock (a log line, not a decision):
        # rows waiting in the loop's own queue and rows still held here. The lanes bench reads
        # them: how deep the backlog in the loop is decides how the lane rule plays out.
        totals["waiting_now"] = self.engine.queued()
        totals["held_now"] = len(self._waiting)
        log.info("running loop totals: %s", json.dumps(totals))

    def _hand_over(self) -> None:
        """Every waiting row to the engine, in the lanes' order; a row too big for the loop
        alone downscaled first, or refused."""
        with self._cond:
            if not self._changed:
                return
            self._changed = False
            snapshot = dict(self._waiting)
        if not snapshot:
            return
        downscaler = Downscaler(self.engine, {k: e.row.item for k, e in snapshot.items()})
        now = time.monotonic()
        order = admission_order([e.waiting(k, now) for k, e in snapshot.items()],
                                self.config.lanes)
        rows = []
        idle = not self._handed
        with self._cond:
            for w in order:
                fate = fit_running(w, self.loop, downscaler.estimate_at, self.config.shrink)
                entry = self._waiting.pop(w.key)
                if isinstance(fate, Downscale):
                    old, entry = entry, Entry(entry.row.shrunk(fate, downscaler), entry.future,
                                              entry.submitted)
                    log_downscale(old.row.item, entry.row.item, "to fit the loop")
                elif fate is not None:
                    resolve(entry.future,
                            ItemOutcome(None, MemoryError(fate.reason), "", self.engine.name))
                    continue
                item = entry.row.item
                self._handed[item.key] = _Handed(entry, now)
                rows.append(item)
        if rows:
            self.engine.submit(rows)
            if idle:
                metrics.engine_progress(busy=True)

    def _drop_cancelled(self) -> None:
        """Rows the engine holds whose jobs were cancelled: out of the loop (their slots and KV
        free for the rows waiting), their futures resolved `Cancelled`. Keys not held (not
        handed over yet, or finished) are forgotten: the worker asks again while it runs them."""
        with self._cond:
            asked, self._cancels = self._cancels, set()
        held = [key for key in asked if key in self._handed]
        if not held:
            return
        dropped = self.engine.drop(held)
        for key in dropped:
            resolve(self._handed.pop(key).entry.future, cancelled(self.engine.name))
        if dropped:
            metrics.engine_progress(busy=bool(self._handed))
            log.info("dropped %d cancelled row(s) from the running loop", len(dropped))

    def _collect(self) -> None:
        """Run the loop a little; resolve every row that finished."""
        started = time.monotonic()
        # New arrivals are looked at between polls: every POLL_S while the loop holds rows (it
        # queues them all now, so a backlog no longer waits here).
        wait = POLL_S if self._waiting or self._handed else 0.5
        try:
            finished = self.engine.poll(wait)
        except Exception as exc:
            if not self.memory.is_oom(exc):
                raise
            self._recover(repr(exc)[:300])
            return
        if not finished:
            return
        batch_id = str(uuid.uuid4())
        failed = 0
        row_seconds = 0.0
        for f in finished:
            held = self._handed.pop(f.key, None)
            if held is None:
                continue
            failed += isinstance(f.result, BaseException)
            ended = time.monotonic()
            # in the loop: from its admission where the engine says (queued rows wait there)
            row_seconds += ended - (f.started_at or held.handed)
            self._finisher.submit(self._finish, held.entry, f, batch_id, ended)
        metrics.engine_progress(busy=bool(self._handed))
        self._loop_counts = metrics.count_loop(self.engine.loop_counts(), self._loop_counts)
        self._log_loop()
        self.governor = self.governor.after_batch(0)
        queued = self.engine.queued()  # handed over, waiting in the loop's own queue
        record = BatchRecord(
            batch_id,
            len(finished),
            started,
            time.monotonic(),
            self.loop.bytes,
            failed,
            0,
            self.budget_bytes,
            len(self._waiting) + queued,
            in_flight=len(self._handed) - queued,
            row_seconds=row_seconds,
        )
        self.records.append(record)
        if self._on_batch is not None:
            try:
                self._on_batch(record)
            except Exception:
                log.exception("on_batch hook failed")

    def _finish(self, entry: Entry, finished: Finished, batch_id: str, ended: float) -> None:
        """Its result, and its stages: waiting for the loop (submit to prefill) and in it."""
        result = finished.resolve()
        started = finished.started_at or entry.submitted
        waited, ran = max(0.0, started - entry.submitted), max(0.0, ended - started)
        name = self.engine.name
        if isinstance(result, BaseException):
            outcome = ItemOutcome(None, result, batch_id, name, waited, ran)
        else:
            outcome = ItemOutcome(result, None, batch_id, name, waited, ran)
        resolve(entry.future, outcome)

    def _recover(self, message: str) -> None:
        """Out of memory inside the loop: the rows handed over go back to the front of the queue
        (their arrival order, `admission_order`), the budget drops below what the loop held, and
        the loop is opened again within it."""
        self.engine.reset()
        self.governor = self.governor.after_oom(self.loop.bytes)
        metrics.OOM_EVENTS.inc()
        with self._cond:
            for key, held in list(self._handed.items()):
                self._waiting[f"{key}#retry{held.entry.row.seq}"] = held.entry
            self._handed.clear()
            self._changed = True
        metrics.engine_progress(busy=False)  # its rows are handed over again from scratch
        self.loop = self.engine.open(self.governor.budget_bytes, self.cost_model,
                                     self.config.lanes)
        log.warning(
            "out of memory in the running loop (%s); budget now %.2f GiB, rows in flight queued "
            "again",
            message,
            self.governor.budget_bytes / GiB,
        )

    def _fail_handed(self, exc: BaseException) -> None:
        self.engine.reset()
        for held in self._handed.values():
            resolve(held.entry.future, ItemOutcome(None, exc, "", self.engine.name))
        self._handed.clear()
        metrics.engine_progress(busy=False)
        try:
            self.loop = self.engine.open(self.governor.budget_bytes, self.cost_model,
                                         self.config.lanes)
        except Exception:
            log.exception("could not reopen the running loop")
