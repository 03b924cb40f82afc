"""The engine interface every OCR backend implements, and the values that cross it.

Small on purpose (an engine should take an afternoon): load, estimate an image's cost without
the device, say how memory grows with a batch (the cost model), run. Two kinds share that core:

* `Engine` runs a whole batch per call: the batcher plans it by memory, `run` returns when
  every row is done. HunyuanOCR through transformers and the CPU engine are of this kind.
* `StreamingEngine` owns a running decode loop and takes rows while others finish (continuous
  batching, vLLM): the batcher keeps planning what goes next, hands rows over and collects
  finished ones. HunyuanOCR's running loop (`HunyuanLoopEngine`) is of this kind.

Which kind drives a worker is asked one way, `streaming(engine)`.

A failure that concerns one image comes back as that image's exception, so one bad page never
fails the batch; an exception raised by `run` itself concerns the whole batch (a CUDA OOM, say)
and the batcher decides what to do with it. OOM recovery, recycling and `ocrq tune` need more of
an engine's memory than this: that is an optional protocol of its own (ocrq/models/memory.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from PIL import Image

from ocrq.core.lanes import DEFAULT_LANES, LaneRule
from ocrq.core.pixel_budget import PixelBudget
from ocrq.models.costs import CostModel, ItemCost
from ocrq.models.slots import RunningBudget


@dataclass(frozen=True)
class Line:
    """One recognised line or region; box is [x1, y1, x2, y2] in pixels of the ORIGINAL image.

    `label` names a region's kind where the model gives one (a layout's "table", a parsed
    page's "figure"); plain text lines have none, and their JSON has no "label" key.
    """

    text: str
    box: tuple[int, int, int, int]
    score: float
    label: str | None = None

    def as_json(self) -> dict:
        out = {"text": self.text, "box": list(self.box), "score": round(self.score, 4)}
        if self.label is not None:
            out["label"] = self.label
        return out


@dataclass(frozen=True)
class OcrResult:
    text: str
    lines: list[Line] = field(default_factory=list)
    # Why the text may be incomplete: None (the model finished), "max_tokens" (the generation
    # cap cut it) or "repetition" (the engine stopped a loop; the text keeps one copy of it).
    truncated: str | None = None


@dataclass
class PreparedImage:
    """A decoded RGB image ready for an engine.

    `image` may be smaller than the original (the stages of its pixel budget shrink it:
    ocrq/core/pixel_budget.py); `original_size` lets engines report boxes in the pixels the user
    knows.
    """

    key: str
    image: Image.Image
    original_size: tuple[int, int]
    task: str = "text"  # a task name of the contract (ocrq.core.contract.TASKS), or "custom"
    prompt: str = ""  # the job's free prompt, for "custom"; engines hold the named tasks' own
    # The job's own cap on the pixels the model sees (the producer's `max_pixels`; None: the
    # engine's preset for the task): the `job_cap` of its pixel budget.
    job_cap: int | None = None
    # The row's own cap on new tokens, at most the engine's (None: the engine's): a generating
    # engine ends the row there as at an end of sequence. Benches draw it per row.
    max_new_tokens: int | None = None
    # The job's lane ("interactive" or "bulk"): the planner admits interactive rows first.
    priority: str = "bulk"
    # Engine-private inputs made by `Engine.prepare` in a prefetch thread (a VLM's processor
    # output, say); cleared whenever the image changes, so `run` redoes what is missing.
    encoded: object | None = None

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size

    def scale_to_original(self) -> tuple[float, float]:
        """Factors that map coordinates in `image` back to the original image."""
        w, h = self.image.size
        ow, oh = self.original_size
        return ow / w, oh / h


class UnsupportedTask(ValueError):
    """The engine cannot do what the job asks (a free prompt on the CPU engine, say)."""


class EngineMisconfigured(ValueError):
    """The engine cannot start with these settings (a server URL missing, a model its server
    does not serve): the CLI prints it in one line and exits 78 (ocrq/core/problems.py reads
    it by name, as core imports no engine), since no retry or other job would fare better."""


class EngineFront(Protocol):
    """What the worker side (claiming, decoding, splitting documents, shutting down) asks of an
    engine, wherever the engine runs: in this process (every `EngineCore`) or in an engine
    process of its own (ocrq/engine_process/link.py `RemoteEngine`), whose estimates and
    preprocessing happen over there, beside its batcher."""

    name: str
    model_limit: int | None
    # Whether `prepare` does its work in this process (and is worth timing here).
    prepares_here: bool

    def prepare(self, item: PreparedImage) -> None: ...

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget: ...

    def close(self) -> None: ...


class EngineCore(ABC):
    """What every engine does, whichever way it runs rows."""

    name: str = "engine"
    prepares_here: bool = True
    # The most pixels the model ever sees (its processor's limit): the `model_limit` of every
    # pixel budget, which the intake shrinks a waiting image to. None: the engine has no view of
    # its own (it reads the image as handed in), and keeps full size.
    model_limit: int | None = None

    @abstractmethod
    def load(self) -> None:
        """Load weights; raise a clear error at start-up when they are missing."""

    @abstractmethod
    def estimate(self, item: PreparedImage) -> ItemCost:
        """What this image will cost in a batch, computed without touching the device."""

    @abstractmethod
    def cost_model(self) -> CostModel:
        """The memory model the planner uses (its default; `ocrq tune` may measure another)."""

    def preferred_max_batch(self) -> int:
        """Images per batch this engine wants at most when the user sets no cap (after `load`).

        Why the engine says it: a GPU engine needs batches of 64-256 rows to use the device
        (bench/results/decode_speed/decode_speed_h200.md), a CPU engine gains nothing past a few
        dozen and only holds more decoded images; the memory budget still decides each batch below
        it.
        """
        return 32

    def take_tuned_max_batch(self, max_batch: int) -> None:  # noqa: B027 - optional hook
        """The batch knee of the tuned profile the worker chose after `load`, when OCRQ_MAX_BATCH
        is unset. The batcher gets it in its `BatchConfig`; an engine that sizes something by the
        batch cap from its own settings group (HunyuanOCR's running-loop slots) takes it here,
        since its group is a copy the worker's Settings no longer reaches."""

    def prepare(self, item: PreparedImage) -> None:  # noqa: B027 - optional hook
        """CPU preprocessing worth doing in the prefetch threads, off the device's critical path.

        Runs in a task thread while the device works on another batch; stores its output in
        `item.encoded`. An exception here fails only this item.
        """

    def pixel_budget(self, task: str, job_cap: int | None) -> PixelBudget:
        """The caps on the pixels of a `task` image with the job's own `job_cap`: the one answer
        every stage asks (ocrq/core/pixel_budget.py). Engines with resolution presets add
        theirs and their model's floor; this default knows only the model's limit."""
        return PixelBudget(job_cap=job_cap, model_limit=self.model_limit)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory and sessions."""

    def describe(self) -> dict[str, str]:
        """Facts for logs; those named by `MemoryProbing.profile_fields` key a tuned profile."""
        return {"engine": self.name}


class Engine(EngineCore):
    """An engine that runs a whole batch per call."""

    @abstractmethod
    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch; one result (or the image's own exception) per input, in order."""


@dataclass(frozen=True)
class Finished:
    """A row a streaming engine has finished, named by its PreparedImage's key.

    `later`, when set, makes the result (detokenising and parsing the row's output): the
    batcher calls it off the thread that drives the device, which meanwhile queues the next
    steps."""

    key: str
    result: OcrResult | Exception | None
    later: Callable[[], OcrResult] | None = None
    started_at: float | None = None  # time.monotonic() when its row entered the loop, if known

    def resolve(self) -> OcrResult | Exception:
        if self.later is None:
            assert self.result is not None
            return self.result
        try:
            return self.later()
        except Exception as exc:  # its output fails to parse: this row alone
            return exc


class StreamingEngine(EngineCore):
    """An engine that owns a running decode loop and takes rows while others finish.

    Why a second kind: with continuous batching (vLLM, or a loop that refills the slots of
    finished rows) the engine decides step by step which rows run, and a synchronous
    `run(batch)` would make every batch wait for its longest row. The batcher drives it with the
    same planner and a different loop (ocrq/scheduling/streaming.py):

    * `open(budget_bytes, model, lanes)` sizes the loop once from the memory budget (above the
      cost model's fixed part) and says what it holds (`RunningBudget`: slots, KV pool tokens,
      the prefill pass); `lanes` is the batcher's lane rule (ocrq/core/lanes.py), which the
      loop's own order keeps to (one bound on a bulk row's wait, OCRQ_BULK_MAX_WAIT_S);
    * the batcher downscales or refuses a row too big for the loop alone;
    * `submit(rows)` hands rows over (every waiting one, in the lanes' order) and returns at
      once; the engine queues them and decides which run when as slots and KV room free up;
    * `poll(timeout_s)` runs the loop (in the batcher's thread: one thread owns the device) and
      returns the rows finished since the last call, each exactly once, waiting at most
      `timeout_s` for the first; the batcher resolves their futures at once.

    An out-of-memory error raised by `poll` concerns the loop: the batcher calls `reset`, which
    returns the rows in flight (their futures still waiting), and opens it again smaller.
    """

    @abstractmethod
    def open(
        self, budget_bytes: int, model: CostModel, lanes: LaneRule = DEFAULT_LANES
    ) -> RunningBudget:
        """Size and start the loop within `budget_bytes` above `model.fixed_bytes`; its rows
        ordered by `lanes` (the batcher's rule)."""

    @abstractmethod
    def submit(self, rows: Sequence[PreparedImage]) -> None:
        """Queue rows to the running loop; never blocks on the device."""

    @abstractmethod
    def poll(self, timeout_s: float) -> list[Finished]:
        """Rows finished since the last call (possibly none after `timeout_s`)."""

    def reset(self) -> list[str]:
        """Drop every row in flight (after an error) and free the loop; their keys."""
        return []

    def queued(self) -> int:
        """Rows handed over that wait in the engine's own queue, not yet running. The batcher's
        records say "left waiting" and "in flight" from it: bench/sustained.py finds the loop's
        saturated window by rows still waiting, and the batcher hands every row over at once.
        None by default: every row handed over runs."""
        return 0

    def drop(self, keys: Collection[str]) -> list[str]:
        """Drop these rows (their jobs were cancelled) from the loop, freeing their slots; the
        keys of those it held, which `poll` will never return. Called on the batcher's thread
        between polls. An engine that cannot drop a row returns none: the row runs to its end
        and its result is not stored (the row is final already)."""
        return []

    def streams(self) -> bool:
        """Whether this engine, as configured, runs its rows in the running loop; an engine
        that may also run static batches (openai's, OCRQ_SCHEDULER=static) says so here. Ask
        `streaming(engine)`, not this."""
        return True

    def warm_up(self) -> None:
        """After `open`, before any row: do now what the loop's first rows would otherwise wait
        for (compiling, capturing), within the engine's own time bound. None by default."""

    def loop_counts(self) -> dict[str, float]:
        """Running totals of the loop's work for the worker's metrics (names in
        ocrq/core/metrics.py `LOOP_COUNTS`); empty when the engine keeps none."""
        return {}


def streaming(engine: EngineCore) -> StreamingEngine | None:
    """The engine as a `StreamingEngine` where its rows run in its running loop, else None (a
    static `Engine`): the one question the worker's side, the tuner and the sweeps ask."""
    if isinstance(engine, StreamingEngine) and engine.streams():
        return engine
    return None
