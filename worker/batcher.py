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
from models.costs import GiB, ItemCost
from worker.images import downscale
from worker.planner import Plan, Waiting, plan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchConfig:
    max_items: int = 32
    wait_s: float = 0.05  # linger after the first arrival, to let a batch fill
    budget_bytes: int = 8 * GiB  # above the engine's fixed part
    max_shrinks: int = 12  # an oversize image is halved at most this many times


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
    ) -> None:
        if config.max_items < 1 or config.budget_bytes <= 0:
            raise ValueError(f"invalid batch config: {config}")
        self.engine = engine
        self.config = config
        self._on_batch = on_batch
        self._state = _State()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="ocrq-batcher", daemon=True)
        self.records: deque[BatchRecord] = deque(maxlen=10_000)  # newest batches

    def start(self) -> Batcher:
        self._thread.start()
        return self

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]:
        """Queue one image; the estimate runs here, in the caller's thread, off the hot loop."""
        future: Future[ItemOutcome] = Future()
        cost = self.engine.estimate(item)
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
        return plan(
            items, self.config.budget_bytes, self.engine.cost_model(), self.config.max_items
        )

    def _shrink(self, entry: _Entry) -> None:
        """Halve an image over the budget alone until it fits; fail it if it never does."""
        model = self.engine.cost_model()
        for _ in range(self.config.max_shrinks):
            w, h = entry.item.image.size
            if w * h <= 64 * 64:
                break
            entry.item.image = downscale(entry.item.image, (w * h) // 2)
            entry.cost = self.engine.estimate(entry.item)
            if model.batch_bytes([entry.cost]) <= self.config.budget_bytes:
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
        budget = self.config.budget_bytes / GiB
        error = MemoryError(f"image needs {need:.2f} GiB alone, over the budget {budget:.2f} GiB")
        _resolve(entry.future, ItemOutcome(None, error, "", self.engine.name))

    def _execute(self, entries: list[_Entry]) -> None:
        batch_id = str(uuid.uuid4())
        started = time.monotonic()
        predicted = self.engine.cost_model().batch_bytes([e.cost for e in entries])
        failed = 0
        try:
            results = self.engine.run([e.item for e in entries])
            if len(results) != len(entries):
                raise RuntimeError(
                    f"engine {self.engine.name} returned {len(results)} results for "
                    f"{len(entries)} images"
                )
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
            record = BatchRecord(
                batch_id, len(entries), started, time.monotonic(), predicted, failed
            )
            self.records.append(record)
            if self._on_batch is not None:
                try:
                    self._on_batch(record)
                except Exception:
                    log.exception("on_batch hook failed")


def _resolve(future: Future[ItemOutcome], outcome: ItemOutcome) -> bool:
    """Set a future's result once; a second call is a no-op. Returns whether it set it."""
    if future.done():
        return False
    try:
        future.set_result(outcome)
    except Exception:  # InvalidStateError: resolved concurrently
        return False
    return True
