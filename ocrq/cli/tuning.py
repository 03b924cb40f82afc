"""`ocrq tune`: probe the engine, fit its memory model, sweep the batch knob on the user's
images; the tables and lines it prints (ocrq/tuning/ does the measuring)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ocrq.cli.app import (
    ENGINE_HELP,
    EXIT_USAGE,
    TASK_HELP,
    app,
    err,
    load_settings,
    progress_bar,
    setup_logging,
)
from ocrq.core.process import setup_process
from ocrq.core.settings import Settings


@app.command()
def tune(
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    images: Annotated[
        list[Path] | None,
        typer.Option(
            help="Images like the ones you will OCR (a folder or files; repeat the option): "
            "sweep the max batch on them and recommend the settings. Without it, tune probes "
            "drawn pages and fits the cost model only."
        ),
    ] = None,
    task: Annotated[str, typer.Option(help=f"Task the sample runs with ({TASK_HELP})")] = "text",
    sample_size: Annotated[
        int, typer.Option(help="Images of --images used at most, spread over their sizes.")
    ] = 16,
    knee: Annotated[
        float, typer.Option(help="The knee: the smallest max batch within this share of the best "
                            "images/s.")
    ] = 0.95,
    headroom: Annotated[
        float, typer.Option(help="Share of the budget the recommended setting leaves free.")
    ] = 0.15,
    budget: Annotated[
        float | None, typer.Option(help="GiB the engine may use in all, fixed part included.")
    ] = None,
    budget_fraction: Annotated[
        float | None,
        typer.Option(help="Share of the device's memory (host memory for rapid); default 0.8."),
    ] = None,
    max_seconds: Annotated[
        float, typer.Option(help="Time for all probes (or the first pass and sweep) together.")
    ] = 90.0,
    max_batch: Annotated[
        int | None, typer.Option(help="Largest batch probed (default OCRQ_MAX_BATCH).")
    ] = None,
    rounds: Annotated[
        int | None, typer.Option(min=1, help="With --images: runs of each setting at most (the "
                                 "first pass, then rounds while --max-seconds allows; default "
                                 "3); its rate is their median.")
    ] = None,
    profile_dir: Annotated[
        Path | None, typer.Option(help="Where profiles go (default OCRQ_PROFILE_DIR).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Logging level on stderr.")] = "WARNING",
) -> None:
    """Probe the device with real batches, fit the memory cost model, write the profile that
    workers load at start (plus a PNG of throughput and peak memory against batch size); with
    --images, find the knee on your images and recommend the settings to paste."""
    from ocrq.tuning.probing import NothingMeasured
    from ocrq.tuning.tune import BudgetError, fit_summary, table, tune_engine

    setup_logging(log_level)
    quiet_compilers()
    try:  # checked before minutes of probing, not after
        import matplotlib  # noqa: F401
    except ImportError:
        err.print(
            "ocrq tune draws its plot with matplotlib: in a checkout, `bash scripts/venv.sh "
            "service,tune`; an installed ocrq, `pip install 'ocrq[tune]'`",
            markup=False,
        )
        raise typer.Exit(2) from None
    if not 0 < knee <= 1 or not 0 <= headroom < 1:
        raise typer.BadParameter("--knee must be within (0, 1] and --headroom within [0, 1)")
    settings = load_settings(engine=engine, profile_dir=profile_dir, max_batch=max_batch)
    setup_process(settings)  # before the engine loads: it measures the allocator's memory
    if images:
        _tune_images(settings, images, task, sample_size, knee, headroom, budget,
                     budget_fraction, max_seconds, rounds)
        return
    try:
        outcome = tune_engine(
            settings, budget, budget_fraction, max_seconds=max_seconds, say=err.print
        )
    except BudgetError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except NothingMeasured as exc:
        err.print(f"[red]ocrq tune:[/] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(EXIT_USAGE) from None
    assert outcome.report.fit is not None
    _tables().print(table(outcome.report, f"ocrq tune: {settings.engine}"))
    typer.echo(fit_summary(outcome.report.fit))
    if outcome.running:
        r = outcome.running
        typer.echo(
            f"running loop at this budget: {r['slots']} slots, a KV pool of {r['pool_tokens']} "
            f"tokens, prefill passes of {r['prefill_tokens']} tokens"
        )
    typer.echo(f"profile: {outcome.profile}")
    typer.echo(f"plot: {outcome.plot}")
    typer.echo("for the sweet spot on your own images and the settings to paste: --images DIR")


def _tables() -> Console:
    """Where tune's tables go: a terminal's own width (at a fixed 160 every row wrapped on an
    80-column one; rich fits a table by wrapping within its cells instead), 160 when piped so a
    saved report keeps one line a row."""
    return Console() if sys.stdout.isatty() else Console(width=160)


# Modules whose warnings are their compilers talking (FlashAttention-4's CuTe DSL JIT, Triton):
# one UserWarning per kernel shape compiled reached the user's terminal mid-tune.
COMPILER_MODULES = r"(cutlass|flash_attn|triton|nvidia_cutlass_dsl)(\.|$)"


def quiet_compilers() -> None:
    """Keep kernel compilers' warnings off tune's terminal; `--log-level DEBUG` still shows them
    (they then go to the log, as every warning does)."""
    import warnings

    if logging.getLogger().getEffectiveLevel() <= logging.DEBUG:
        logging.captureWarnings(True)
        return
    warnings.filterwarnings("ignore", module=COMPILER_MODULES)


def _tune_images(
    settings: Settings, paths: list[Path], task: str, sample_size: int, knee: float,
    headroom: float, budget: float | None, budget_fraction: float | None, max_seconds: float,
    rounds: int | None = None,
) -> None:
    """`ocrq tune --images`: the sweep with a progress bar, then the tables and the lines to
    paste; a sample or sweep that cannot support a recommendation exits 2 saying why."""
    from ocrq.tuning.anatomy import anatomy_table
    from ocrq.tuning.images import sweep_table, tune_images
    from ocrq.tuning.sample import SampleProblem
    from ocrq.tuning.sweep import ROUNDS, SweepProblem
    from ocrq.tuning.tune import BudgetError, fit_summary

    try:
        with progress_bar() as progress:
            bar = progress.add_task(f"sweep ({settings.engine})", total=None)
            outcome = tune_images(
                settings, paths, task=task, budget_gib=budget, budget_fraction=budget_fraction,
                max_seconds=max_seconds, sample_size=sample_size, fraction=knee,
                headroom=headroom, say=err.print,
                rounds=ROUNDS if rounds is None else rounds,
                progress=lambda done, total: progress.update(bar, completed=done, total=total),
            )
    except BudgetError as exc:
        raise typer.BadParameter(str(exc)) from exc
    except (SampleProblem, SweepProblem) as exc:
        measured = getattr(exc, "sweep", None)
        if measured is not None:
            _tables().print(sweep_table(measured, None, "what the sweep measured"))
        err.print(f"ocrq tune: {exc}")
        raise typer.Exit(2) from None
    console = _tables()
    rec = outcome.recommendation
    console.print(sweep_table(outcome.sweep, rec, f"ocrq tune --images: {settings.engine}, "
                                                  "images/s per max batch"))
    typer.echo(f"images/s: {outcome.rate}")
    console.print(anatomy_table(outcome.anatomy, "memory anatomy"))
    typer.echo(rec.describe("max batch"))
    typer.echo(outcome.versus_default())
    if outcome.sweep.oom_setting is not None:
        typer.echo(f"out of memory at max batch {outcome.sweep.oom_setting} (recovered)")
    if rec.limited_by == "memory":
        typer.echo("the knee is where memory stops the batch, not where throughput flattens")
    if outcome.fit is not None:
        typer.echo(fit_summary(outcome.fit))
    else:
        typer.echo(f"cost model kept: {outcome.model.source} (the loop's peaks hold its pool; "
                   "`ocrq tune` without --images fits it)")
    if outcome.running:
        r = outcome.running
        typer.echo(f"running loop at the knee: {r['slots']} slots, a KV pool of "
                   f"{r['pool_tokens']} tokens, prefill passes of {r['prefill_tokens']} tokens")
    typer.echo("settings to paste (a worker started now also reads the max batch from the "
               "profile):")
    for line in outcome.paste:
        typer.echo(f"  {line}")
    if outcome.vllm_flags:
        typer.echo(f"for vllm serve: {outcome.vllm_flags}")
    typer.echo(f"profile: {outcome.profile}")
    typer.echo(f"plot: {outcome.plot}")

