"""`ocrq tune`'s probing: real batches on the device, bounded in memory and time, then the fit.

Why probe instead of computing: the bytes per image depend on the device, the framework, the
attention kernels and the allocator, none of which arithmetic sees. The probing is built to be
safe and bounded:

* every batch size after the first is predicted from what the same image already measured
  (linear in the batch, with a safety factor) and skipped when the prediction passes FILL of
  the budget, so tune stops before an OOM by its own prediction (an OOM, should one still
  happen, ends that series and is reported, never fatal);
* every probe's time is predicted the same way and skipped when it would pass the deadline.

Per image kind it runs batches of 1, 4, a quarter of the largest predicted to fit and that
largest (each image preprocessed once, so probe times are the engine's own), plus one mixed batch
(the longest image padded together with short ones) that separates the padding term from the
per-patch term. The fit is `models.calibration.fit` over those peaks, with the fixed part never
below the baseline reading (engine loaded, nothing running).

Memory is read through the engine's MemoryProbing side (ocrq/models/memory.py; `reset_peak_memory` /
`peak_memory_bytes`): host RSS peak for the CPU engine, the CUDA allocator's peak for a GPU
engine; the engine also names the pages it is probed with. What is made of the measurements (the
profile, the plot, the table) is ocrq/tuning/tune.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from PIL import Image, ImageDraw, ImageFont

from ocrq.models.base import Engine, PreparedImage
from ocrq.models.costs import GiB, ItemCost
from ocrq.models.memory import MemoryProbing, OutOfMemory, ProbePage, catch_oom, memory_of
from ocrq.tuning.calibration import Fit, Sample, fit


class NothingMeasured(RuntimeError):
    """Every probe was skipped or failed: `ocrq tune` says what to change (was a traceback)."""

log = logging.getLogger(__name__)

SAFETY = 1.15  # a prediction from one series' measurements is inflated by this before comparing
FILL = 0.8  # probes stay below this share of the budget (by that inflated prediction)
WARM_UP = "warm-up"


def draw_page(width: int, height: int, lines: Sequence[str], size: int) -> Image.Image:
    """A white page of `width` x `height` with a few lines of black text (a probe image).

    Few lines on purpose: the memory follows the page's pixels, while the CPU engine's time
    follows the number of lines it reads.
    """
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    try:
        font: ImageFont.ImageFont | ImageFont.FreeTypeFont = ImageFont.load_default(size=size)
    except (TypeError, OSError, ImportError):  # a Pillow without FreeType: fixed-size bitmap font
        font = ImageFont.load_default()
    for i, line in enumerate(lines):
        draw.text((size, size + int(i * size * 1.6)), line, fill="black", font=font)
    return image


def probe_images(pages: Sequence[ProbePage]) -> list[tuple[str, Image.Image]]:
    """The engine's probe pages drawn, smallest first (the first also warms the engine up)."""
    return [(p.label, draw_page(p.width, p.height, p.lines, p.font_size)) for p in pages]


@dataclass(frozen=True)
class ProbeResult:
    """One probe batch as it ran (or why it did not)."""

    label: str
    batch: int
    status: str  # "ok", "warm-up", "oom", or "skipped: <why>"
    seconds: float = 0.0
    peak_bytes: int | None = None
    predicted_bytes: int | None = None  # tune's own prediction before running it
    costs: tuple[ItemCost, ...] = ()

    @property
    def ran(self) -> bool:
        return self.status in ("ok", "warm-up")

    @property
    def images_per_s(self) -> float:
        return self.batch / self.seconds if self.ran and self.seconds > 0 else 0.0


@dataclass
class TuneReport:
    budget_bytes: int
    baseline_bytes: int = 0
    probes: list[ProbeResult] = field(default_factory=list)
    fit: Fit | None = None
    seconds: float = 0.0

    def samples(self) -> list[Sample]:
        """Every clean probe; the warm-up is left out (it holds first-call allocations)."""
        return [
            Sample(p.costs, p.peak_bytes)
            for p in self.probes
            if p.status == "ok" and p.peak_bytes is not None
        ]


