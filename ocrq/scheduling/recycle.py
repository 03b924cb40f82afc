"""When a worker process should end itself so that a fresh one replaces it.

Reasons: it has processed N images (the tuning guides' cure for slow leaks), host RSS stays
above a threshold, or the device allocator's fragmentation stays above one. The decision is
made after each batch, from numbers; acting on it (a warm shutdown) is the caller's business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ocrq.core.procfs import rss_bytes
from ocrq.models.costs import GiB
from ocrq.scheduling.vocabulary import BatchRecord

log = logging.getLogger(__name__)

RECYCLE_EXIT_CODE = 75  # EX_TEMPFAIL: "done for now, start me again"
# Memory is read after a batch at most this often. Why: the running loop ends a round every few
# decode steps, and reading HunyuanOCR's fragmentation empties the CUDA cache, a device sync
# (bench/results/service_gpu/service_gpu_reading.md, runs 8-9); patience then counts readings, not
# rounds.
MEMORY_CHECK_S = 5.0


@dataclass(frozen=True)
class RecyclePolicy:
    max_images: int | None = 10_000
    max_rss_bytes: int | None = None
    max_fragmentation_bytes: int | None = None
    patience: int = 3


class Recycler:
    """Counts images and watches memory after each batch; fires `trigger(reason)` once."""

    def __init__(
        self,
        policy: RecyclePolicy,
        trigger: Callable[[str], None],
        rss: Callable[[], int] = rss_bytes,
        fragmentation: Callable[[], int | None] = lambda: None,
        check_every_s: float = MEMORY_CHECK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.check_every_s = check_every_s
        self._clock = clock
        self._next_check = 0.0
        self._trigger = trigger
        self._rss = rss
        self._fragmentation = fragmentation
        self.images = 0
        self._over = {"rss": 0, "fragmentation": 0}
        self.reason: str | None = None

    def after_batch(self, record: BatchRecord) -> None:
        if self.reason is not None:
            return
        self.images += record.size
        reason = self._check()
        if reason is not None:
            self.reason = reason
            self._trigger(reason)  # the trigger logs it (a stop under way may overrule it)

    def _check(self) -> str | None:
        p = self.policy
        if p.max_images is not None and self.images >= p.max_images:
            return f"processed {self.images} images (max_images={p.max_images})"
        now = self._clock()
        if now < self._next_check:
            return None
        self._next_check = now + self.check_every_s
        for name, value, limit in (
            ("rss", self._rss() if p.max_rss_bytes else None, p.max_rss_bytes),
            (
                "fragmentation",
                self._fragmentation() if p.max_fragmentation_bytes else None,
                p.max_fragmentation_bytes,
            ),
        ):
            if value is None or limit is None:
                continue
            self._over[name] = self._over[name] + 1 if value > limit else 0
            if self._over[name] >= p.patience:
                return (
                    f"{name} {value / GiB:.2f} GiB above {limit / GiB:.2f} GiB for "
                    f"{self._over[name]} readings"
                )
        return None
