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

The sweep's peaks hold the loop's pool, so they say nothing of what a prefill pass spends; the
anatomy's per-batch workspace and activations come from `prefill_peaks` instead: passes of 1, 2
and 4 sample rows through the open loop, each in its own peak window above the open loop's
memory (pool and per-slot state included), for `batch_line`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ocrq.models.base import PreparedImage, StreamingEngine
from ocrq.models.costs import CostModel
from ocrq.models.memory import OutOfMemory, catch_oom, memory_of
from ocrq.tuning.anatomy import reading
from ocrq.tuning.calibration import Sample
from ocrq.tuning.sweep import SweepPoint, copies, past_deadline

POLL_S = 0.5
RATE = "whole run of the timed rows after a warm-up, filling and draining included"
PREFILL_ROWS = (1, 2, 4)
# `prefill_peaks` may run this long past --max-seconds: a pass of a few rows is milliseconds on
# a GPU and seconds on a CPU; the anatomy is worth a few seconds more than a cut sweep.
PREFILL_EXTRA_S = 10.0
PREFILL_HOW = (f"{', '.join(map(str, PREFILL_ROWS))} sample rows (one new token each) "
               "submitted at once to the open running loop, its prefill passes' peak above "
               "the open loop's memory (KV pool and slots held)")


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

    def prefill_peaks(
        self, rows: Sequence[PreparedImage], deadline: float
    ) -> tuple[int, list[Sample]]:
        """(the open loop's memory, a Sample per prefill pass measured), see the module
        docstring: the loop opened with PREFILL_ROWS' largest as its slots, one row through it
        first (what its first pass allocates and keeps is not a pass's), then each size's rows,
        capped at one new token so that a row ends at its prefill pass's commit. Bounded by
        max(`deadline`, now + PREFILL_EXTRA_S); an out-of-memory error or the deadline ends it
        with what it measured (nothing, as a budget that holds no pool at these slots: no
        samples, and the anatomy says n/a)."""
        deadline = max(deadline, time.monotonic() + PREFILL_EXTRA_S)
        settings = getattr(self.engine, "settings", None)
        before = getattr(settings, "max_batch", None)
        if settings is not None:
            settings.max_batch = max(PREFILL_ROWS)
        samples: list[Sample] = []
        try:
            self.memory.release_memory()
            try:
                opened = catch_oom(self.memory, lambda: self.engine.open(self.above_fixed,
                                                                         self.model))
            except ValueError:  # the budget leaves no pool at these slots
                return 0, samples
            if isinstance(opened, OutOfMemory):
                return 0, samples

            def one_token(n: int, tag: str) -> list[PreparedImage]:
                batch = copies(rows, n, tag)
                for row in batch:
                    row.max_new_tokens = 1
                return batch

            warm = self.drain(one_token(1, "pw"), None, 1, deadline)
            if not isinstance(warm, float):
                return 0, samples
            self.memory.release_memory()
            base = reading(self.memory)
            for n in PREFILL_ROWS:
                if n > opened.slots - opened.reserved_slots or time.monotonic() >= deadline:
                    break
                batch = one_token(n, f"p{n}")
                self.memory.release_memory()
                self.memory.reset_peak_memory()
                if not isinstance(self.drain(batch, None, n, deadline), float):
                    break
                peak = self.memory.peak_memory_bytes()
                samples.append(Sample(tuple(self.engine.estimate(r) for r in batch), peak))
            return base, samples
        finally:
            if settings is not None:
                settings.max_batch = before
