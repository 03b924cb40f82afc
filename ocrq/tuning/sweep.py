"""`ocrq tune --images`: sweep the engine's knob on the user's sample, then name the knee.

The knob is the static batcher's largest batch (OCRQ_MAX_BATCH; with the running loop the same
setting is its slots). Each setting runs the whole sample once, in batches of that size, after
one warm-up batch of that size (a new batch shape allocates workspaces, and on a GPU captures
CUDA graphs, once): the rate is steady-state, warm-up excluded. Every setting does the same
work, so the rates compare like for like. bench/sustained.py's definition (completions while a
running loop is saturated) needs a loop fed from a queue; a static batch is saturated by
construction, so its steady-state rate is the same quantity.

Each setting that ran is run again, in later rounds that visit the settings in turn (1, 2, 4,
... then 1, 2, 4, ... again) while --max-seconds allows, up to ROUNDS in all (or --rounds): on
a loaded host one run per setting moved the knee, and interleaved rounds spread a slow spell
over every setting instead of one. A setting's rate is the median of its rounds, and the table shows
their spread; the first round needs no warm-up again (each shape is warm by then).

The sweep is bounded: each setting's time is predicted from the last one's seconds per image,
scaled as if batching were perfect (an optimistic bound, with SLACK; the first from a warm call
of one image, since the engine's cold first call pays for allocations and, on a GPU, graph
captures and kernel compiles: predicted from it, a setting the H200 ran in ~5 s was skipped as
needing 191 s), and skipped past the deadline; a setting that runs past the deadline anyway is
cut there and reported as skipped, so tune never outlives --max-seconds by more than one batch
(the calls before the sweep excepted); an out-of-memory error ends the sweep at that
setting (caught and recovered, as the batcher does: `catch_oom`), and so does a peak over the
budget, since larger batches only take more.

`recommend` is pure: the knee is the smallest setting within FRACTION of the best rate among
the settings whose peak keeps HEADROOM of the budget free.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from ocrq.models.base import Engine, PreparedImage
from ocrq.models.costs import GiB, ItemCost
from ocrq.models.memory import MemoryProbing, OutOfMemory, catch_oom, memory_of
from ocrq.tuning.calibration import Sample

FRACTION = 0.95  # the knee: the smallest setting within this share of the best images/s
HEADROOM = 0.15  # share of the budget the recommended setting's peak leaves free
SLACK = 1.5  # a setting's predicted time is inflated by this before checking the deadline
ROUNDS = 3  # runs of each setting at most: the first pass, then rounds while time allows


class SweepProblem(ValueError):
    """The sweep measured too little to name a knee (time, memory or sample); `sweep` holds
    what it did measure, for the table."""

    def __init__(self, message: str, sweep: Sweep | None = None) -> None:
        super().__init__(message)
        self.sweep = sweep


class LoopRunner(Protocol):
    """Runs a setting through a running loop (ocrq/tuning/loop_sweep.py)."""

    def timed(self, rows: int, slots: int) -> int: ...

    def run(self, rows: Sequence[PreparedImage], slots: int, timed: int,
            on_batch: Callable[[int, int], None] | None, deadline: float) -> SweepPoint: ...


@dataclass(frozen=True)
class SweepPoint:
    """One setting of the knob as it ran, or why it did not."""

    setting: int
    status: str  # "ok", "oom", "over budget", "skipped: <why>"
    images: int = 0  # timed images (the warm-up batch excluded)
    seconds: float = 0.0  # timed seconds
    peak_bytes: int | None = None  # warm-up batch included
    batches: tuple[Sample, ...] = ()  # each batch's costs and peak, for the cost-model fit
    # images/s of each round after the first (the first is images / seconds)
    again: tuple[float, ...] = ()

    @property
    def ran(self) -> bool:
        return self.status == "ok"

    @property
    def rates(self) -> tuple[float, ...]:
        """images/s of each round this setting ran."""
        if not self.ran or self.seconds <= 0:
            return ()
        return (self.images / self.seconds, *self.again)

    @property
    def images_per_s(self) -> float:
        """The median round: one slow spell on a loaded host does not move the knee."""
        return statistics.median(self.rates) if self.rates else 0.0

    def spread(self) -> str:
        """The rounds' range, as the table shows it ("1 run" where only one ran)."""
        rates = self.rates
        if len(rates) < 2:
            return "1 run" if rates else "-"
        return f"{min(rates):.2f}-{max(rates):.2f} ({len(rates)} runs)"


