"""The running loop's harvest: when a copy of the slots' state goes to the host, and when the
host reads it for the rows that ended.

Why apart from the runner: the runner (ocrq/models/hunyuan/runner.py) keeps the device state and
its books of live rows; when to look at that state is a policy of its own, the one that keeps
the host from ever waiting for the GPU in steady state (ocrq/models/hunyuan/readback.py). The
harvest decides when to queue and read copies; the loop releases the rows a copy shows ended
(`ended`, the loop's own: `LoopRunner._ended`, ocrq/models/hunyuan/runner.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ocrq.models.hunyuan.loop_state import LoopParts
    from ocrq.models.hunyuan.loop_types import Done, LoopRow
    from ocrq.models.hunyuan.readback import Snapshot


class Harvest:
    """One loop's harvest: its own books are the steps since the last copy and when each live
    row reaches its cap."""

    def __init__(self, state: LoopParts, ended: Callable[[Snapshot], list[Done]]) -> None:
        """`ended`: the loop's release of the rows a copy shows finished, those rows."""
        self.state = state
        self.ended = ended
        self.since_check = 0  # decode steps since the last copy was queued
        self.caps: list[tuple[int, int, int]] = []  # heap: (step its cap is reached, slot, entry)

    def track(self, row: LoopRow) -> None:
        """A row now in its slot: the step at which its cap is reached (sooner by the tokens it
        made in interactive-only steps; the loop tracks it again when those reach its cap)."""
        heapq.heappush(
            self.caps, (row.first_step + row.max_new_tokens - 1 - row.extra, row.slot, row.entry)
        )

    def _capped(self) -> bool:
        """Whether a live row reached its own cap since the last look (the host knows without a
        sync; each row counted once)."""
        hit = False
        while self.caps and self.caps[0][0] <= self.state.books.step_no:
            hit |= self._holder(heapq.heappop(self.caps)) is not None
        return hit

    def _holder(self, entry: tuple[int, int, int]) -> LoopRow | None:
        row = self.state.books.rows.get(entry[1])
        return row if row is not None and row.entry == entry[2] else None

    def __call__(self, force: bool) -> list[Done]:
        """Hand back the rows that ended, from a copy of the slots' state (`Readback`).

        A copy is queued every `check_every` steps, when a row reached its own cap, or when
        asked (`force`); on a GPU it is read once it has landed, and waited for only at the
        next due check, by when `check_every` more steps are queued behind it: the host stays
        at most two checks ahead of the GPU and the GPU's queue never runs dry. On a CPU (and
        in the tests that keep logits) the copy is read at once: a synchronous loop."""
        config, books, t = self.state.config, self.state.books, self.state.tensors
        readback = self.state.readback
        if config.keep_logits:
            self.keep_logits()
            force = True
        sync = config.keep_logits or not readback.asynchronous
        periodic = self.since_check >= config.check_every
        due = self._capped() or force or periodic
        done: list[Done] = []
        if readback.pending:
            snap = readback.take(wait=sync or periodic)
            if snap is not None:
                done = self.ended(snap)
        if due and not readback.pending and books.rows:
            self.since_check = 0
            readback.queue(books.rows, books.bucket(), t.finished, t.count, t.stopped, t.out)
            if sync:
                snap = readback.take(wait=True)
                assert snap is not None
                done += self.ended(snap)
        return done

    def keep_logits(self) -> None:
        """Tests: the logits of the step just run, per live row that made a token in it."""
        t = self.state.tensors
        kept = t.kept
        if kept is None:
            return
        counts = t.count.tolist()
        for slot, row in self.state.books.rows.items():
            if slot < kept.shape[0] and counts[slot] > len(row.logits):
                row.logits.append(kept[slot].cpu())
        t.kept = None
