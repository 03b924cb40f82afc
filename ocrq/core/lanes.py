"""The lane rule: interactive rows first, and bulk never starves. One definition, in seconds.

Two levels order waiting rows by lane: the static batcher's planner (ocrq/scheduling/planner.py
`admission_order`, which also orders the streaming batcher's hand-over) and the running loop's
scheduler (ocrq/models/loop/lane_pass.py `pass_order`). Both ask this rule, with the one bound
OCRQ_BULK_MAX_WAIT_S (`Settings.bulk_max_wait_s`). Here, in core, because it is the lowest layer
both can import (the loop's scheduler sits under models, below the scheduling layer).

The order is (rank, arrival): rank 0 for an interactive row and for a bulk row that has waited
at least `bulk_max_wait_s`, rank 1 for every other bulk row. A bulk row once promoted stays
promoted (its wait only grows) and is ordered among rank 0 by arrival, so interactive rows that
arrive after it never pass it: its wait is at most `bulk_max_wait_s` plus the admission of the
rank-0 rows older than it, a set that only shrinks (tests/test_lanes.py for the planner,
tests/test_lane_pass.py and tests/test_loop_scheduler.py for the loop).

Why time and not a count (of interactive admissions, or of the loop's decode steps, as the loop
once had with OCRQ_LOOP_BULK_MAX_WAIT_STEPS): the rule stays a pure function of what waits and
since when, an operator reasons in seconds, and one bound holds at both levels. The caller
passes the time (`waited_s`): no clock here, so the rule's tests are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

BULK_MAX_WAIT_S = 30.0  # OCRQ_BULK_MAX_WAIT_S's default (ocrq/core/settings_service.py)


@dataclass(frozen=True)
class LaneRule:
    """Interactive first; a bulk row that has waited `bulk_max_wait_s` ranks as interactive."""

    bulk_max_wait_s: float = BULK_MAX_WAIT_S

    def __post_init__(self) -> None:
        if not self.bulk_max_wait_s >= 0:  # NaN too
            raise ValueError(f"bulk_max_wait_s must be >= 0, not {self.bulk_max_wait_s}")

    def promoted(self, interactive: bool, waited_s: float) -> bool:
        """A bulk row that has waited long enough to be ordered with the interactive ones."""
        return not interactive and waited_s >= self.bulk_max_wait_s

    def rank(self, interactive: bool, waited_s: float) -> int:
        """0: ordered with the interactive rows (by arrival); 1: after them."""
        return 0 if interactive or waited_s >= self.bulk_max_wait_s else 1


DEFAULT_LANES = LaneRule()  # OCRQ_BULK_MAX_WAIT_S at its default
