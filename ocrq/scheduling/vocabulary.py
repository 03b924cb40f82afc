"""The words every batcher speaks, in one place: the static batcher (ocrq/scheduling/batcher.py),
the running loop's (ocrq/scheduling/streaming.py) and the engine process' link and wire
(ocrq/engine_process/) import them from here, so none reaches into another's private names.

Why a protocol and not a base class: the three batchers share no code paths worth inheriting
(one plans whole batches, one hands rows to a running loop, one forwards to another process);
what they share is the surface a job runner calls, which `Batcher` names and the type checker
holds them to.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ocrq.core.contract import BULK, INTERACTIVE
from ocrq.core.lanes import LaneRule
from ocrq.models.base import OcrResult, PreparedImage
from ocrq.models.costs import GiB, ItemCost
from ocrq.scheduling.governor import BudgetGovernor
from ocrq.scheduling.planner import Downscale, ShrinkRule, Waiting

if TYPE_CHECKING:
    from ocrq.scheduling.downscaling import Downscaler


@dataclass(frozen=True)
class BatchConfig:
    max_items: int = 32
    wait_s: float = 0.05  # linger after the first arrival, to let a batch fill
    budget_bytes: int = 8 * GiB  # above the engine's fixed part
    shrink: ShrinkRule = field(
        default_factory=ShrinkRule
    )  # how far an image over the budget alone may be halved
    # Interactive rows first; a bulk row promoted after OCRQ_BULK_MAX_WAIT_S (ocrq/core/lanes.py):
    # the planner's order, the streaming batcher's hand-over and the running loop's queue.
    lanes: LaneRule = field(default_factory=LaneRule)
    # After an OOM the budget drops below the failed batch's prediction, then climbs back by
    # `budget_step` of the configured budget after every `clean_batches_to_raise` clean batches
    # (ocrq/scheduling/governor.py).
    oom_backoff: float = 0.8
    clean_batches_to_raise: int = 20
    budget_step: float = 0.05

    def start_governor(self) -> BudgetGovernor:
        """The budget governor this config describes (each batcher kind starts one)."""
        return BudgetGovernor.start(
            self.budget_bytes,
            oom_backoff=self.oom_backoff,
            clean_batches_to_raise=self.clean_batches_to_raise,
            budget_step=self.budget_step,
        )


@dataclass(frozen=True)
class ItemOutcome:
    """What a task thread gets back: a result or the image's own error, and which batch ran it."""

    result: OcrResult | None
    error: BaseException | None
    batch_id: str
    engine: str
    waited_s: float = 0.0  # from `submit` to its batch's start: the wait for a batch
    run_s: float = 0.0  # its batch's engine time (OOM splits and retries included)


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
    deferred: int = 0  # images left waiting when it was planned (the plan's `deferred`)
    measured_peak_bytes: int | None = None  # the engine's peak during it (memory_of(engine))
    # The running loop only: rows handed to the engine and not yet finished after this round,
    # and the seconds the rows that finished spent there (hand-over to finish, summed). With
    # `deferred` they are what a sustained rate is measured from (bench/sustained.py).
    in_flight: int = 0
    row_seconds: float = 0.0


@dataclass(frozen=True)
class Row:
    """One image as the planner sees it: the item, its estimated cost, its arrival order."""

    item: PreparedImage
    cost: ItemCost
    seq: int

    def waiting(self, key: str, waited_s: float = 0.0) -> Waiting:
        w, h = self.item.image.size
        lane = INTERACTIVE if self.item.priority == INTERACTIVE else BULK
        return Waiting(key, self.cost, self.seq, pixels=w * h, lane=lane, waited_s=waited_s)

    def shrunk(self, to: Downscale, downscaler: Downscaler) -> Row:
        """The same image at the planner's smaller size, at the cost the planner saw."""
        return replace(self, item=downscaler.item_at(to.key, to.pixels), cost=to.cost)


@dataclass(frozen=True)
class Entry:
    """A waiting row and the future its task thread waits on."""

    row: Row
    future: Future[ItemOutcome]
    submitted: float = field(default_factory=time.monotonic)

    def waiting(self, key: str, now: float) -> Waiting:
        """The row as the planner sees it at `now` (time.monotonic): its lane and its wait."""
        return self.row.waiting(key, max(0.0, now - self.submitted))


class Cancelled(Exception):
    """The image's job was cancelled while it waited for, or ran in, a batcher: it was dropped
    and has no result (the job's row says `cancelled` already)."""


def cancelled(engine: str) -> ItemOutcome:
    return ItemOutcome(None, Cancelled("cancelled by request; dropped"), "", engine)


@runtime_checkable
class Batcher(Protocol):
    """What a job runner and the runtime ask of any batcher: hand over an image and wait on its
    future; read the budget in force and the OOMs met; stop. Every future a batcher returns is
    resolved exactly once, with the image's result or its own error."""

    records: deque[BatchRecord]

    @property
    def budget_bytes(self) -> int: ...

    @property
    def oom_events(self) -> int: ...

    def submit(self, item: PreparedImage) -> Future[ItemOutcome]: ...

    def pending(self) -> int: ...

    def cancel(self, keys: Collection[str]) -> None:
        """Drop the images of these keys (their jobs were cancelled): each future resolves
        with `Cancelled`, a waiting one at once, one a running loop holds at its next harvest.
        Keys it does not hold are ignored; an image in a static batch already running is not
        dropped (that batch goes on; the job's result is not stored)."""
        ...

    def stop(self, timeout: float | None = None) -> None: ...


def resolve(future: Future[ItemOutcome], outcome: ItemOutcome) -> bool:
    """Set a future's result once; a second call is a no-op. Returns whether it set it."""
    if future.done():
        return False
    try:
        future.set_result(outcome)
    except Exception:  # InvalidStateError: resolved concurrently
        return False
    return True
