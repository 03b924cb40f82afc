"""One thread that owns the engine: gathers waiting images, plans a batch, runs it.

Task threads (Celery's, or embedded mode's) only call `submit` and wait on the Future; only the
batcher thread touches the planner and the engine. Every future is resolved exactly once, inside
one try, so a crash in a batch can never leave a Celery task waiting forever.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from models.base import Engine, OcrResult, PreparedImage
from models.costs import CostModel, GiB, ItemCost
from models.memory import memory_of
from worker import metrics
from worker.images import downscale
from worker.planner import Plan, Waiting, plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchConfig:
    max_items: int = 32
    wait_s: float = 0.05  # linger after the first arrival, to let a batch fill
    budget_bytes: int = 8 * GiB  # above the engine's fixed part
    max_shrinks: int = 12  # an oversize image is halved at most this many times
    # After an OOM the budget drops below the failed batch's prediction, then climbs back by
    # `budget_step` of the configured budget after every `clean_batches_to_raise` clean batches.
    oom_backoff: float = 0.8
    clean_batches_to_raise: int = 20
    budget_step: float = 0.05


@dataclass(frozen=True)
class ItemOutcome:
    """What a task thread gets back: a result or the image's own error, and which batch ran it."""

    result: OcrResult | None
    error: BaseException | None
    batch_id: str
    engine: str


@dataclass(frozen=True)
class BatchRecord:
    """One executed batch, for logs, metrics and the idle-time benchmark."""

    batch_id: str
    size: int
    started: float
    ended: float
    predicted_bytes: int
    failed_items: int
    oom_events: int = 0
    budget_bytes: int = 0


@dataclass
class _Entry:
    item: PreparedImage
    cost: ItemCost
    future: Future[ItemOutcome]
    seq: int


@dataclass
class _State:
    waiting: dict[str, _Entry] = field(default_factory=dict)
    seq: int = 0
    stopping: bool = False