def run_probes(
    engine: Engine,
    budget_bytes: int,
    *,
    max_seconds: float,
    max_batch: int,
    images: Sequence[tuple[str, Image.Image]] | None = None,
    on_result: Callable[[ProbeResult], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> TuneReport:
    """Probe a loaded engine within `budget_bytes` (total, fixed part included) and time."""
    started = clock()
    deadline = started + max_seconds
    report = TuneReport(budget_bytes=budget_bytes)
    memory: MemoryProbing = memory_of(engine)
    images = list(images or probe_images(memory.probe_pages()))
    if not images:
        raise ValueError("no probe images")

    def emit(result: ProbeResult) -> ProbeResult:
        report.probes.append(result)
        log.info("probe %s x%d: %s", result.label, result.batch, result.status)
        if on_result is not None:
            on_result(result)
        return result

    def measure(
        label: str, batch: list[PreparedImage], predicted: int | None, status: str = "ok"
    ) -> ProbeResult:
        memory.release_memory()
        memory.reset_peak_memory()
        t0 = time.perf_counter()
        costs = catch_oom(memory, lambda: memory.probe(batch))
        seconds = time.perf_counter() - t0
        if isinstance(costs, OutOfMemory):
            return emit(ProbeResult(label, len(batch), "oom", seconds, None, predicted))
        peak = memory.peak_memory_bytes()
        return emit(ProbeResult(label, len(batch), status, seconds, peak, predicted, tuple(costs)))

    prepared: dict[str, PreparedImage] = {}

    def items(label: str, image: Image.Image, n: int) -> list[PreparedImage]:
        """n copies of one image, preprocessed once (as prefetch threads would do it), so a
        probe's time is the engine's alone."""
        if label not in prepared:
            prepared[label] = PreparedImage(label, image, image.size)
            engine.prepare(prepared[label])
        one = prepared[label]
        return [
            PreparedImage(f"{label}-{i}", image, image.size, encoded=one.encoded) for i in range(n)
        ]

    # Warm-up: first calls allocate workspaces and caches that then stay; not a sample.
    label0, image0 = images[0]
    measure(label0, items(label0, image0, 1), None, status=WARM_UP)
    memory.release_memory()
    memory.reset_peak_memory()
    report.baseline_bytes = memory.peak_memory_bytes()
    base = report.baseline_bytes
    limit = FILL * budget_bytes
    image_of = dict(images)
    costs = {label: engine.estimate(PreparedImage(label, im, im.size)) for label, im in images}

    def size(label: str) -> tuple[int, int]:
        return costs[label].tokens, costs[label].patches

    per_image: dict[str, int] = {}  # label -> measured bytes one image adds
    largest: dict[str, int] = {}  # label -> largest batch that ran

    def series(label: str) -> None:
        """Batches of 1, 4, 16, ... up to the largest predicted to fit. Growing by 4x at most
        bounds each probe's time by 4x the last one's, even where time grows with the batch."""
        image = image_of[label]
        if clock() >= deadline:
            emit(ProbeResult(label, 1, "skipped: time budget spent"))
            return
        last = measure(label, items(label, image, 1), None)
        if not last.ran or last.peak_bytes is None:
            return
        inc = max(last.peak_bytes - base, 1)
        per_image[label] = inc
        largest[label] = 1
        n_big = min(max_batch, int((limit - base) / (inc * SAFETY)))
        # Geometric steps below the largest, dropping one within 25% of it (64 next to 65).
        steps = [n for n in (4, 16, 64, 256, 1024) if n * 1.25 <= n_big]
        sizes = [*steps, n_big] if n_big >= 2 else []
        for n in sizes:
            n = min(n, 4 * last.batch)
            if n <= last.batch:
                continue
            predicted = int(base + inc * n * SAFETY)
            seconds = last.seconds * n / last.batch  # worst case: time proportional to batch
            if clock() + seconds > deadline:
                emit(
                    ProbeResult(
                        label,
                        n,
                        f"skipped: needs up to {seconds:.0f} s, past the time budget",
                        0.0,
                        None,
                        predicted,
                    )
                )
                return
            probe = measure(label, items(label, image, n), predicted)
            if not probe.ran:
                return
            last = probe
            largest[label] = n
        beyond = 2 * largest[label]
        if beyond <= max_batch:  # the next size the rule refused, to show where it stops
            predicted = int(base + inc * beyond * SAFETY)
            if predicted > limit:
                emit(
                    ProbeResult(
                        label,
                        beyond,
                        f"skipped: predicted {predicted / GiB:.2f} GiB > {FILL:.0%} of budget",
                        0.0,
                        None,
                        predicted,
                    )
                )

    def padded(long_label: str, short_label: str) -> None:
        """The longest image with many short ones: every row padded to the long one. Without
        it, tokens and patches move together in every probe and the fit cannot tell which of
        them costs the memory (on the H200 it is the padded tokens)."""
        if long_label not in per_image or size(long_label) == size(short_label):
            return
        # As many rows as the long image ran alone: a padded short row costs at most as much.
        n = max(2, largest[long_label])
        predicted = int(base + per_image[long_label] * n * SAFETY)
        label = f"mixed: 1 {long_label} + {n - 1} {short_label}"
        runs = [p for p in report.probes if p.label == long_label and p.ran]
        seconds = max(p.seconds for p in runs) * n / max(p.batch for p in runs)
        if predicted > limit:
            emit(ProbeResult(label, n, "skipped: predicted over budget", 0.0, None, predicted))
        elif clock() + seconds > deadline:
            emit(ProbeResult(label, n, "skipped: time budget spent", 0.0, None, predicted))
        else:
            batch = items(long_label, image_of[long_label], 1) + items(
                short_label, image_of[short_label], n - 1
            )
            measure(label, batch, predicted)

    # Priority under the time budget: the shortest and the longest image, the padded batch
    # that separates the two cost terms, then the sizes in between.
    order = sorted(image_of, key=size)
    shortest, longest = order[0], order[-1]
    series(shortest)
    if longest != shortest:
        series(longest)
        padded(longest, shortest)
    for label in order[1:-1]:
        series(label)

    samples = report.samples()
    if not samples:
        raise NothingMeasured(
            "no probe finished within the budget and --max-seconds, so there is nothing to fit: "
            "give more --max-seconds (a loaded host runs each probe slower) or a larger --budget"
        )
    # The decode part is the engine's KV-cache arithmetic, not fitted (ocrq/tuning/calibration.py).
    default = engine.cost_model()
    report.fit = fit(
        samples,
        min_fixed_bytes=base,
        source="tune",
        cache_token_bytes=default.per_cache_token_bytes,
        decode_fixed_bytes=default.decode_fixed_bytes,
    )
    report.seconds = clock() - started
    return report


def resolve_budget(engine: Engine, budget_gib: float | None, fraction: float | None) -> int:
    """Total bytes the engine may use: --budget GiB, else --budget-fraction of its memory
    (device memory for a GPU engine, available + own host memory for the CPU engine)."""
    if budget_gib is not None and fraction is not None:
        raise ValueError("give --budget or --budget-fraction, not both")
    if budget_gib is not None:
        if budget_gib <= 0:
            raise ValueError("--budget must be positive")
        return int(budget_gib * GiB)
    fraction = 0.8 if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise ValueError("--budget-fraction must be within (0, 1]")
    return int(fraction * memory_of(engine).memory_capacity_bytes())
