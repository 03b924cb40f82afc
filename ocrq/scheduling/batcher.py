"""One thread that owns the engine: gathers waiting images, has the planner decide, runs the plan.

Task threads (Celery's, or embedded mode's) only call `submit` and wait on the Future; only the
batcher thread touches the planner and the engine. Every future is resolved exactly once, inside
one try, so a crash in a batch can never leave a Celery task waiting forever.

The batcher decides nothing: which images form a batch, which are downscaled and to what size,
which fail for being too large alone, are the planner's (ocrq/scheduling/planner.py); running a
batch and recovering from an out-of-memory error, with the budget the governor sets, is the
executor's (ocrq/scheduling/executor.py). A downscale replaces a waiting row by a new one
(ocrq/scheduling/downscaling.py): nothing an engine stored in an item is ever changed under it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field

from ocrq.core import metrics
from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.costs import CostModel
from ocrq.scheduling.downscaling import Downscaler
from ocrq.scheduling.executor import BatchExecutor, log_downscale
from ocrq.scheduling.governor import BudgetGovernor
from ocrq.scheduling.planner import Plan, plan
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


@dataclass
class _State:
    waiting: dict[str, Entry] = field(default_factory=dict)
    seq: int = 0
    stopping: bool = False


class StaticBatcher:
    """Whole batches planned to the memory budget, one at a time: engines with no running loop."""

    def __init__(
        self,
        engine: Engine,
        config: BatchConfig,
        on_batch: Callable[[BatchRecord], None] | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        if config.max_items < 1 or config.budget_bytes <= 0:
            raise ValueError(f"invalid batch config: {config}")
        self.engine = engine
        self.config = config
        # A tuned profile's model when the runtime found one, else the engine's default.
        self.cost_model = cost_model or engine.cost_model()
        governor = config.start_governor()
        self.executor = BatchExecutor(engine, self.cost_model, governor, config.shrink)
        self._on_batch = on_batch
        self._state = _State()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ocrq-batcher", daemon=True)
        self.records: deque[BatchRecord] = deque(maxlen=10_000)  # newest batches

    @property
    def governor(self) -> BudgetGovernor:
        return self.executor.governor

    @property
    def budget_bytes(self) -> int:
        """The budget batches are planned to now (lowered after an OOM)."""
        return self.executor.governor.budget_bytes

    @property
    def oom_events(self) -> int:
        return self.executor.governor.oom_events

    def start(self) -> StaticBatcher:
        self._thread.start()
        return self

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]:
        """Queue one image; the estimate runs here, in the caller's thread, off the hot loop."""
        future: Future[ItemOutcome] = Future()
        try:
            cost = self.engine.estimate(item)
        except Exception as exc:  # an image the engine refuses (absurd aspect, say) fails alone
            future.set_result(ItemOutcome(None, exc, "", self.engine.name))
            return future
        with self._cond:
            if self._state.stopping:
                raise RuntimeError("batcher is stopping; not accepting new images")
            key = f"{item.key}#{self._state.seq}"
            self._state.waiting[key] = Entry(Row(item, cost, self._state.seq), future)
            self._state.seq += 1
            self._cond.notify_all()
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is waiting, then end the thread."""
        with self._cond:
            self._state.stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def pending(self) -> int:
        with self._cond:
            return len(self._state.waiting)

    def cancel(self, keys: Collection[str]) -> None:
        """Waiting images of these keys resolve `Cancelled` now; a batch running is not
        disturbed (an image in it runs to its end)."""
        with self._cond:
            gone = [k for k, e in self._state.waiting.items() if e.row.item.key in keys]
            for key in gone:
                resolve(self._state.waiting.pop(key).future, cancelled(self.engine.name))

    # -- batcher thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            snapshot = self._gather()
            if snapshot is None:
                return
            batch, decided = self._take_batch(snapshot)
            if batch:
                self._execute(batch, decided)

    def _gather(self) -> dict[str, Entry] | None:
        """Wait for work and linger briefly to fill a batch; then what waits (None: stop)."""
        with self._cond:
            while not self._state.waiting:
                if self._state.stopping:
                    return None
                self._cond.wait(0.5)
            deadline = time.monotonic() + self.config.wait_s
            while len(self._state.waiting) < self.config.max_items and not self._state.stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return dict(self._state.waiting)

    def _take_batch(self, snapshot: dict[str, Entry]) -> tuple[dict[str, Entry], Plan]:
        """Plan outside the lock (a size search resizes images), then apply the plan under it.
        An oversize leader is shrunk or failed as planned, and what waits is planned again.

        Only this thread removes waiting entries, so every key of a snapshot still waits when
        its plan is applied; task threads can only have added others.
        """
        while True:
            downscaler = Downscaler(self.engine, {k: e.row.item for k, e in snapshot.items()})
            now = time.monotonic()
            decided = plan(
                [e.waiting(k, now) for k, e in snapshot.items()],
                self.budget_bytes,
                self.cost_model,
                self.config.max_items,
                downscaler.estimate_at,
                self.config.shrink,
                self.config.lanes,
            )
            with self._cond:
                waiting = self._state.waiting
                for shrink in decided.downscale:
                    old = waiting[shrink.key]
                    waiting[shrink.key] = Entry(
                        old.row.shrunk(shrink, downscaler), old.future, old.submitted
                    )
                    log_downscale(old.row.item, waiting[shrink.key].row.item, "to fit the budget")
                for refusal in decided.refused:
                    entry = waiting.pop(refusal.key)
                    outcome = ItemOutcome(None, MemoryError(refusal.reason), "", self.engine.name)
                    resolve(entry.future, outcome)
                batch = {key: waiting.pop(key) for key in decided.keys}
                if batch or not waiting:
                    return batch, decided
                snapshot = dict(waiting)

    def _execute(self, batch: dict[str, Entry], decided: Plan) -> None:
        batch_id = str(uuid.uuid4())
        entries = list(batch.values())
        ooms_before = self.oom_events
        failed = 0
        watching = self._reset_peak()
        metrics.BATCH_SINCE.set(time.time())
        started = time.monotonic()

        def outcome(entry: Entry, result: OcrResult | None, error: BaseException | None) -> None:
            waited, ran = started - entry.submitted, time.monotonic() - started
            resolve(
                entry.future,
                ItemOutcome(result, error, batch_id, self.engine.name, waited, ran),
            )

        try:
            results = self.executor.run({k: e.row for k, e in batch.items()})
            for entry, res in zip(entries, results, strict=True):
                if isinstance(res, BaseException):
                    failed += 1
                    outcome(entry, None, res)
                else:
                    outcome(entry, res, None)
        except BaseException as exc:  # the whole batch failed: every member learns why
            log.exception("batch %s of %d images failed", batch_id, len(entries))
            for entry in entries:
                if not entry.future.done():
                    failed += 1
                    outcome(entry, None, exc)
        finally:
            metrics.BATCH_SINCE.set(0)
            ended = time.monotonic()
            peak = self._peak() if watching else None
            ooms = self.oom_events - ooms_before
            self.executor.finished(ooms)
            record = BatchRecord(
                batch_id,
                len(entries),
                started,
                ended,
                decided.predicted_bytes,
                failed,
                ooms,
                self.budget_bytes,
                len(decided.deferred),
                peak,
            )
            self.records.append(record)
            if self._on_batch is not None:
                try:
                    self._on_batch(record)
                except Exception:
                    log.exception("on_batch hook failed")

    def _reset_peak(self) -> bool:
        """Start a peak-memory window for the batch (the planned-vs-measured metric); whether
        the engine's memory can be watched here."""
        try:
            self.executor.memory.reset_peak_memory()
        except Exception:
            return False
        return True

    def _peak(self) -> int | None:
        try:
            return self.executor.memory.peak_memory_bytes()
        except Exception:
            return None
