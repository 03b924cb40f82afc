"""Run one planned batch through the engine, recovering from out-of-memory errors.

Why apart from the batcher: the batcher owns a thread, a queue and futures; this owns what
happens to one batch once planned. On an out-of-memory error it asks the governor for the new
budget (ocrq/scheduling/governor.py) and the planner for the way on (ocrq/scheduling/planner.py
`after_oom`):
each half of the batch on its own, or a single image retried smaller, or failed. It decides
nothing itself, and it never changes an item: a smaller image is a new Row.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from ocrq.core import metrics
from ocrq.models.base import Engine, OcrResult, PreparedImage
from ocrq.models.costs import CostModel, GiB
from ocrq.models.memory import OutOfMemory, catch_oom, memory_of
from ocrq.scheduling.downscaling import Downscaler
from ocrq.scheduling.governor import BudgetGovernor
from ocrq.scheduling.planner import Downscale, Refusal, ShrinkRule, after_oom
from ocrq.scheduling.vocabulary import Row

log = logging.getLogger(__name__)

Result = OcrResult | BaseException


def log_downscale(before: PreparedImage, after: PreparedImage, why: str) -> None:
    log.info("downscaled %s from %dx%d to %dx%d %s", before.key, *before.size, *after.size, why)


class BatchExecutor:
    """Runs planned batches on the engine; holds the governor (the budget in force).

    The governor is replaced, never changed, and only by the batcher thread, so other threads
    may read `governor` at any time.
    """

    def __init__(
        self, engine: Engine, model: CostModel, governor: BudgetGovernor, rule: ShrinkRule
    ) -> None:
        self.engine = engine
        self.memory = memory_of(engine)  # OOM test and release (host defaults if none)
        self.model = model
        self.governor = governor
        self.rule = rule

    def run(self, batch: Mapping[str, Row]) -> list[Result]:
        """One result or exception per row, in order. Only an image that fits at no smaller
        size fails for want of memory, alone; other engine errors propagate."""
        rows = list(batch.values())
        results = catch_oom(self.memory, lambda: self.engine.run([r.item for r in rows]))
        if isinstance(results, OutOfMemory):
            return self._recover(batch, results)
        if len(results) != len(rows):
            raise RuntimeError(
                f"engine {self.engine.name} returned {len(results)} results for {len(rows)} images"
            )
        return list(results)

    def finished(self, ooms: int) -> None:
        """A batch ended after `ooms` OOMs: let the budget climb back after clean ones."""
        before = self.governor.budget_bytes
        self.governor = self.governor.after_batch(ooms)
        if self.governor.budget_bytes > before:
            log.info(
                "budget raised to %.2f GiB after clean batches", self.governor.budget_bytes / GiB
            )

    def _recover(self, batch: Mapping[str, Row], oom: OutOfMemory) -> list[Result]:
        predicted = self.model.batch_bytes([r.cost for r in batch.values()])
        self.governor = self.governor.after_oom(predicted)
        metrics.OOM_EVENTS.inc()
        log.warning(
            "out of memory on a batch of %d (predicted %.2f GiB); budget now %.2f GiB (%s)",
            len(batch),
            predicted / GiB,
            self.governor.budget_bytes / GiB,
            oom.message,
        )
        downscaler = Downscaler(self.engine, {k: r.item for k, r in batch.items()})
        decision = after_oom(
            [r.waiting(k) for k, r in batch.items()],
            self.governor.retry_bytes(predicted),
            self.model,
            downscaler.estimate_at,
            self.rule,
        )
        if decision.halves is not None:
            first, second = decision.halves
            return self.run({k: batch[k] for k in first}) + self.run({k: batch[k] for k in second})
        retry = decision.retry
        if not isinstance(retry, Downscale):
            reason = retry.reason if isinstance(retry, Refusal) else "no retry planned"
            return [MemoryError(f"out of memory ({oom.message}); {reason}")]
        row = batch[retry.key].shrunk(retry, downscaler)
        log_downscale(batch[retry.key].item, row.item, "after an out-of-memory error")
        return self.run({retry.key: row})
