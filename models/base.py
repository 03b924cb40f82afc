"""The engine interface every OCR backend implements, and the values that cross it.

The batcher hands an engine a list of prepared images and gets back one result per image, in
order. A failure that concerns one image comes back as that image's exception, so one bad page
never fails the batch; an exception raised by `run` itself concerns the whole batch (a CUDA OOM,
say) and the batcher decides what to do with it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from PIL import Image

from models.costs import CostModel, GiB, ItemCost


@dataclass(frozen=True)
class Line:
    """One recognised line; box is [x1, y1, x2, y2] in pixels of the ORIGINAL image."""

    text: str
    box: tuple[int, int, int, int]
    score: float

    def as_json(self) -> dict:
        return {"text": self.text, "box": list(self.box), "score": round(self.score, 4)}


@dataclass(frozen=True)
class OcrResult:
    text: str
    lines: list[Line] = field(default_factory=list)


@dataclass
class PreparedImage:
    """A decoded RGB image ready for an engine.

    `image` may be smaller than the original (prefetch caps pixels, the planner may downscale an
    image too big for the budget); `original_size` lets engines report boxes in the pixels the
    user knows.
    """

    key: str
    image: Image.Image
    original_size: tuple[int, int]
    task: str = "text"
    prompt: str = ""
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


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo; 4 GiB where it cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * GiB


def _proc_status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes (VmRSS, VmHWM), None where unreadable."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _trim_malloc() -> None:
    """Hand freed heap back to the OS (glibc), so a peak measured next is this window's own and
    not memory a previous, larger batch left in malloc's arenas."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class UnsupportedTask(ValueError):
    """The engine cannot do what the job asks (a free prompt on the CPU engine, say)."""


class Engine(ABC):
    """An OCR backend: load once, estimate each image's cost, run batches."""

    name: str = "engine"
    # Pixels above which prefetch threads downscale an image before it waits for the engine;
    # engines that resize internally anyway set their own ceiling here. None: keep full size.
    max_pixels: int | None = None

    @abstractmethod
    def load(self) -> None:
        """Load weights; raise a clear error at start-up when they are missing."""

    @abstractmethod
    def estimate(self, item: PreparedImage) -> ItemCost:
        """What this image will cost in a batch, computed without touching the device."""

    @abstractmethod
    def cost_model(self) -> CostModel:
        """The memory model the planner uses; its coefficients may come from `ocrq tune`."""

    def cache_token_bytes(self) -> float:
        """Bytes each token of a generated sequence holds while decoding (its KV cache): the
        decode coefficient of the cost model, from the model's shape rather than a fit.
        0 for engines that generate nothing."""
        return 0.0

    def decode_fixed_bytes(self) -> float:
        """What the decode phase holds whatever the batch size (the cost model's decode_fixed)."""
        return 0.0

    def prepare(self, item: PreparedImage) -> None:  # noqa: B027 - optional hook
        """CPU preprocessing worth doing in the prefetch threads, off the device's critical path.

        Runs in a task thread while the device works on another batch; stores its output in
        `item.encoded`. An exception here fails only this item.
        """

    @abstractmethod
    def run(self, batch: Sequence[PreparedImage]) -> list[OcrResult | Exception]:
        """OCR a batch; one result (or the image's own exception) per input, in order."""

    def default_budget_bytes(self) -> int:
        """Bytes a batch may use above the fixed part when the user sets no budget.

        Host engines take 40% of the memory available now (at most 16 GiB): room for the
        decoded images waiting in prefetch and for other processes. Device engines override.
        """
        return min(16 * GiB, int(0.4 * available_host_bytes()))

    def fragmentation_bytes(self) -> int | None:
        """Device memory reserved but not allocated after freeing caches; None if not a device.

        The worker recycles itself when this stays high: a fresh process is the only cure for
        an allocator's fragmentation that empty_cache cannot return.
        """
        return None

    def is_oom(self, exc: BaseException) -> bool:
        """Whether a batch failed for want of memory (then the batcher splits and retries).

        Matched by name so that this module never imports torch: torch.OutOfMemoryError and
        torch.cuda.OutOfMemoryError both carry it.
        """
        return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"

    def release_memory(self) -> None:  # noqa: B027 - optional hook
        """Return cached device memory after an OOM, before the retry."""

    # -- memory measurement, for `ocrq tune` and the benchmarks ----------------------------------
    # Host engines measure the process's peak RSS; device engines override all three with their
    # device's counters. Probing goes through these so that tune knows nothing about torch.

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window (host: VmHWM is reset to the current RSS)."""
        _trim_malloc()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:  # not Linux, or a sandbox without clear_refs: the peak keeps its history
            pass

    def peak_memory_bytes(self) -> int:
        """Peak memory since `reset_peak_memory`, in the unit the cost model predicts."""
        return _proc_status_bytes("VmHWM") or _proc_status_bytes("VmRSS") or 0

    def memory_capacity_bytes(self) -> int:
        """What `--budget-fraction` is a fraction of: host memory available to this process now
        plus what it already holds (device engines: the device's total memory)."""
        return available_host_bytes() + (_proc_status_bytes("VmRSS") or 0)

    def probe(self, batch: Sequence[PreparedImage]) -> list[ItemCost]:
        """Run a batch the way that costs the most memory and return each item's cost as run.

        `ocrq tune` fits the cost model on these costs and the measured peak. The default is a
        plain `run`; an engine whose cost depends on how long it generates forces that length
        (and may cap it to keep probing bounded in time, returning the costs it actually ran).
        """
        self.run(batch)
        return [self.estimate(item) for item in batch]

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device memory and sessions."""

    def describe(self) -> dict[str, str]:
        """Facts that key a tuning profile and go into logs."""
        return {"engine": self.name}
