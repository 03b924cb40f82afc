"""The runner's state as its collaborators take it: the books of the rows on the device, and the
bundle of books, device tensors, stats and clocks that the runner hands its prefill passes and
harvest.

Why: those collaborators (ocrq/models/hunyuan/passes.py, harvest.py) once took the loop itself
and reached into its private members, and the loop imported them back: a circle. Here is what
they share, typed and public; the runner (ocrq/models/hunyuan/runner.py) builds it and drives
them, and none of them imports the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ocrq.models.hunyuan.loop_types import LoopConfig, LoopRow, LoopStats, bucket_of

if TYPE_CHECKING:
    from ocrq.models.hunyuan.decode import HunyuanDecoder
    from ocrq.models.hunyuan.readback import GpuClock, Readback
    from ocrq.models.hunyuan.slot_tensors import SlotTensors
    from ocrq.models.hunyuan.tokens import SpecialTokens


@dataclass
class LoopBooks:
    """The runner's books of the rows on the device, kept without a host sync: which row holds
    which slot, the decode steps so far, and the sums the lanes' steps and the stats read each
    step in O(1). No torch. The waiting rows and the pool's free ranges are the scheduler's
    (ocrq/models/loop/scheduler.py), not these."""

    config: LoopConfig
    # The repetition guard's period in steps (`RepetitionGuard.every`); None: no guard.
    guard_every: int | None = None
    rows: dict[int, LoopRow] = field(default_factory=dict)  # slot -> live row
    step_no: int = 0  # full decode steps run so far
    entries: int = 0  # rows that entered a slot so far (LoopRow.entry)
    # The lanes' books (ocrq/models/loop/lane_pass.py).
    live_interactive: int = 0
    kv_base: int = 0  # sum over live rows of prompt - first_step (live KV, O(1) a step)
    kv_extra: int = 0  # sum over live rows of `extra`
    interactive_slots: set[int] = field(default_factory=set)  # slots of live interactive rows
    # Rows due a repetition check, by phase: rows admitted at steps congruent mod `every`
    # are due at the same steps, so a step looks at its own phase only.
    phases: dict[int, set[int]] = field(default_factory=dict)

    @classmethod
    def empty(cls, config: LoopConfig) -> LoopBooks:
        every = config.guard.every if config.guard is not None else None
        return cls(config, every)

    # -- live rows -------------------------------------------------------------------------------

    def enter(self, row: LoopRow) -> None:
        """A row now in its slot: its entry, the lanes' sums, its guard phase."""
        self.rows[row.slot] = row
        row.entry, self.entries = self.entries, self.entries + 1
        self.live_interactive += row.interactive
        if row.interactive:
            self.interactive_slots.add(row.slot)
        self.kv_base += row.prompt_tokens - row.first_step
        self.kv_extra += row.extra
        phase = self.phase(row)
        if phase is not None:
            self.phases.setdefault(phase, set()).add(row.slot)

    def leave(self, slot: int) -> LoopRow:
        """The row of `slot` out of the books (its KV range is the scheduler's to give back)."""
        row = self.rows.pop(slot)
        self.live_interactive -= row.interactive
        self.interactive_slots.discard(slot)
        self.kv_base -= row.prompt_tokens - row.first_step
        self.kv_extra -= row.extra
        phase = self.phase(row)
        if phase is not None:
            self.phases.get(phase, set()).discard(slot)
        return row

    def add_extra(self, row: LoopRow) -> bool:
        """A token more for a live row, made in an interactive-only step: its guard phase
        moves. Whether that token reached its cap (the harvest then looks at once)."""
        phase = self.phase(row)
        if phase is not None:
            self.phases[phase].discard(row.slot)
        row.extra += 1
        self.kv_extra += 1
        phase = self.phase(row)
        if phase is not None:
            self.phases.setdefault(phase, set()).add(row.slot)
        return self.made(row) == row.max_new_tokens

    def made(self, row: LoopRow) -> int:
        """The tokens a live row has made so far, as the host knows without a sync (an upper
        bound once it ended: a finished row makes no more)."""
        return self.step_no - row.first_step + 1 + row.extra

    def phase(self, row: LoopRow) -> int | None:
        """The full steps (mod the guard's `every`) before which the row's count is a multiple
        of `every`; None: the guard never checks it (no guard, or the hooks force its eos)."""
        if self.guard_every is None or row.eos_at is not None:
            return None
        return (row.first_step - 1 - row.extra) % self.guard_every

    def bucket(self, top: int | None = None) -> int:
        """Slots a step runs over: the smallest bucket covering the highest live slot (or the
        first `top` slots)."""
        return bucket_of(max(self.rows) + 1 if top is None else top, self.config.slots,
                         self.config.min_bucket)


@dataclass
class LoopParts:
    """What the runner hands its collaborators: the model it runs, its books, its device
    tensors, its account and its clocks. Swapping `stats` or `clock` (the warm-up starts the
    account again) reaches every collaborator at once."""

    decoder: HunyuanDecoder
    tokens: SpecialTokens
    config: LoopConfig
    books: LoopBooks
    tensors: SlotTensors
    stats: LoopStats
    clock: GpuClock
    readback: Readback

    @property
    def device(self) -> Any:
        return self.decoder.device
