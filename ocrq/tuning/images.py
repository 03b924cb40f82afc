"""`ocrq tune --images`: on a sample of the user's images, where is the sweet spot, and what to set.

The steps, each in its own module: the sample (ocrq/tuning/sample.py), the output lengths
(lengths.py), the sweep of the knob and the knee (sweep.py), the memory anatomy (anatomy.py);
this module runs them in order, fits the cost model on the sweep's batches
(calibration.py), and writes what workers and people read: the profile (with the recommended
max batch, which a worker started afterwards uses unless OCRQ_MAX_BATCH says otherwise), the
settings to paste, and the plot of throughput and peak memory against the knob with the knee
and the budget line.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ocrq.core import procfs
from ocrq.core.settings import Settings
from ocrq.models.base import Engine, PreparedImage, streaming
from ocrq.models.costs import CostModel, GiB
from ocrq.models.memory import memory_of
from ocrq.models.registry import create_engine
from ocrq.tuning.anatomy import Term, anatomy, reading, to_json
from ocrq.tuning.calibration import Fit, fit
from ocrq.tuning.lengths import Lengths, output_lengths
from ocrq.tuning.loop_sweep import PREFILL_HOW, RATE, LoopSetting, loop_rows
from ocrq.tuning.probing import resolve_budget
from ocrq.tuning.profiles import body_model, engine_key, profile_path, read_profile, write_profile
from ocrq.tuning.sample import UserSample, load_sample
from ocrq.tuning.sweep import (
    FRACTION,
    HEADROOM,
    ROUNDS,
    Recommendation,
    Sweep,
    SweepProblem,
    recommend,
    run_sweep,
    settings_to_try,
)
from ocrq.tuning.tune import BudgetError, loop_plan

GENERATING = ("hunyuan", "vllm")  # engines whose users may run `vllm serve` instead


@dataclass(frozen=True)
class ImagesOutcome:
    sample: UserSample
    lengths: Lengths
    sweep: Sweep
    fit: Fit | None  # None: swept through the running loop, whose peaks hold its pool
    model: CostModel  # what the profile holds: the fit, else the profile's or engine's own
    recommendation: Recommendation
    anatomy: list[Term]
    running: dict[str, Any] | None
    paste: list[str]  # OCRQ_* lines
    vllm_flags: str | None  # for a `vllm serve` user of a generating engine
    profile: Path
    plot: Path
    default_max_batch: int  # what a worker uses without OCRQ_MAX_BATCH or a tuned knee
    rate: str  # how images/s was measured

    def versus_default(self) -> str:
        """How the knee compares with the engine's default max batch, as measured."""
        rec, default = self.recommendation, self.default_max_batch
        if rec.rising_at is not None:
            return (f"the default max batch ({default}) is kept: the sweep stopped at "
                    f"{rec.rising_at} while images/s still rose")
        if rec.setting == default:
            return f"the default max batch ({default}) is already at the knee: nothing to change"
        at = next((p for p in self.sweep.points if p.setting == default and p.ran), None)
        if at is None:
            return (f"the default max batch is {default} (not measured here); the knee is "
                    f"{rec.setting}")
        ratio = rec.images_per_s / max(at.images_per_s, 1e-9)
        return (f"the default max batch {default} makes {at.images_per_s:.2f} images/s, the "
                f"knee {rec.setting} {rec.images_per_s:.2f} ({ratio:.2f}x)")


