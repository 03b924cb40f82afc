"""`LoopScheduler`: the running loop's waiting queue, lane rule and KV book in one place.

Why: the loop's decisions (which waiting rows to prefill, into which slots and pool ranges, when)
were spread over two levels (the batcher's planner held rows back against its own ledger of the
pool, the loop kept a second queue, admission policy and pool beside its device state); here
they are plain data and arithmetic, planned once per tick and checked without a device, and the
Hunyuan runner (ocrq/models/hunyuan/runner.py) only carries a plan out. The rule:

* prefill schedules (`schedule`): "alternate" waits until a quarter of the slots are free (or
  nothing runs) and then fills one pass; "chunked" plans a pass before every decode step, with
  `prefill_gap` steps between passes unless a pass is full or nothing runs;
* which rows a pass takes: the lanes' rule (ocrq/models/loop/lane_pass.py `lane_pass`): interactive
  rows first and into reserved slots, bulk rows held while the lane is busy, promoted after
  `bulk_max_wait_s` seconds in the queue (the batcher's `LaneRule`, ocrq/core/lanes.py; one
  setting, OCRQ_BULK_MAX_WAIT_S); an interactive row waiting skips either schedule's wait;
* the KV book (ocrq/models/slots.py `KvPool`): a row holds `capacity_of(prompt, cap)` tokens
  from its admission to its end, asked once when it is queued.

One tick: `schedule(now)` returns a `StepPlan`; the runner drops, prefills and decodes as it
says and hands back a `StepOutput`; `update` frees the finished rows' slots and ranges and names
each finished row once, however many outputs name it.

Two clocks, both the caller's: the decode steps the runner reports (`update`: the prefill gaps)
and the time, monotonic seconds handed to `add` and `schedule` (a row's wait, for promotion).
No clock is read here, so a test drives the time as it likes.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from ocrq.models.loop.lane_pass import LanePolicy, LoopState, Waiter, lane_pass
from ocrq.models.loop.plan import Admit, Request, StepOutput, StepPlan
from ocrq.models.slots import FULL_PASS, KvPool, capacity_of

SCHEDULES = ("alternate", "chunked")
NEVER = -(10**9)


@dataclass(frozen=True)
class SchedulerConfig:
    """The loop's shape and rule: its slots, pool and cap (`RunningBudget`), its prefill
    schedule, and its lanes (the Hunyuan loop's `LoopConfig` says the same)."""

    slots: int
    pool_tokens: int
    max_new_tokens: int
    schedule: str = "chunked"
    pass_tokens: int = 4096  # prompt tokens of one prefill pass (padded unless `packed`)
    prefill_gap: int = 1
    packed: bool = False
    check_every: int = 8  # decode steps between plans while nothing waits
    lanes: LanePolicy = field(default_factory=LanePolicy)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, not {self.schedule!r}")
        if (self.slots < 1 or self.pool_tokens < 1 or self.max_new_tokens < 1
                or self.prefill_gap < 1 or self.check_every < 1 or self.pass_tokens < 1):
            raise ValueError(f"invalid scheduler config {self}")


@dataclass(frozen=True)
class _Queued:
    key: str
    prompt_tokens: int
    capacity: int
    row_cap: int
    interactive: bool
    queued_at: float  # monotonic seconds, the caller's


class LoopScheduler:
    """Plans one running loop: the only waiting queue, lane rule and KV book it has."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.pool = KvPool.empty(config.pool_tokens)
        self.step = 0  # full decode steps the runner reported
        self._waiting: deque[_Queued] = deque()
        self._waiting_set: set[str] = set()  # their keys (the batcher hands every row at once)
        self._waiting_interactive = 0
        self._running: dict[str, Admit] = {}
        self._slots: dict[int, str] = {}  # slot -> the key of the row holding it
        self._dropped: list[str] = []  # running rows dropped since the last plan
        self._last_prefill = NEVER
        self._last_bulk_pass = NEVER
        self._busy = self._held = False  # the lane's account of the pass being planned

    # -- the books ---------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> dict[str, Admit]:
        """Key -> the row's admission, for every row admitted and not yet finished."""
        return dict(self._running)

    def idle(self) -> bool:
        return not self._waiting and not self._running and not self._dropped

    def add(self, requests: Iterable[Request], now: float) -> None:
        """Queue rows at time `now` (monotonic seconds), oldest first; each must fit the pool
        alone (the batcher's check) and have a key no row waiting or running has. All or none:
        a ValueError queues none."""
        cfg = self.config
        queued: list[_Queued] = []
        keys: set[str] = set()
        for r in requests:
            if r.key in self._running or r.key in self._waiting_set or r.key in keys:
                raise ValueError(f"row {r.key} is in the loop already")
            cap = cfg.max_new_tokens if r.max_new_tokens is None else r.max_new_tokens
            if not 1 <= cap <= cfg.max_new_tokens:
                raise ValueError(f"row {r.key}: max_new_tokens {cap} outside "
                                 f"1..{cfg.max_new_tokens}")
            capacity = capacity_of(r.prompt_tokens, cap)  # asked once per row, here
            if capacity > cfg.pool_tokens:
                raise ValueError(f"row {r.key} needs {capacity} KV tokens, over the pool's "
                                 f"{cfg.pool_tokens}")
            queued.append(_Queued(r.key, r.prompt_tokens, capacity, cap, r.interactive, now))
            keys.add(r.key)
        self._waiting.extend(queued)
        self._waiting_set |= keys
        self._waiting_interactive += sum(q.interactive for q in queued)

    def drop(self, keys: Collection[str]) -> list[str]:
        """Forget these rows (their jobs were cancelled); the keys it held. A waiting row goes
        at once; a running one's slot and range are given back now and the next plan tells the
        runner to drop it (before that plan's prefill, which may reuse them)."""
        gone = [q for q in self._waiting if q.key in keys]
        if gone:
            self._waiting = deque(q for q in self._waiting if q.key not in keys)
            self._waiting_set.difference_update(q.key for q in gone)
            self._waiting_interactive -= sum(q.interactive for q in gone)
        live = [k for k in keys if k in self._running]
        for key in live:
            self._free(key)
        self._dropped += live
        return [q.key for q in gone] + live

    # -- a tick ------------------------------------------------------------------------------

    def waiting_keys(self) -> list[str]:
        """The waiting rows' keys, oldest first."""
        return [q.key for q in self._waiting]

    def clear(self) -> list[str]:
        """Forget every row (the runner lost its device state: an error); the keys running,
        then those waiting. The clocks go on."""
        keys = [*self._running, *(q.key for q in self._waiting)]
        self._waiting.clear()
        self._waiting_set.clear()
        self._waiting_interactive = 0
        self._running.clear()
        self._slots.clear()
        self._dropped.clear()
        self.pool = KvPool.empty(self.config.pool_tokens)
        return keys

    def schedule(self, now: float, prefill: bool = True) -> StepPlan:
        """This tick's plan at time `now` (monotonic seconds, as `add` was given: the rows'
        waits); a row it admits holds its slot and range in the book from now on. `prefill`
        False: the runner still has a pass in flight (one at a time), so this plan admits
        nothing."""
        drop, self._dropped = tuple(self._dropped), []
        self._busy = self._held = False
        admit, blocked = self._admit(now) if prefill else ((), None)
        steps = 1 if self._waiting else self.config.check_every
        return StepPlan(drop, admit, steps, blocked, self._busy, self._held)

    def update(self, output: StepOutput) -> tuple[str, ...]:
        """The runner's output taken: the step clock moves on, and the rows it saw finish give
        back their slots and ranges; those rows, each once."""
        self.step += output.steps
        finished = []
        for key in output.finished:
            if key in self._running:
                self._free(key)
                finished.append(key)
        return tuple(finished)

    # -- the rule ----------------------------------------------------------------------------

    def _free(self, key: str) -> None:
        seat = self._running.pop(key)
        del self._slots[seat.slot]
        self.pool = self.pool.give(seat.start, seat.capacity)

    def _admit(self, now: float) -> tuple[tuple[Admit, ...], str | None]:
        cfg = self.config
        if not self._waiting:
            return (), None
        free = [s for s in range(cfg.slots) if s not in self._slots]
        if not free:
            return (), "no free slot"
        urgent = self._waiting_interactive > 0  # an interactive row goes in the next pass
        running = len(self._running)
        if cfg.schedule == "alternate" and running and len(free) * 4 < cfg.slots and not urgent:
            return (), None  # let more slots free up first: one larger pass
        # With no interactive row waiting, admission never looks past the free slots (and one
        # to learn why it stopped); with one, the whole queue.
        queue = self._waiting if urgent else itertools.islice(self._waiting, len(free) + 1)
        waiters = [Waiter(q.key, q.prompt_tokens, q.capacity, q.interactive, q.queued_at)
                   for q in queue]
        live_interactive = sum(a.interactive for a in self._running.values())
        state = LoopState(cfg.slots, tuple(free), running - live_interactive, live_interactive,
                          self.step, self._last_bulk_pass, now)
        decided = lane_pass(waiters, self.pool, state, cfg.pass_tokens, cfg.lanes,
                            packed=cfg.packed)
        plan = decided.admission
        self._busy = decided.busy
        self._held = decided.held and bool(plan.placements)
        if not plan.placements:
            return (), plan.blocked
        soon = self.step - self._last_prefill < cfg.prefill_gap
        if cfg.schedule == "chunked" and running and soon and plan.blocked != FULL_PASS \
                and not urgent:
            return (), None  # not full yet, and the runner has rows to decode meanwhile
        queued = {q.key: q for q in itertools.islice(self._waiting, len(plan.placements))}
        if len(queued.keys() & {p.key for p in plan.placements}) < len(plan.placements):
            queued = {q.key: q for q in self._waiting}
        taken = {p.key for p in plan.placements}
        if all(q.key in taken for q in itertools.islice(self._waiting, len(taken))):
            for _ in taken:  # the oldest rows (no interactive row passed a bulk one): O(pass)
                self._waiting.popleft()
        else:
            self._waiting = deque(q for q in self._waiting if q.key not in taken)
        self._waiting_set -= taken
        admitted = []
        for p in plan.placements:
            q = queued[p.key]
            a = Admit(p.key, p.slot, p.start, p.capacity, q.row_cap, q.prompt_tokens,
                      q.interactive)
            self._running[a.key] = a
            self._slots[a.slot] = a.key
            admitted.append(a)
        self._waiting_interactive -= sum(a.interactive for a in admitted)
        self.pool = plan.pool
        self._last_prefill = self.step
        if any(not a.interactive for a in admitted):
            self._last_bulk_pass = self.step
        return tuple(admitted), plan.blocked
