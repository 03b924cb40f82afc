"""Which waiting rows the running loop prefills in its next pass, when jobs come in two lanes.

Pure (no torch): the loop's scheduler (ocrq/models/loop/scheduler.py) asks it, the property
tests (tests/test_lane_pass.py) drive it alone.

The order is the batcher's (`LaneRule`, ocrq/core/lanes.py: interactive first, a bulk row
promoted after OCRQ_BULK_MAX_WAIT_S). Why the loop needs limits of its own beside it: the
batcher hands every row to the loop at once, where an interactive row is one of hundreds, and
on an H200 with a bulk backlog its p95 was 7.4x its latency alone
(bench/results/lanes/lanes_h200.md). Two things inside the loop set that: how soon it is
prefilled (a full loop has no slot for it; bulk rows handed over before it fill the pass), and
how long each of its tokens takes (a decode step over every live row, plus the bulk prefill
passes run between steps while it decodes). The levers, all in `LanePolicy`:

* reserved slots: bulk rows hold at most `slots - reserved_slots` slots, so an interactive row
  finds a slot in the very next pass however full of bulk the loop is. With `extra_steps` the
  reserve is also the slot indices [0, reserved_slots): interactive rows take the lowest free
  slot, bulk rows the lowest free one at or above the reserve, so interactive rows sit in the
  loop's lowest slots, where a decode step over only the first few slots covers them all.
  Without, every row takes the lowest free slot, as before (a bulk-only loop's rows then fill
  the lowest `slots - reserved_slots` slots, and its step covers no empty reserve);
* interactive-only decode steps (`extra_steps`, ocrq/models/hunyuan/runner.py): after each full
  decode step, while an interactive row is live, that many more steps over only the smallest
  graphed bucket of slots holding every live interactive row, so its tokens no longer wait one
  full step (plus the bulk passes between steps) each;
* interactive rows first: they lead every pass, first in first out among themselves, and a pass
  is run for them at once (no prefill gap);
* while the lane is busy (an interactive row waiting or live) bulk rows are held to a prompt
  budget per pass (`bulk_prefill_tokens`, as vLLM's max_num_batched_tokens bounds a step), to a
  pass every `bulk_gap` decode steps at most, and optionally to `bulk_rows` live bulk rows, so
  what runs between an interactive row's steps is bounded.

The no-starvation rule (`LaneRule`, the planner's too; one bound, OCRQ_BULK_MAX_WAIT_S): a bulk
row that has waited in the loop `bulk_max_wait_s` seconds is promoted: ordered with the
interactive rows by arrival (rank 0), exempt from the lane's budget, gap and bulk-row cap, held
only by the reserve. The time is the caller's (`LoopState.now` and `Waiter.queued_at`, monotonic
seconds the scheduler is handed), so the rule's tests need no clock. From then on no row that
arrived after it passes it for a pool range or a pass's tokens (a misfit
stops the pass, as `admit` stops at the first row that does not fit), so it is admitted once the
rows ahead of it (a set that only shrinks) are admitted and a bulk slot and a range are free:
live rows end within their caps. Before promotion a bulk row waits at most `bulk_gap` steps per
bulk pass, and each bulk pass admits the oldest bulk row that has a bulk slot and a range
(the budget lets one row alone pass). tests/test_lane_pass.py simulates a loop under a
never-ending interactive stream and checks that bound.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ocrq.core.lanes import BULK_MAX_WAIT_S, LaneRule
from ocrq.models.slots import FULL_PASS, Admission, KvPool, Placement

if TYPE_CHECKING:
    from ocrq.core.settings import Settings

BULK_HELD = "bulk held by the interactive lane"  # `LanePass.admission.blocked`, bulk only
NO_BULK_SLOT = "no bulk slot"  # bulk rows already hold every slot but the reserved ones


@dataclass(frozen=True)
class LanePolicy:
    """The running loop's lane settings (docs/settings.md, OCRQ_INTERACTIVE_*)."""

    reserved_slots: int = 0  # of the loop's slots, only interactive rows take these
    bulk_prefill_tokens: int = 0  # bulk prompt tokens per pass while busy; 0: no such budget
    bulk_gap: int = 1  # decode steps between passes that admit bulk rows while busy
    bulk_rows: int = 0  # live bulk rows at most while busy; 0: no cap
    # Seconds a bulk row waits in the loop before promotion (`LaneRule`; OCRQ_BULK_MAX_WAIT_S).
    bulk_max_wait_s: float = BULK_MAX_WAIT_S
    # Decode steps over only the interactive rows' slots after each full step while one is
    # live (the running loop's); above 0 the reserve is also the lowest slots. 0: none.
    extra_steps: int = 0
    # While a prefill pass runs on the side stream (`LoopConfig.prefill_stream`) and an
    # interactive row of the reserve is live: interactive-only steps in the pass's shadow, and
    # the full step only once it lands (each pass still gets one full step beside it).
    pass_steps: bool = False

    def __post_init__(self) -> None:
        if (self.reserved_slots < 0 or self.bulk_prefill_tokens < 0 or self.bulk_gap < 1
                or self.bulk_rows < 0 or not self.bulk_max_wait_s >= 0 or self.extra_steps < 0):
            raise ValueError(f"invalid lane policy {self}")

    @classmethod
    def of(cls, settings: Settings, reserved_slots: int | None = None,
           bulk_max_wait_s: float | None = None) -> LanePolicy:
        """The policy the settings give. One mapping, so the worker's loop
        (`HunyuanLoopEngine.loop_config`, which passes its budget's reserve and the batcher's
        rule) and the lanes model (bench/lanes_sim.py) cannot drift apart."""
        return cls(
            reserved_slots=settings.interactive_slots if reserved_slots is None
            else reserved_slots,
            bulk_prefill_tokens=settings.interactive_prefill_tokens,
            bulk_gap=settings.interactive_prefill_gap_steps,
            bulk_rows=settings.interactive_bulk_rows,
            bulk_max_wait_s=settings.bulk_max_wait_s if bulk_max_wait_s is None
            else bulk_max_wait_s,
            extra_steps=settings.interactive_extra_steps,
            pass_steps=settings.interactive_pass_steps,
        )

    @property
    def rule(self) -> LaneRule:
        """The lane order, as the batcher's planner has it."""
        return LaneRule(self.bulk_max_wait_s)


