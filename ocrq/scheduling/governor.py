"""The memory budget in force: lowered after an out-of-memory error, raised again slowly.

Why a value of its own and not batcher state: the backoff and the recovery are decisions, and
decisions are tested without threads, engines or clocks. A `BudgetGovernor` is frozen; every
event returns the next one, so a test (or a hypothesis property) can drive any sequence of OOMs
and clean batches and check the budget after each. The batcher only holds the latest value.

Rules:
* after an OOM the budget drops to `oom_backoff` x the failed batch's predicted bytes (never
  above where it was, never below the floor): the cost model under-predicted that batch, so its
  prediction is an upper bound on what fits now;
* an image that ran out of memory alone is retried only at a size predicted below
  `oom_backoff` x what failed (`retry_bytes`), whatever the floor;
* after `clean_batches_to_raise` batches without an OOM in a row, the budget climbs by
  `budget_step` of the configured budget, never above it;
* the floor is the configured budget / `floor_divisor`: a burst of OOMs caused by something
  else (another process on the device) must not shrink batches to nothing for good.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class BudgetGovernor:
    configured_bytes: int  # the budget the worker was configured with (above the fixed part)
    budget_bytes: int  # the budget batches are planned to now
    oom_backoff: float = 0.8
    clean_batches_to_raise: int = 20
    budget_step: float = 0.05
    floor_divisor: int = 16
    clean_batches: int = 0  # batches without an OOM since the last OOM or raise
    oom_events: int = 0  # OOMs recovered from, in all

    def __post_init__(self) -> None:
        if self.configured_bytes <= 0:
            raise ValueError(f"budget must be positive, not {self.configured_bytes}")
        if not 0 < self.oom_backoff < 1:
            raise ValueError(f"oom_backoff must be within (0, 1), not {self.oom_backoff}")
        if not 0 < self.budget_step <= 1:
            raise ValueError(f"budget_step must be within (0, 1], not {self.budget_step}")
        if self.clean_batches_to_raise < 1 or self.floor_divisor < 1:
            raise ValueError("clean_batches_to_raise and floor_divisor must be >= 1")

    @classmethod
    def start(
        cls,
        configured_bytes: int,
        *,
        oom_backoff: float = 0.8,
        clean_batches_to_raise: int = 20,
        budget_step: float = 0.05,
    ) -> BudgetGovernor:
        """The governor of a fresh worker: the configured budget in force."""
        return cls(
            configured_bytes,
            configured_bytes,
            oom_backoff=oom_backoff,
            clean_batches_to_raise=clean_batches_to_raise,
            budget_step=budget_step,
        )

    @property
    def floor_bytes(self) -> int:
        return max(1, self.configured_bytes // self.floor_divisor)

    def after_oom(self, predicted_bytes: int) -> BudgetGovernor:
        """A batch predicted at `predicted_bytes` ran out of memory."""
        lowered = min(self.budget_bytes, int(predicted_bytes * self.oom_backoff))
        return replace(
            self,
            budget_bytes=max(self.floor_bytes, lowered),
            clean_batches=0,
            oom_events=self.oom_events + 1,
        )

    def retry_bytes(self, predicted_bytes: int) -> int:
        """The most a single image that ran out of memory at `predicted_bytes` may be predicted
        to cost when it is retried (smaller): what failed, backed off."""
        return int(predicted_bytes * self.oom_backoff)

    def after_batch(self, ooms: int) -> BudgetGovernor:
        """A batch finished, after `ooms` OOMs on the way (its splits and retries)."""
        if ooms:
            return replace(self, clean_batches=0)
        clean = self.clean_batches + 1
        if self.budget_bytes >= self.configured_bytes or clean < self.clean_batches_to_raise:
            return replace(self, clean_batches=clean)
        raised = self.budget_bytes + max(1, int(self.configured_bytes * self.budget_step))
        return replace(self, budget_bytes=min(self.configured_bytes, raised), clean_batches=0)
