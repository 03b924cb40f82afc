"""The optional memory side of an engine: OOM recovery, recycling, and `ocrq tune`'s probes.

Why apart from the Engine interface (ocrq/models/base.py): an engine runs, and is planned for, with
its core alone; these hooks only make it recover from an out-of-memory error on its device,
report fragmentation to the recycler and be probed by `ocrq tune`. An engine whose memory is the
host's (the CPU engine) needs none of them: `memory_of` gives it `HostMemory`, which reads this
process's RSS (ocrq/core/procfs.py). An engine with a device of its own implements `MemoryProbing`
whole
(see ocrq/models/hunyuan/memory.py) and `memory_of` returns the engine itself.

Callers (the batcher, the runtime, `ocrq tune`) always go through `memory_of(engine)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from ocrq.core import procfs
from ocrq.models.costs import GiB, ItemCost

if TYPE_CHECKING:
    from ocrq.models.base import Engine, PreparedImage

INVOICE = ("INVOICE 2026-0142", "TOTAL 134.90", "THANK YOU")


@dataclass(frozen=True)
class ProbePage:
    """A page `ocrq tune` draws (a few lines of black text on white) and probes the engine with.

    Few lines on purpose: the memory follows the page's pixels, while the CPU engine's time
    follows the number of lines it reads.
    """

    label: str
    width: int
    height: int
    lines: tuple[str, ...] = INVOICE
    font_size: int = 40


@runtime_checkable
class MemoryProbing(Protocol):
    """How the batcher, the recycler and `ocrq tune` see an engine's memory."""

    # Settings, among the keys of `describe()`, that change the bytes per image: with the device
    # and the engine's name they key a tuned profile (ocrq/tuning/profiles.py).
    profile_fields: tuple[str, ...]

    def is_oom(self, exc: BaseException) -> bool:
        """Whether a batch failed for want of memory (then the batcher splits and retries)."""
        ...

    def release_memory(self) -> None:
        """Return cached memory after an OOM, before the retry."""
        ...

    def default_budget_bytes(self) -> int:
        """Bytes a batch may use above the fixed part when the user sets no budget."""
        ...

    def fragmentation_bytes(self) -> int | None:
        """Device memory reserved but not allocated after freeing caches; None if no device.

        The worker recycles itself when this stays high: a fresh process is the only cure for
        an allocator's fragmentation that emptying its cache cannot return.
        """
        ...

    def probe_pages(self) -> Sequence[ProbePage]:
        """Representative pages, smallest first (the first also warms the engine up)."""
        ...

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""
        ...

    def peak_memory_bytes(self) -> int:
        """Peak memory since `reset_peak_memory`, in the unit the cost model predicts."""
        ...

    def memory_capacity_bytes(self) -> int:
        """What `ocrq tune --budget-fraction` is a fraction of."""
        ...

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        """Run a batch the way that costs the most memory; each item's cost as run.

        `ocrq tune` fits the cost model on these costs and the measured peak. An engine whose
        cost depends on how long it generates forces that length (and may cap it to keep
        probing bounded in time, returning the costs it actually ran).
        """
        ...


def memory_of(engine: Engine) -> MemoryProbing:
    """The engine itself when it implements MemoryProbing, else host-memory defaults."""
    return engine if isinstance(engine, MemoryProbing) else HostMemory(engine)


def is_oom_error(exc: BaseException) -> bool:
    """MemoryError, or torch's OutOfMemoryError matched by name so that nothing here imports
    torch (torch.OutOfMemoryError and torch.cuda.OutOfMemoryError both carry it)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


T = TypeVar("T")


@dataclass(frozen=True)
class OutOfMemory:
    """An out-of-memory error that was caught and dropped: only its message is kept."""

    message: str


def catch_oom(memory: MemoryProbing, call: Callable[[], T]) -> T | OutOfMemory:
    """`call()`, or OutOfMemory when it ran out of memory; any other error propagates.

    Why every OOM goes through here (the batcher, `ocrq tune`, the planner benchmark): recovery
    must run outside the except clause. Until that clause ends, the exception's traceback keeps
    the failed call's frames alive, and with them their device tensors (the activations of a
    batch that did not fit), so a retry inside it would run out of memory again. When this
    returns, the exception is gone and the engine's cached memory has been released.
    """
    try:
        return call()
    except BaseException as exc:
        if not memory.is_oom(exc):
            raise
        message = str(exc)
    memory.release_memory()
    return OutOfMemory(message)


class HostMemory:
    """MemoryProbing for an engine that runs in this process's host memory.

    Peaks are the process's VmHWM (reset through /proc/self/clear_refs); the default budget is
    40% of the memory available now (at most 16 GiB): room for the decoded images waiting in
    prefetch and for other processes. Device engines use it for their CPU fallback.
    """

    profile_fields: tuple[str, ...] = ()

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def is_oom(self, exc: BaseException) -> bool:
        return is_oom_error(exc)

    def release_memory(self) -> None:
        pass

    def default_budget_bytes(self) -> int:
        return min(16 * GiB, int(0.4 * procfs.available_bytes()))

    def fragmentation_bytes(self) -> int | None:
        return None

    def probe_pages(self) -> Sequence[ProbePage]:
        """A receipt-like strip and an A4 page, whose sizes span a detector's inputs."""
        return (
            ProbePage("receipt-576x1600", 576, 1600, ("ACME STORE", "MILK 1.20", "TOTAL 3.40"), 28),
            ProbePage("a4-1240x1754", 1240, 1754),
        )

    def reset_peak_memory(self) -> None:
        procfs.reset_peak_rss()

    def peak_memory_bytes(self) -> int:
        return procfs.peak_rss_bytes()

    def memory_capacity_bytes(self) -> int:
        """Host memory available now plus what this process already holds."""
        return procfs.available_bytes() + procfs.rss_bytes()

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        """A plain `run`: the engine's cost does not depend on how long it runs."""
        self.engine.run(batch)
        return [self.engine.estimate(item) for item in batch]
