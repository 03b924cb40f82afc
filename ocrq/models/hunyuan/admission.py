"""The running loop's admission policy: when it prefills, and which waiting rows.

Why apart from the loop: as vLLM's scheduler returns a plan that its runner executes, the policy
reads the loop's books (waiting rows, live rows, the pool, the step count) and returns a plan
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
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ocrq.models.slots import FULL_PASS, Admission, Candidate, admit

if TYPE_CHECKING:
    from ocrq.models.hunyuan.running import RunningLoop


class AdmissionPolicy:
    """The prefill passes a running loop runs, one plan at a time, oldest waiting row first."""

    def __init__(self, loop: RunningLoop) -> None:
        self.loop = loop
        self.last_prefill = -(10**9)  # the step of the last prefill pass

    def free_slots(self) -> list[int]:
        loop = self.loop
        return [s for s in range(loop.config.slots) if s not in loop.rows]

    def plan(self) -> Admission | None:
        """The pass to run before this step, or None; the loop runs a plan it gets at once."""
        loop = self.loop
        if not loop.waiting:
            return None
        free = self.free_slots()
        if not free:
            return None
        cfg = loop.config
        if cfg.schedule == "alternate" and loop.rows and len(free) * 4 < cfg.slots:
            return None  # let more slots free up first: one larger prefill pass
        # No more than the free slots (and one to learn why it stopped): admission never looks
        # further, and a long queue would make this a loop over every waiting row each step.
        candidates = [Candidate(r.key, r.prompt_tokens, r.capacity)
                      for r in itertools.islice(loop.waiting, len(free) + 1)]
        plan = admit(candidates, loop.pool, free, cfg.pass_tokens, packed=cfg.packed)
        if not plan.placements:
            return None
        soon = loop._step_no - self.last_prefill < cfg.prefill_gap
        if cfg.schedule == "chunked" and loop.rows and soon and plan.blocked != FULL_PASS:
            return None  # not full yet, and the GPU has rows to decode meanwhile
        self.last_prefill = loop._step_no
        return plan