@dataclass
class Sweep:
    budget_bytes: int
    baseline_bytes: int = 0
    points: list[SweepPoint] = field(default_factory=list)
    seconds: float = 0.0

    def samples(self) -> list[Sample]:
        return [s for p in self.points for s in p.batches]

    @property
    def oom_setting(self) -> int | None:
        return next((p.setting for p in self.points if p.status == "oom"), None)


def settings_to_try(max_batch: int) -> list[int]:
    """1, 2, 4, ... and the largest itself."""
    out, n = [], 1
    while n < max_batch:
        out.append(n)
        n *= 2
    return [*out, max_batch]


def copies(rows: Sequence[PreparedImage], n: int, tag: str) -> list[PreparedImage]:
    """n rows cycling through `rows`, each a fresh item sharing the prepared inputs."""
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        out.append(
            PreparedImage(
                f"{tag}-{i}", row.image, row.original_size, task=row.task, prompt=row.prompt,
                max_new_tokens=row.max_new_tokens, encoded=row.encoded,
            )
        )
    return out


def run_sweep(
    engine: Engine,
    rows: Sequence[PreparedImage],
    budget_bytes: int,
    *,
    max_batch: int,
    deadline: float,
    warm_each: bool = True,
    on_batch: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    loop: LoopRunner | None = None,
    rounds: int = ROUNDS,
) -> Sweep:
    """Run the sample at each setting up to `max_batch` (see the module docstring).

    `rows` are prepared (`Engine.prepare`), with their task and output length set. `on_batch`
    gets (setting, images just run) after every batch, for a progress bar. `warm_each=False`
    leaves out the warm-up batch of each setting: an engine in host memory captures no graphs
    per batch shape, and its first call (always left out) warms it up once for all. With
    `loop` (ocrq/tuning/loop_sweep.py) each setting is the running loop's slots, run through
    the loop; `loop_rows` says how many rows it times. `rounds`: runs of each setting at most
    (`ocrq tune --rounds`; 1: the first pass only).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    if not rows:
        raise SweepProblem("no images to sweep with")
    started = clock()
    memory: MemoryProbing = memory_of(engine)
    sweep = Sweep(budget_bytes)

    def one(batch: list[PreparedImage], setting: int) -> tuple[float, Sample] | OutOfMemory:
        memory.release_memory()
        memory.reset_peak_memory()
        t0 = time.perf_counter()
        outcome = catch_oom(memory, lambda: engine.run(batch))
        seconds = time.perf_counter() - t0
        if on_batch is not None:
            on_batch(setting, len(batch))
        if isinstance(outcome, OutOfMemory):
            return outcome
        if outcome and all(isinstance(r, Exception) for r in outcome):
            raise SweepProblem(f"the engine failed every image of a batch: {outcome[0]}")
        costs: tuple[ItemCost, ...] = tuple(engine.estimate(item) for item in batch)
        return seconds, Sample(costs, memory.peak_memory_bytes())

    # The engine's first call allocates what then stays: not part of any setting.
    first = one(copies(rows, 1, "warm"), 1)
    if isinstance(first, OutOfMemory):
        raise SweepProblem(f"one image does not fit: {first.message}")
    per_image_s, last = first[0], 1  # seconds per image, measured at setting `last`
    if clock() + per_image_s <= deadline:  # the first estimate, from a warm engine, if in time
        warm = one(copies(rows, 1, "warm1"), 1)
        if isinstance(warm, OutOfMemory):
            raise SweepProblem(f"one image does not fit: {warm.message}")
        per_image_s = warm[0]
    memory.release_memory()
    memory.reset_peak_memory()
    sweep.baseline_bytes = memory.peak_memory_bytes()
    for setting in settings_to_try(max_batch):
        if loop is None:
            timed = -(-len(rows) // setting) * setting  # the whole sample, in full batches
        else:
            timed = loop.timed(len(rows), setting)
        # Optimistic (batching as if perfect): the prediction only keeps a setting that cannot
        # finish from starting; the cut at the deadline bounds one that then runs slower.
        need = SLACK * per_image_s * last / setting * (timed + (setting if warm_each or loop
                                                                else 0))
        if clock() + need > deadline:
            sweep.points.append(
                SweepPoint(setting, f"skipped: needs ~{need:.0f} s, past --max-seconds")
            )
            break
        if loop is None:
            point = run_setting(one, rows, setting, timed, warm_each, deadline, clock)
        else:
            point = loop.run(rows, setting, timed, on_batch, deadline)
        sweep.points.append(point)
        if not point.ran:
            break
        per_image_s, last = point.seconds / point.images, setting
        if point.peak_bytes is not None and point.peak_bytes > budget_bytes:
            sweep.points[-1] = SweepPoint(
                setting, "over budget", point.images, point.seconds, point.peak_bytes,
                point.batches,
            )
            break
    _more_rounds(sweep, one, rows, deadline, clock, loop, on_batch, rounds)
    sweep.seconds = clock() - started
    return sweep


def _more_rounds(
    sweep: Sweep,
    one: Callable[[list[PreparedImage], int], tuple[float, Sample] | OutOfMemory],
    rows: Sequence[PreparedImage],
    deadline: float,
    clock: Callable[[], float],
    loop: LoopRunner | None,
    on_batch: Callable[[int, int], None] | None,
    rounds: int = ROUNDS,
) -> None:
    """Rounds 2..`rounds` over the settings that ran, in turn, while each fits before the
    deadline (predicted from its own first run); a round that fails or is cut ends them."""
    for _ in range(rounds - 1):
        for i, point in enumerate(sweep.points):
            if not point.ran:
                continue
            if clock() + SLACK * point.seconds > deadline:
                return
            if loop is None:
                run = run_setting(one, rows, point.setting, point.images, False, deadline, clock)
            else:
                run = loop.run(rows, point.setting, point.images, on_batch, deadline)
            if not run.ran:
                return
            peak = max(point.peak_bytes or 0, run.peak_bytes or 0) or None
            sweep.points[i] = replace(
                point, peak_bytes=peak, batches=point.batches + run.batches,
                again=(*point.again, run.images / run.seconds),
            )


def run_setting(
    one: Callable[[list[PreparedImage], int], tuple[float, Sample] | OutOfMemory],
    rows: Sequence[PreparedImage],
    setting: int,
    timed: int,
    warm_each: bool,
    deadline: float = float("inf"),
    clock: Callable[[], float] = time.monotonic,
) -> SweepPoint:
    """A warm-up batch of `setting` rows (with `warm_each`), then `timed` rows in batches of
    `setting`; cut (reported skipped) when a batch would start past `deadline`."""
    samples: list[Sample] = []
    if warm_each:
        warm = one(copies(rows, setting, f"w{setting}"), setting)
        if isinstance(warm, OutOfMemory):
            return SweepPoint(setting, "oom")
        samples.append(warm[1])
    seconds = 0.0
    items = copies(rows, timed, f"b{setting}")
    for start in range(0, timed, setting):
        if clock() > deadline:
            return SweepPoint(setting, past_deadline(start, timed), batches=tuple(samples))
        ran = one(items[start : start + setting], setting)
        if isinstance(ran, OutOfMemory):
            return SweepPoint(setting, "oom", batches=tuple(samples))
        seconds += ran[0]
        samples.append(ran[1])
    peak = max(s.peak_bytes for s in samples)
    return SweepPoint(setting, "ok", timed, seconds, peak, tuple(samples))


def past_deadline(done: int, timed: int) -> str:
    """The status of a setting cut at the deadline (its partial rate is not comparable: the
    rows it ran are not the whole sample)."""
    return f"skipped: past --max-seconds after {done} of {timed} images"


@dataclass(frozen=True)
class Recommendation:
    """The knee and why: what to set, what it gives, what it keeps free."""

    setting: int
    images_per_s: float
    peak_bytes: int
    best_setting: int
    best_images_per_s: float
    fraction: float
    headroom: float  # required share of the budget left free
    headroom_kept: float  # share of the budget the recommended setting's peak leaves free
    limited_by: str  # "throughput": a larger batch gains under (1 - fraction); "memory";
    # "time": the deadline stopped the sweep while the rate still rose
    pooled: bool = False  # a running loop's sweep: its peaks hold a pool sized to the budget
    # Set when the best rate was the largest setting measured and the deadline stopped the
    # sweep there: the setting it was still rising at (`setting` is then what to keep).
    rising_at: int | None = None

    def describe(self, knob: str = "batch") -> str:
        if self.rising_at is not None:
            return (
                f"no knee: images/s was still rising at {knob} {self.rising_at} "
                f"({self.images_per_s:.2f} images/s) when --max-seconds ran out, so the "
                f"larger {knob} {self.setting} is kept (give more --max-seconds to measure it)"
            )
        gain = (
            f"the best, {knob} {self.best_setting}, makes {self.best_images_per_s:.2f} images/s"
        )
        if self.pooled:
            kept = (f"peak {self.peak_bytes / GiB:.2f} GiB: the running loop sizes its KV pool "
                    "to the budget, so the headroom is what the budget leaves of the device")
        else:
            kept = (f"peak {self.peak_bytes / GiB:.2f} GiB, keeping {self.headroom_kept:.0%} of "
                    f"the budget free (at least {self.headroom:.0%} asked)")
        return (
            f"knee: {knob} {self.setting} makes {self.images_per_s:.2f} images/s "
            f"({self.images_per_s / self.best_images_per_s:.0%} of the best; {gain}), {kept}"
        )


def recommend(
    points: Sequence[SweepPoint],
    budget_bytes: int,
    *,
    fraction: float = FRACTION,
    headroom: float = HEADROOM,
    pooled: bool = False,
) -> Recommendation:
    """The smallest setting within `fraction` of the best rate among those that leave
    `headroom` of the budget free (pure; SweepProblem when fewer than two settings ran).

    `pooled`: the points ran through a running loop, which takes the budget for its KV pool
    whatever the slots (a peak near the budget is the pool, not what the rows need), so a
    setting fits when it ran within the budget; the headroom is then the budget's own share of
    the device (--budget-fraction). Without this, an H200 sweep excluded 64-256 slots (pool
    peaks at 96% of the budget) and recommended 32, which ran the service at 0.67x the default.
    """
    ran = [p for p in points if p.ran and p.peak_bytes is not None]
    if len(ran) < 2:
        raise SweepProblem(
            f"only {len(ran)} setting(s) measured: too little to name a knee (give more "
            "--max-seconds, or a smaller sample)"
        )
    limit = budget_bytes if pooled else (1.0 - headroom) * budget_bytes
    fits = [p for p in ran if p.peak_bytes is not None and p.peak_bytes <= limit]
    if not fits:
        smallest = min(ran, key=lambda p: p.setting)
        raise SweepProblem(
            f"even batch {smallest.setting} peaks at {(smallest.peak_bytes or 0) / GiB:.2f} GiB, "
            f"over {1 - headroom:.0%} of the {budget_bytes / GiB:.2f} GiB budget: raise --budget"
        )
    best = max(fits, key=lambda p: p.images_per_s)
    knee = min((p for p in fits if p.images_per_s >= fraction * best.images_per_s),
               key=lambda p: p.setting)
    largest_fit = max(q.setting for q in fits)
    # Memory limits the knee when it is the largest setting that fits and a larger one ran out
    # of memory, passed the budget, or left less than the headroom.
    beyond = [p for p in points
              if p.setting > largest_fit and (p.ran or p.status in ("oom", "over budget"))]
    limited = "memory" if beyond and knee.setting == largest_fit else "throughput"
    cut = [p for p in points if p.setting > largest_fit and "past --max-seconds" in p.status]
    if cut and knee.setting == best.setting == largest_fit and limited == "throughput":
        limited = "time"  # still rising where the time ran out: larger settings unmeasured
    assert knee.peak_bytes is not None
    return Recommendation(
        knee.setting, knee.images_per_s, knee.peak_bytes, best.setting, best.images_per_s,
        fraction, headroom, 1.0 - knee.peak_bytes / budget_bytes, limited, pooled,
    )