def planned_images(
    rows: int, max_batch: int, warm_each: bool, loop: bool, rounds: int = ROUNDS
) -> int:
    """Images the sweep runs when every setting runs every round (the progress bar's total;
    where --max-seconds ends the rounds early, the bar is completed when the sweep ends)."""
    if loop:  # each run of a setting opens and warms the loop again
        return 1 + rounds * sum(loop_rows(rows, n) + n for n in settings_to_try(max_batch))
    return 1 + sum(
        (n if warm_each else 0) + rounds * -(-rows // n) * n for n in settings_to_try(max_batch)
    )


def paste_lines(rec: Recommendation, budget_bytes: int) -> list[str]:
    return [
        f"OCRQ_MAX_BATCH={rec.setting}",
        f"OCRQ_MEMORY_BUDGET_GIB={budget_bytes / GiB:.2f}",
    ]


def vllm_flags(rec: Recommendation, budget_bytes: int, capacity: int, batch_tokens: int) -> str:
    """The same knee for `vllm serve`: sequences, the budget as a share of the device, and the
    tokens one scheduler step may batch (the prefill pass the running loop plans for)."""
    share = max(0.05, min(0.95, budget_bytes / capacity))
    return (
        f"--max-num-seqs {rec.setting} --gpu-memory-utilization {share:.2f} "
        f"--max-num-batched-tokens {batch_tokens}"
    )


def tune_images(
    settings: Settings,
    paths: Sequence[Path],
    *,
    task: str,
    budget_gib: float | None,
    budget_fraction: float | None,
    max_seconds: float,
    sample_size: int = 16,
    fraction: float = FRACTION,
    headroom: float = HEADROOM,
    say: Callable[[str], None] = lambda _: None,
    progress: Callable[[int, int], None] | None = None,
    rounds: int = ROUNDS,
) -> ImagesOutcome:
    """Sample, load, measure, sweep, recommend, save (see the module docstring).

    `max_seconds` bounds the first pass and the sweep (loading the engine is not counted);
    `progress(images done, images planned)` follows the sweep; `rounds`: runs of each setting
    at most (ocrq/tuning/sweep.py)."""
    sample = load_sample(paths, sample_size)  # before loading: its failure costs nothing
    say(sample.describe())
    engine = create_engine(settings.engine, settings)
    host_before = procfs.rss_bytes()
    engine.load()
    try:
        memory = memory_of(engine)
        device = memory.fragmentation_bytes() is not None  # None: the engine is in host memory
        after_load = reading(memory)
        # On a device the allocator counted nothing before the load (a fresh process); on the
        # host, the RSS before it is the zero.
        before_load = 0 if device else host_before
        try:
            budget = resolve_budget(engine, budget_gib, budget_fraction)
        except ValueError as exc:
            raise BudgetError(str(exc)) from exc
        started = time.monotonic()
        deadline = started + max_seconds
        rows = [PreparedImage(s.name, s.image, s.image.size, task=task) for s in sample.images]
        for row in rows:
            engine.prepare(row)
        lengths = output_lengths(engine, rows, deadline=deadline)
        say(lengths.describe())
        max_batch = settings.max_batch or engine.preferred_max_batch()
        say(f"sweeping max batch {', '.join(map(str, settings_to_try(max_batch)))} within "
            f"{budget / GiB:.2f} GiB and {max_seconds:.0f} s")
        done = 0

        def on_batch(_: int, n: int) -> None:
            nonlocal done
            done += n
            if progress is not None:
                progress(min(done, total), total)

        default = engine.cost_model()
        key = engine_key(engine)
        earlier = read_profile(settings.profile_dir, key)
        if earlier is not None:  # a fitted model from an earlier tune: the loop is sized by it
            default = body_model(earlier, profile_path(settings.profile_dir, key))
        loop = None
        looping = streaming(engine)
        if looping is not None:
            loop = LoopSetting(looping, default, budget)
            say("the engine runs the running loop: each setting is its slots, run through it "
                f"({RATE})")
        total = planned_images(len(rows), max_batch, device, loop is not None, rounds)
        sweep = run_sweep(engine, rows, budget, max_batch=max_batch, deadline=deadline,
                          warm_each=device, on_batch=on_batch, loop=loop, rounds=rounds)
        if progress is not None:
            progress(total, total)
        try:
            rec = recommend(sweep.points, budget, fraction=fraction, headroom=headroom,
                            pooled=loop is not None)
        except SweepProblem as exc:
            raise SweepProblem(str(exc), sweep) from None
        if rec.limited_by == "time" and engine.preferred_max_batch() > rec.setting:
            # Never advise less than the default from a sweep cut short while still rising: on
            # an H200 (bench/results/tune_gpu/tune_a4.md) the cut sweep's 128 slots ran the
            # service at 0.66x the default's 256.
            rec = replace(rec, setting=engine.preferred_max_batch(), rising_at=rec.setting)
        rate = RATE if loop is not None else (
            "steady state: the whole sample once per setting, after the engine's first call"
            + (" and a warm-up batch of that size" if device else ""))
        fitted = None
        model = default
        if loop is None:
            fitted = fit(sweep.samples(), min_fixed_bytes=sweep.baseline_bytes, source="tune",
                         cache_token_bytes=default.per_cache_token_bytes,
                         decode_fixed_bytes=default.decode_fixed_bytes)
            model = fitted.model
        running = loop_plan(engine, model, budget, rec.setting)
        tokens = mean_tokens(engine, rows)
        above, samples = None, [s for p in sweep.points if p.ran for s in p.batches]
        if loop is not None:  # the loop's peaks hold its pool: measure its prefill passes
            above, samples = loop.prefill_peaks(rows, deadline)
        terms = anatomy(
            before_load=before_load, after_load=after_load, baseline=sweep.baseline_bytes,
            samples=samples, batches_above=above,
            batches_how=PREFILL_HOW if loop is not None else None,
            input_bytes_per_image=sample.decoded_bytes_per_image,
            kv_bytes_per_token=default.per_cache_token_bytes if lengths.tokens else 0.0,
            tokens_per_image=tokens,
            prefill_reserve=None if running is None else int(running["prefill_bytes"]),
            where="device memory (allocator)" if device else "host RSS",
        )
        paste = paste_lines(rec, budget)
        flags = None
        if settings.engine in GENERATING:
            pass_tokens = getattr(engine, "pass_tokens", None)
            capacity = (budget / budget_fraction if budget_fraction  # the share asked for
                        else memory.memory_capacity_bytes())
            flags = vllm_flags(rec, budget, int(capacity), pass_tokens() if pass_tokens else 8192)
        png = profile_path(settings.profile_dir, key).with_suffix(".png")
        plot_sweep(sweep, rec, png, ", ".join(f"{k}={v}" for k, v in key.items() if v))
        extra = {
            "recommended": {
                "max_batch": rec.setting, **asdict(rec), "env": paste, "vllm_flags": flags,
            },
            "sweep": sweep_json(sweep),
            "oom_setting": sweep.oom_setting,
            "anatomy": to_json(terms),
            "sample": {"images": [s.name for s in sample.images], "task": task,
                       "output_tokens": list(lengths.tokens or []),
                       "lengths": lengths.source},
            "running_loop": running,
            "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "budget_bytes": budget,
            "baseline_bytes": sweep.baseline_bytes,
            "fit": None if fitted is None else {
                "cover_factor": fitted.cover_factor, "max_rel_error": fitted.max_rel_error,
                "samples": fitted.samples},
            "sweep_rate": rate,
            "seconds": round(time.monotonic() - started, 2),
            "engine_facts": engine.describe(),
            "plot": str(png),
            "probes": [],
        }
        path = write_profile(settings.profile_dir, key, model, extra)
        return ImagesOutcome(sample, lengths, sweep, fitted, model, rec, terms, running, paste,
                             flags, path, png, engine.preferred_max_batch(), rate)
    finally:
        engine.close()


def mean_tokens(engine: Engine, rows: Sequence[PreparedImage]) -> float | None:
    """The sample's mean prompt + output tokens per row (None for an engine without tokens)."""
    costs = [engine.estimate(row) for row in rows]
    if not any(c.tokens for c in costs):
        return None
    return sum(c.tokens for c in costs) / len(costs)


def sweep_json(sweep: Sweep) -> list[dict[str, Any]]:
    return [
        {"setting": p.setting, "status": p.status, "images": p.images,
         "seconds": round(p.seconds, 3), "images_per_s": p.images_per_s,
         "rates": [round(r, 4) for r in p.rates], "peak_bytes": p.peak_bytes}
        for p in sweep.points
    ]


def sweep_table(sweep: Sweep, rec: Recommendation | None, title: str) -> Any:
    """A rich Table of the sweep, the knee marked."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("max batch", "images", "seconds", "images/s", "spread", "peak GiB", "budget",
                "status"):
        t.add_column(col, justify="left" if col in ("status", "spread") else "right")
    for p in sweep.points:
        mark = "  <- knee" if rec is not None and p.setting == rec.setting and p.ran else ""
        t.add_row(
            str(p.setting),
            str(p.images) if p.ran else "-",
            f"{p.seconds:.2f}" if p.ran else "-",
            f"{p.images_per_s:.2f}" if p.ran else "-",
            p.spread(),
            f"{p.peak_bytes / GiB:.3f}" if p.peak_bytes is not None else "-",
            f"{p.peak_bytes / sweep.budget_bytes:.0%}" if p.peak_bytes is not None else "-",
            p.status + mark,
        )
    return t


def plot_sweep(sweep: Sweep, rec: Recommendation, path: Path, title: str) -> Path:
    """PNG: images/s and peak memory against the max batch, the knee and the budget line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [p for p in sweep.points if p.peak_bytes is not None]
    xs = [p.setting for p in ran]
    fig, ax_t = plt.subplots(figsize=(8, 4.5))
    ax_m = ax_t.twinx()
    ax_t.plot(xs, [p.images_per_s for p in ran], "o-", color="tab:blue", label="images/s")
    ax_m.plot(xs, [(p.peak_bytes or 0) / GiB for p in ran], "s--", color="tab:orange",
              label="peak GiB")
    ax_m.axhline(sweep.budget_bytes / GiB, color="red", linestyle="--", label="budget")
    ax_m.axhline((1 - rec.headroom) * sweep.budget_bytes / GiB, color="red", linestyle=":",
                 alpha=0.6, label=f"budget - {rec.headroom:.0%} headroom")
    ax_t.axvline(rec.setting, color="green", linestyle="-", alpha=0.7,
                 label=f"knee: {rec.setting} ({rec.fraction:.0%} of best)")
    if sweep.oom_setting is not None:
        ax_t.axvline(sweep.oom_setting, color="black", linestyle=":", label="out of memory")
    ax_t.set_xscale("log", base=2)
    ax_t.set_xticks(xs or [rec.setting], [str(x) for x in xs or [rec.setting]])
    ax_t.set_xlabel("max batch (OCRQ_MAX_BATCH; slots for the running loop)")
    ax_t.set_ylabel("images / s (steady state)")
    ax_m.set_ylabel("peak GiB")
    ax_m.set_ylim(bottom=0)
    ax_t.set_ylim(bottom=0)
    lines = ax_t.get_legend_handles_labels()
    more = ax_m.get_legend_handles_labels()
    ax_t.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower right")
    ax_t.grid(alpha=0.3)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["ImagesOutcome", "SweepProblem", "tune_images"]