@dataclass(frozen=True)
class Waiter:
    """A row waiting in the loop: its prompt, the pool tokens it will hold, its lane, and when
    it joined the loop's queue (monotonic seconds, the caller's clock)."""

    key: str
    prompt_tokens: int
    capacity: int
    interactive: bool = False
    queued_at: float = 0.0


@dataclass(frozen=True)
class LoopState:
    """What the pass is decided against: the loop's slots (reserved ones included), the free
    ones, the live rows per lane, the decode step now and that of the last pass that admitted
    bulk rows (the gap's clock), and the time now (promotion's: monotonic seconds)."""

    slots: int
    free_slots: tuple[int, ...]
    live_bulk: int = 0
    live_interactive: int = 0
    step: int = 0
    last_bulk_pass: int = -(10**9)
    now: float = 0.0


@dataclass(frozen=True)
class LanePass:
    """The pass: `admission` as `admit` returns it (placements in pass order); `busy`: the
    lane's limits applied; `held`: a bulk row that had a slot was held back by them."""

    admission: Admission
    busy: bool
    held: bool = False

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.admission.placements


def promoted(w: Waiter, now: float, policy: LanePolicy) -> bool:
    """A bulk row that has waited `bulk_max_wait_s` by `now` (`LaneRule.promoted`)."""
    return policy.rule.promoted(w.interactive, now - w.queued_at)


def pass_order(waiting: Sequence[Waiter], now: float, policy: LanePolicy) -> list[Waiter]:
    """Interactive and promoted bulk rows by arrival, then the other bulk rows by arrival
    (`LaneRule.rank`); `waiting` is in arrival order."""
    rule = policy.rule
    ranked = sorted(
        enumerate(waiting),
        key=lambda iw: (rule.rank(iw[1].interactive, now - iw[1].queued_at), iw[0]),
    )
    return [w for _, w in ranked]


def lane_pass(
    waiting: Sequence[Waiter],
    pool: KvPool,
    state: LoopState,
    pass_tokens: int,
    policy: LanePolicy,
    *,
    packed: bool = False,
) -> LanePass:
    """The rows to prefill now (see the module's docstring for the rule).

    A pass's tokens count as `admit` counts them (padded: rows x the longest prompt; `packed`:
    the sum), within `pass_tokens` whatever the lane; the first row always passes that test.
    A row that misses a pool range or the pass's tokens stops the pass; a bulk row with no bulk
    slot, or held by the lane's limits, stops only the bulk rows after it (interactive rows
    behind it take slots it could not). A row takes the lowest free slot; with `extra_steps`
    a bulk row the lowest free one not reserved (so an interactive row takes a reserved one
    while any is free)."""
    busy = state.live_interactive > 0 or any(w.interactive for w in waiting)
    step, now = state.step, state.now
    bulk_seats = state.slots - policy.reserved_slots - state.live_bulk
    gap_open = step - state.last_bulk_pass >= policy.bulk_gap
    row_room = policy.bulk_rows - state.live_bulk if policy.bulk_rows else state.slots
    token_room = policy.bulk_prefill_tokens or None
    reserve = policy.reserved_slots if policy.extra_steps else 0
    low = [s for s in sorted(state.free_slots) if s < reserve]  # interactive rows only
    high = [s for s in sorted(state.free_slots) if s >= reserve]
    placed: list[Placement] = []
    longest = total = bulk_placed = bulk_tokens = 0
    bulk_closed = held = False
    blocked: str | None = None
    for w in pass_order(waiting, now, policy):
        if not low and not high:
            blocked = "no free slot"
            break
        if not w.interactive:
            if bulk_closed:
                continue
            if bulk_placed >= bulk_seats or not high:
                bulk_closed, blocked = True, NO_BULK_SLOT
                continue
            if busy and not promoted(w, now, policy) and (
                not gap_open
                or bulk_placed >= row_room
                or (token_room is not None and bulk_placed
                    and bulk_tokens + w.prompt_tokens > token_room)
            ):
                bulk_closed, held, blocked = True, True, BULK_HELD
                continue
        longest_then = max(longest, w.prompt_tokens)
        cost = total + w.prompt_tokens if packed else (len(placed) + 1) * longest_then
        if placed and cost > pass_tokens:
            blocked = FULL_PASS
            break
        taken = pool.take(w.capacity)
        if taken is None:
            blocked = "no pool range"
            break
        start, pool = taken
        slot = high.pop(0) if not w.interactive or not low else low.pop(0)
        placed.append(Placement(w.key, slot, start, w.capacity))
        longest, total = longest_then, total + w.prompt_tokens
        if not w.interactive:
            bulk_placed += 1
            bulk_tokens += w.prompt_tokens
    return LanePass(Admission(tuple(placed), pool, blocked), busy, held)
