"""The running loop's admission policy: when it prefills, and which waiting rows.

Why apart from the loop: as vLLM's scheduler returns a plan that its runner executes, the policy
reads the loop's books (`LoopBooks`: waiting rows, live rows, the pool, the step count) and the
pending prefill pass, and returns a plan
(ocrq/models/slots.py's `Admission`) or nothing; the loop (ocrq/models/hunyuan/running.py) keeps
the device state and its prefill passes (ocrq/models/hunyuan/passes.py) carry the plan out. A
change of policy then touches neither the device state nor the passes.

Prefill schedules (`LoopConfig.schedule`), the knob the GPU bench compares:

* "alternate": decode until a quarter of the slots are free (or nothing runs), then prefill every
  waiting row that fits in one pass of at most `prefill_tokens` prompt tokens; fewer,
  larger prefill passes, slots idle a little longer;
* "chunked": before every decode step, prefill the waiting rows that fit in a chunk of at most
  `chunk_tokens` prompt tokens (whole rows: the vision tower needs a whole image), so
  prefill work is spread between the steps and freed slots refill soon; with `prefill_gap`
  steps between passes unless a pass is full, so that passes are fewer and fuller.

A pass's tokens count padding (rows x the longest prompt) unless `packed`
(ocrq/models/hunyuan/packed.py, the worker's default): its rows end to end.

Which rows a pass takes is the lanes' rule (ocrq/models/lane_pass.py, `LoopConfig.lanes`):
interactive rows first and into slots bulk rows may not hold, bulk rows held to a budget and a
gap while the lane is busy, promoted after `promote_steps`. An interactive row waiting skips
either schedule's wait: it goes in the next pass.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ocrq.models.lane_pass import LoopState, Waiter, lane_pass
from ocrq.models.slots import FULL_PASS, Admission

if TYPE_CHECKING:
    from ocrq.models.hunyuan.loop_state import LoopParts
    from ocrq.models.hunyuan.passes import PrefillPasses


class AdmissionPolicy:
    """The prefill passes a running loop runs, one plan at a time, by the lanes' rule (oldest
    waiting row first when every row is bulk)."""

    def __init__(self, state: LoopParts, passes: PrefillPasses) -> None:
        self.state = state
        self.passes = passes
        self.last_prefill = -(10**9)  # the step of the last prefill pass
        self.last_bulk_pass = -(10**9)  # ... of the last one that admitted bulk rows

    def free_slots(self) -> list[int]:
        """Slots neither live nor held by a pending prefill pass."""
        rows, held = self.state.books.rows, self.passes.slots()
        return [s for s in range(self.state.config.slots) if s not in rows and s not in held]

    def plan(self) -> Admission | None:
        """The pass to run before this step, or None; the loop runs a plan it gets at once.
        None while a pass is pending (`LoopConfig.prefill_stream`): one at a time."""
        books = self.state.books
        if not books.waiting or self.passes.pending is not None:
            return None
        free = self.free_slots()
        if not free:
            return None
        cfg = self.state.config
        urgent = books.waiting_interactive > 0  # an interactive row goes in the next pass
        if cfg.schedule == "alternate" and books.rows and len(free) * 4 < cfg.slots and not urgent:
            return None  # let more slots free up first: one larger prefill pass
        plan, bulk = self._lanes(free)
        if not plan.placements:
            return None
        soon = books.step_no - self.last_prefill < cfg.prefill_gap
        if (cfg.schedule == "chunked" and books.rows and soon and plan.blocked != FULL_PASS
                and not urgent):
            return None  # not full yet, and the GPU has rows to decode meanwhile
        self.last_prefill = books.step_no
        if bulk:
            self.last_bulk_pass = books.step_no
        return plan

    def _lanes(self, free: list[int]) -> tuple[Admission, bool]:
        """The next pass by the lanes' rule (ocrq/models/lane_pass.py), and whether it admits a
        bulk row. With no interactive row waiting, no more than the free slots (and one to learn
        why it stopped) are looked at: admission never looks further, and a long queue would
        make this a loop over every waiting row each step; with one waiting, the whole queue
        (the batcher hands over at most the loop's slots)."""
        books, cfg = self.state.books, self.state.config
        queue = (books.waiting if books.waiting_interactive
                 else itertools.islice(books.waiting, len(free) + 1))
        waiting = [Waiter(r.key, r.prompt_tokens, r.capacity, r.interactive, r.queued_step)
                   for r in queue]
        live = len(books.rows)
        lanes = LoopState(cfg.slots, tuple(free), live - books.live_interactive,
                          books.live_interactive, books.step_no, self.last_bulk_pass)
        decided = lane_pass(waiting, books.pool, lanes, cfg.pass_tokens, cfg.lanes,
                            packed=cfg.packed)
        self.state.stats.bulk_held_passes += decided.held and bool(decided.placements)
        bulk_keys = {w.key for w in waiting if not w.interactive}
        return decided.admission, any(p.key in bulk_keys for p in decided.placements)
