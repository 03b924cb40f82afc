"""`ocrq tune`: probe the device (ocrq/tuning/probing.py), then write what workers and people read.

Workers read the profile (the fitted cost model, keyed by device, engine and the settings that
change its memory: ocrq/tuning/profiles.py); people read the table and the PNG of throughput and
peak memory against batch size beside it. matplotlib and rich are imported only where the plot
and the table are made, so a worker importing the profile code never loads them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ocrq.core.settings import Settings
from ocrq.models.base import Engine
from ocrq.models.costs import CostModel, GiB
from ocrq.models.registry import create_engine
from ocrq.tuning.calibration import Fit
from ocrq.tuning.probing import ProbeResult, TuneReport, resolve_budget, run_probes
from ocrq.tuning.profiles import engine_key, profile_path, write_profile


def predicted_peak(report: TuneReport, probe: ProbeResult) -> int | None:
    """The fitted model's prediction for a probe that ran (None otherwise)."""
    if report.fit is None or not probe.costs:
        return None
    return report.fit.model.peak_bytes(list(probe.costs))


def table(report: TuneReport, title: str = "ocrq tune") -> Any:
    """A rich Table of the probes, with the fitted model's prediction beside each peak."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("images", "batch", "seconds", "peak GiB", "fit GiB", "images/s", "status"):
        t.add_column(col, justify="left" if col in ("images", "status") else "right")
    for p in report.probes:
        fitted = predicted_peak(report, p)
        t.add_row(
            p.label,
            str(p.batch),
            f"{p.seconds:.2f}" if p.ran or p.status == "oom" else "-",
            f"{p.peak_bytes / GiB:.3f}" if p.peak_bytes is not None else "-",
            f"{fitted / GiB:.3f}" if fitted is not None else "-",
            f"{p.images_per_s:.2f}" if p.ran else "-",
            p.status,
        )
    return t


def plot(report: TuneReport, path: Path, title: str) -> Path:
    """PNG: throughput and peak memory against batch size per image kind, model and budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series: dict[str, list[ProbeResult]] = {}
    for p in report.probes:
        if p.status == "ok" and not p.label.startswith("mixed"):
            series.setdefault(p.label, []).append(p)
    for label, runs in series.items():
        runs = sorted(runs, key=lambda p: p.batch)
        xs = [p.batch for p in runs]
        (line,) = ax_t.plot(xs, [p.images_per_s for p in runs], "o-", label=label)
        ax_m.plot(
            xs,
            [p.peak_bytes / GiB for p in runs],
            "o",
            color=line.get_color(),
            label=f"{label} measured",
        )
        if report.fit is not None and runs[0].costs:
            top = max(xs)
            grid = sorted({1, *range(1, top + 1, max(1, top // 40)), top})
            model = report.fit.model
            ax_m.plot(
                grid,
                [model.peak_bytes([runs[0].costs[0]] * n) / GiB for n in grid],
                "-",
                color=line.get_color(),
                alpha=0.6,
            )
    for p in report.probes:
        if p.status == "ok" and p.label.startswith("mixed"):
            ax_m.plot([p.batch], [p.peak_bytes / GiB], "k*", markersize=10, label="mixed batch")
    ax_m.axhline(report.budget_bytes / GiB, color="red", linestyle="--", label="budget")
    ax_t.set_xlabel("batch size")
    ax_t.set_ylabel("images / s")
    ax_t.set_title("throughput")
    ax_m.set_xlabel("batch size")
    ax_m.set_ylabel("peak GiB (lines: fitted model)")
    ax_m.set_title("peak memory")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def running_loop(report: TuneReport, engine: Engine) -> dict[str, Any] | None:
    """What the fitted model gives the running loop (continuous batching) at the tuned budget:
    slots, KV pool tokens, the prefill reserve (ocrq/models/slots.py); None for an engine
    without one or a budget that leaves no pool."""
    if report.fit is None:
        return None
    settings = getattr(engine, "settings", None)
    slots = getattr(settings, "max_batch", None) or engine.preferred_max_batch()
    return loop_plan(engine, report.fit.model, report.budget_bytes, slots)


def loop_plan(
    engine: Engine, model: CostModel, budget_bytes: int, slots: int
) -> dict[str, Any] | None:
    """The running loop's plan (`RunningBudget`) for `slots` within `budget_bytes` (total), or
    None for an engine without a loop or a budget that leaves no pool."""
    from ocrq.models.base import streaming
    from ocrq.models.slots import RunningBudget

    if streaming(engine) is None:
        return None
    settings = getattr(engine, "settings", None)
    in_loop = getattr(engine, "loop_cost_model", None)  # the pool's own KV dtype
    if in_loop is not None:
        model = in_loop(model)
    pass_tokens = getattr(engine, "pass_tokens", None)
    try:
        planned = RunningBudget.plan(
            model,
            budget_bytes - model.fixed_bytes,
            slots=slots,
            prefill_tokens=(
                pass_tokens() if pass_tokens else getattr(settings, "prefill_tokens", 16384)
            ),
        )
    except ValueError:
        return None
    return asdict(planned)


@dataclass(frozen=True)
class TuneOutcome:
    report: TuneReport
    key: dict[str, str]
    profile: Path
    plot: Path
    running: dict[str, Any] | None = None  # the running loop at this budget (`running_loop`)


def save(report: TuneReport, engine: Engine, profile_dir: Path) -> TuneOutcome:
    """Write the profile JSON (the fitted model, keyed for workers) and the PNG beside it."""
    if report.fit is None:
        raise ValueError("nothing fitted")
    facts = engine.describe()
    key = engine_key(engine)
    png = profile_path(profile_dir, key).with_suffix(".png")
    title = ", ".join(f"{k}={v}" for k, v in key.items() if v)
    plot(report, png, title)
    probes = []
    for p in report.probes:
        row = asdict(p)
        row["costs"] = [asdict(c) for c in p.costs]
        row["fit_bytes"] = predicted_peak(report, p)
        row["images_per_s"] = p.images_per_s
        probes.append(row)
    running = running_loop(report, engine)
    extra = {
        "running_loop": running,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "budget_bytes": report.budget_bytes,
        "baseline_bytes": report.baseline_bytes,
        "fit": {
            "cover_factor": report.fit.cover_factor,
            "max_rel_error": report.fit.max_rel_error,
            "samples": report.fit.samples,
        },
        "seconds": round(report.seconds, 2),
        "engine_facts": facts,
        "plot": str(png),
        "probes": probes,
    }
    path = write_profile(profile_dir, key, report.fit.model, extra)
    return TuneOutcome(report, key, path, png, running)


def tune(
    engine: Engine,
    profile_dir: Path,
    budget_bytes: int,
    *,
    max_seconds: float,
    max_batch: int,
    on_result: Callable[[ProbeResult], None] | None = None,
) -> TuneOutcome:
    """Probe a loaded engine, fit, and write its profile + plot under `profile_dir`."""
    report = run_probes(
        engine, budget_bytes, max_seconds=max_seconds, max_batch=max_batch, on_result=on_result
    )
    return save(report, engine, profile_dir)


class BudgetError(ValueError):
    """--budget / --budget-fraction make no budget (the command's arguments are at fault)."""


def tune_engine(
    settings: Settings,
    budget_gib: float | None,
    budget_fraction: float | None,
    *,
    max_seconds: float,
    say: Callable[[str], None],
) -> TuneOutcome:
    """`ocrq tune`: load the configured engine, probe it within the budget (--budget GiB, else
    --budget-fraction of its memory) and time, fit, save; progress lines go to `say`."""
    engine = create_engine(settings.engine, settings)
    engine.load()
    try:
        try:
            total = resolve_budget(engine, budget_gib, budget_fraction)
        except ValueError as exc:
            raise BudgetError(str(exc)) from exc
        max_batch = settings.max_batch or engine.preferred_max_batch()
        say(
            f"probing {settings.engine} within {total / GiB:.2f} GiB and {max_seconds:.0f} s "
            f"(batches up to {max_batch})"
        )
        return tune(
            engine,
            settings.profile_dir,
            total,
            max_seconds=max_seconds,
            max_batch=max_batch,
            on_result=lambda p: say(probe_line(p)),
        )
    finally:
        engine.close()


def probe_line(p: ProbeResult) -> str:
    peak = f"{p.peak_bytes / GiB:.3f} GiB" if p.peak_bytes is not None else "-"
    return f"  {p.label} x{p.batch}: {p.status}, {p.seconds:.2f} s, peak {peak}"


def fit_summary(fitted: Fit) -> str:
    """The fitted model in one line, and how well it covers the probes."""
    m = fitted.model
    return (
        f"model: fixed {m.fixed_bytes / GiB:.3f} GiB, per item {m.per_item_bytes / 2**20:.3f} MiB,"
        f" per token {m.per_token_bytes / 1024:.2f} KiB, per patch {m.per_patch_bytes / 1024:.2f}"
        f" KiB, per cached token {m.per_cache_token_bytes / 1024:.2f} KiB"
        f" (+{m.decode_fixed_bytes / 2**20:.0f} MiB while decoding);"
        f" largest error on the probes {fitted.max_rel_error:.1%}"
        f" (per-image part scaled x{fitted.cover_factor:.3f} to cover them all)"
    )
