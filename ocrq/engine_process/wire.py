"""The messages between a worker and its engine process (ocrq/engine_process/link.py), pickled
over one duplex pipe. Plain dataclasses, importable without torch: the worker side never loads
the engine's libraries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ocrq.core.startup import Phase
from ocrq.models.base import PreparedImage
from ocrq.models.costs import CostModel
from ocrq.scheduling.vocabulary import BatchConfig, BatchRecord, ItemOutcome

# -- worker -> engine process -------------------------------------------------------------------


@dataclass(frozen=True)
class Submit:
    """One decoded image; the engine process preprocesses it and hands it to its batcher."""

    seq: int
    item: PreparedImage


@dataclass(frozen=True)
class Call:
    """A question for the loaded engine (`pixel_budget`), answered by a `Reply` of the same seq."""

    seq: int
    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class Cancel:
    """Drop the images of these keys (their jobs were cancelled): `Batcher.cancel`."""

    keys: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    """Finish what is waiting and in flight, close the engine, exit."""


# -- engine process -> worker -------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The engine loaded: what the worker needs to know of it to claim, decode and plan."""

    name: str
    model_limit: int | None
    config: BatchConfig
    cost_model: CostModel
    pid: int
    # Its start's phases (ocrq/core/startup.py), which the worker logs with its own.
    phases: tuple[Phase, ...] = ()


@dataclass(frozen=True)
class Failed:
    """The engine could not be loaded (a missing model, bad settings)."""

    error: str


@dataclass(frozen=True)
class Done:
    """The outcome of `Submit` `seq`, and how long its preprocessing took there."""

    seq: int
    outcome: ItemOutcome
    prepare_s: float


@dataclass(frozen=True)
class Reply:
    seq: int
    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class Batch:
    """A batch (or a running loop's round) ended: its record, for the worker's logs, metrics and
    recycler, and what only the engine process can read (`Readings`)."""

    record: BatchRecord
    readings: Readings


@dataclass(frozen=True)
class Readings:
    """The engine process's own figures at a batch's end: its metrics would otherwise die in its
    registry, and the recycler watches its memory."""

    oom_events: int = 0
    loop: dict[str, float] = field(default_factory=dict)  # StreamingEngine.loop_counts()
    gpu: tuple[int, int] | None = None  # metrics.gpu_memory(): allocated, reserved bytes
    fragmentation: int | None = None  # MemoryProbing.fragmentation_bytes()
    rss: int = 0  # the engine process's resident bytes


@dataclass(frozen=True)
class Stopped:
    """The engine process stopped cleanly; nothing more follows."""