class Batcher:
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
        self.memory = memory_of(engine)  # OOM test and release (host defaults if none)
        self.config = config
        # A tuned profile's model when the runtime found one, else the engine's default.
        self.cost_model = cost_model or engine.cost_model()
        self._on_batch = on_batch
        self._state = _State()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ocrq-batcher", daemon=True)
        self.records: deque[BatchRecord] = deque(maxlen=10_000)  # newest batches
        # Batcher-thread state: the budget now in force and the OOM bookkeeping.
        self.budget_bytes = config.budget_bytes
        self.oom_events = 0
        self._clean_batches = 0

    def start(self) -> Batcher:
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
            self._state.waiting[key] = _Entry(item, cost, future, self._state.seq)
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

    # -- batcher thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            entries = self._next_batch()
            if entries is None:
                return
            if entries:
                self._execute(entries)

    def _next_batch(self) -> list[_Entry] | None:
        """Wait for work, linger briefly to fill the batch, then plan. None means: stop."""
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
            waiting = self._state.waiting
            decided = self._plan(waiting)
            for key in decided.oversize:
                self._shrink(waiting[key])
            return [waiting.pop(key) for key in decided.keys]

    def _plan(self, waiting: dict[str, _Entry]) -> Plan:
        items = [Waiting(key, e.cost, e.seq) for key, e in waiting.items()]
        return plan(items, self.budget_bytes, self.cost_model, self.config.max_items)

    def _shrink(self, entry: _Entry) -> None:
        """Halve an image over the budget alone until it fits; fail it if it never does."""
        model = self.cost_model
        for _ in range(self.config.max_shrinks):
            w, h = entry.item.image.size
            if w * h <= 64 * 64:
                break
            before = model.batch_bytes([entry.cost])
            entry.item.image = downscale(entry.item.image, (w * h) // 2)
            entry.item.encoded = None
            entry.cost = self.engine.estimate(entry.item)
            if model.batch_bytes([entry.cost]) >= before:
                break  # the engine upscales small images anyway: shrinking cannot help
            if model.batch_bytes([entry.cost]) <= self.budget_bytes:
                log.info(
                    "downscaled %s from %dx%d to %dx%d to fit the memory budget",
                    entry.item.key,
                    w,
                    h,
                    *entry.item.image.size,
                )
                return
        # Still too big: resolve it as failed, outside the planner's loop.
        key = next(k for k, e in self._state.waiting.items() if e is entry)
        self._state.waiting.pop(key)
        need = model.batch_bytes([entry.cost]) / GiB
        budget = self.budget_bytes / GiB
        error = MemoryError(f"image needs {need:.2f} GiB alone, over the budget {budget:.2f} GiB")
        _resolve(entry.future, ItemOutcome(None, error, "", self.engine.name))

    def _execute(self, entries: list[_Entry]) -> None:
        batch_id = str(uuid.uuid4())
        started = time.monotonic()
        predicted = self.cost_model.batch_bytes([e.cost for e in entries])
        ooms_before = self.oom_events
        failed = 0
        try:
            results = self._run_recovering(entries)
            for entry, res in zip(entries, results, strict=True):
                if isinstance(res, BaseException):
                    failed += 1
                    outcome = ItemOutcome(None, res, batch_id, self.engine.name)
                else:
                    outcome = ItemOutcome(res, None, batch_id, self.engine.name)
                _resolve(entry.future, outcome)
        except BaseException as exc:  # the whole batch failed: every member learns why
            log.exception("batch %s of %d images failed", batch_id, len(entries))
            for entry in entries:
                if _resolve(entry.future, ItemOutcome(None, exc, batch_id, self.engine.name)):
                    failed += 1
        finally:
            ooms = self.oom_events - ooms_before
            self._adapt_budget(ooms)
            record = BatchRecord(
                batch_id,
                len(entries),
                started,
                time.monotonic(),
                predicted,
                failed,
                ooms,
                self.budget_bytes,
            )
            self.records.append(record)
            if self._on_batch is not None:
                try:
                    self._on_batch(record)
                except Exception:
                    log.exception("on_batch hook failed")

    def _run_recovering(self, entries: list[_Entry]) -> list[OcrResult | BaseException]:
        """Run a batch; on OOM free memory, lower the budget, split in halves and retry.

        A single image that still runs out of memory is halved in pixels and retried; only an
        image that fails at the smallest size fails, alone. An OOM never fails a whole batch.
        """
        oom: str | None = None
        try:
            results = self.engine.run([e.item for e in entries])
        except BaseException as exc:
            if not self.memory.is_oom(exc):
                raise
            oom = str(exc)
        if oom is not None:
            # Recover outside the except clause: until it ends, the exception's traceback keeps
            # the failed call's frames alive, and with them its device tensors (activations of
            # the batch that did not fit), so a retry inside it would run out of memory again.
            predicted = self.cost_model.batch_bytes([e.cost for e in entries])
            self._record_oom(len(entries), predicted, oom)
            if len(entries) > 1:
                mid = len(entries) // 2
                return self._run_recovering(entries[:mid]) + self._run_recovering(entries[mid:])
            entry = entries[0]
            w, h = entry.item.image.size
            if w * h <= 64 * 64:
                return [MemoryError(f"out of memory even at {w}x{h}: {oom}")]
            entry.item.image = downscale(entry.item.image, (w * h) // 2)
            entry.item.encoded = None
            entry.cost = self.engine.estimate(entry.item)
            return self._run_recovering(entries)
        if len(results) != len(entries):
            raise RuntimeError(
                f"engine {self.engine.name} returned {len(results)} results for "
                f"{len(entries)} images"
            )
        return list(results)

    def _record_oom(self, size: int, predicted: int, error: str) -> None:
        self.oom_events += 1
        metrics.OOM_EVENTS.inc()
        self.memory.release_memory()
        floor = self.config.budget_bytes // 16
        self.budget_bytes = max(
            floor, min(self.budget_bytes, int(predicted * self.config.oom_backoff))
        )
        log.warning(
            "out of memory on a batch of %d (predicted %.2f GiB): split and retried; budget now "
            "%.2f GiB (%s)",
            size,
            predicted / GiB,
            self.budget_bytes / GiB,
            error,
        )

    def _adapt_budget(self, ooms: int) -> None:
        """Climb back towards the configured budget slowly after clean batches."""
        if ooms:
            self._clean_batches = 0
            return
        self._clean_batches += 1
        target = self.config.budget_bytes
        if self.budget_bytes < target and self._clean_batches >= self.config.clean_batches_to_raise:
            self.budget_bytes = min(
                target, self.budget_bytes + int(target * self.config.budget_step)
            )
            self._clean_batches = 0
            log.info("budget raised to %.2f GiB after clean batches", self.budget_bytes / GiB)


def _resolve(future: Future[ItemOutcome], outcome: ItemOutcome) -> bool:
    """Set a future's result once; a second call is a no-op. Returns whether it set it."""
    if future.done():
        return False
    try:
        future.set_result(outcome)
    except Exception:  # InvalidStateError: resolved concurrently
        return False
    return True
