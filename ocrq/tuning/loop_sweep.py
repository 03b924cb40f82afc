"""The sweep's settings run through an engine's running loop (continuous batching).

Why a second way to run a setting: with the loop, the knob is its slots (OCRQ_MAX_BATCH) and the
KV pool the budget leaves after them, and a static batch's rate says nothing about it (a static
batch waits for its longest row; the loop refills a finished row's slot at once). Each setting
opens the loop as a worker would (`StreamingEngine.open`, within the budget above the cost
model's fixed part), runs `slots` rows to warm it up (a new slot count captures new graphs),
then feeds it the timed rows, at least twice its slots so that it runs full and turns over.
The rate is the timed rows over the time from their submission to the last one finished:
filling and draining included, which at two turnovers or more puts it a little below the
saturated rate of bench/sustained.py (stated with the result). An out-of-memory error in the
loop ends the setting, the loop reset, as the streaming batcher recovers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ocrq.models.base import PreparedImage, StreamingEngine
from ocrq.models.costs import CostModel
from ocrq.models.memory import OutOfMemory, catch_oom, memory_of
from ocrq.tuning.sweep import SweepPoint, copies, past_deadline

POLL_S = 0.5
RATE = "whole run of the timed rows after a warm-up, filling and draining included"


def loop_rows(rows: int, slots: int) -> int:
    """Timed rows at `slots`: the sample, and at least two turnovers of the loop."""
    return max(rows, 2 * slots)


class LoopSetting:
    """Runs one setting (slots) through the engine's loop; see the module docstring."""

    def __init__(self, engine: StreamingEngine, model: CostModel, budget_bytes: int) -> None:
        self.engine, self.model = engine, model
        self.above_fixed = budget_bytes - model.fixed_bytes
        self.memory = memory_of(engine)

    def drain(self, batch: list[PreparedImage], on_batch: Callable[[int, int], None] | None,
              slots: int, deadline: float) -> float | OutOfMemory | int:
        """Submit `batch` and poll until every row finished: the seconds it took; or, cut at
        `deadline` (the loop reset, its rows dropped), how many rows had finished."""
        keys = {row.key for row in batch}
        t0 = time.perf_counter()
        self.engine.submit(batch)

        def run() -> None:
            while keys and time.monotonic() < deadline:
                done = self.engine.poll(POLL_S)
                for finished in done:
                    keys.discard(finished.key)
                if done and on_batch is not None:
                    on_batch(slots, len(done))

        outcome = catch_oom(self.memory, run)
        if isinstance(outcome, OutOfMemory):
            self.engine.reset()
            return outcome
        if keys:
            self.engine.reset()
            return len(batch) - len(keys)
        return time.perf_counter() - t0

    def timed(self, rows: int, slots: int) -> int:
        return loop_rows(rows, slots)

    def run(
        self, rows: Sequence[PreparedImage], slots: int, timed: int,
        on_batch: Callable[[int, int], None] | None, deadline: float = float("inf"),
    ) -> SweepPoint:
        settings = getattr(self.engine, "settings", None)
        before = getattr(settings, "max_batch", None)
        if settings is not None:
            settings.max_batch = slots  # the loop's slots (`open` reads them there)
        try:
            self.memory.release_memory()
            self.memory.reset_peak_memory()
            opened = catch_oom(self.memory, lambda: self.engine.open(self.above_fixed,
                                                                     self.model))
            if isinstance(opened, OutOfMemory):
                return SweepPoint(slots, "oom")
            if opened.slots < slots:  # the budget could not hold them: not this setting
                return SweepPoint(slots, f"skipped: the budget holds {opened.slots} slots")
            warm = self.drain(copies(rows, slots, f"lw{slots}"), on_batch, slots, deadline)
            if isinstance(warm, OutOfMemory):
                return SweepPoint(slots, "oom")
            if isinstance(warm, int):
                return SweepPoint(slots, past_deadline(0, timed))
            batch = copies(rows, timed, f"l{slots}")
            seconds = self.drain(batch, on_batch, slots, deadline)
            if isinstance(seconds, OutOfMemory):
                return SweepPoint(slots, "oom")
            if isinstance(seconds, int):
                return SweepPoint(slots, past_deadline(seconds, timed))
            # No samples for the cost-model fit: a loop's peak holds its pool, sized by the
            # budget, not by the rows.
            return SweepPoint(slots, "ok", timed, seconds, self.memory.peak_memory_bytes())
        finally:
            if settings is not None:
                settings.max_batch = before
