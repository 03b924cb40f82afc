"""`ocrq run` and `ocrq samples`: the embedded mode, one process with no Redis and no
PostgreSQL (the same batcher, planner and engine as a worker, fed from a local iterator)."""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ocrq.cli.app import (
    ENGINE_HELP,
    EXIT_FAILED,
    EXIT_USAGE,
    NOT_DONE,
    TASK_HELP,
    app,
    db_url_of,
    err,
    load_settings,
    progress_bar,
    say_found_inputs,
    setup_logging,
    summary_line,
)
from ocrq.core.process import setup_process


def _results_file() -> Path:
    return Path(f"ocrq-results-{dt.datetime.now():%Y%m%d-%H%M%S}.jsonl").resolve()


@app.command()
def run(
    paths: Annotated[
        list[Path],
        # A path that names nothing is a typo on the command line: said at once (exit 2),
        # not as a failed job blaming OCRQ_ALLOWED_ROOTS, which `run` does not apply.
        typer.Argument(
            help="Image or document (PDF, TIFF) files, or folders: the images and PDFs anywhere "
            "beneath them, in sorted order (hidden files and folders left out).",
            exists=True,
        ),
    ],
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="JSONL file. Default: stdout, or when stdout is a terminal (where the progress "
            "bar is) a new ocrq-results-*.jsonl in this folder.",
        ),
    ] = None,
    task: Annotated[str, typer.Option(help=TASK_HELP)] = "text",
    db: Annotated[
        str | None,
        typer.Option(
            help="Where the job rows go: a SQLAlchemy URL, or a file path (a SQLite file); "
            "default: a temporary file."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Logging level on stderr.")] = "WARNING",
) -> None:
    """OCR images in this process (no Redis, no PostgreSQL): one JSON object per image.
    Exit code 1 when any image failed (or any page of a document: partial)."""
    from ocrq.models.registry import task_refusal
    from ocrq.worker.embedded import find_inputs, run_paths

    setup_logging(log_level)
    settings = load_settings(engine=engine)
    refusal = task_refusal(settings.engine, task)
    if refusal:  # said before the engine loads, not once per image after
        err.print(
            f"[red]ocrq run: --task {escape(repr(task))}:[/] {escape(refusal)}",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(EXIT_USAGE)
    found = find_inputs(paths)
    say_found_inputs("run", [str(p) for p in paths], len(found.files), found)
    setup_process(settings)  # the engine loads in this process
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        err.print(f"[yellow]not found (reported as failed):[/] {', '.join(missing)}")
    total = len(found.files)
    if output is None and sys.stdout.isatty():
        output = _results_file()  # JSONL lines would tear through the progress bar
    out = output.open("w", encoding="utf-8") if output else sys.stdout
    started = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="ocrq-run-") as scratch, progress_bar() as progress:
            bar = progress.add_task(f"OCR ({settings.engine})", total=total)

            def emit(outcome) -> None:  # type: ignore[no-untyped-def]
                row = outcome.as_json()
                row.pop("job_id", None)
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()

            grown = threading.Lock()  # documents split in several threads at once
            units = [total]  # the bar's total: each file one unit, a document its pages

            def advance(finished: int, more: int) -> None:
                """Images and pages, as `submit --wait` counts: a PDF's pages move the bar."""
                with grown:
                    if more:
                        units[0] += more
                        progress.update(bar, total=units[0])
                    if finished:
                        progress.advance(bar, finished)

            db_url = db_url_of(db) if db else f"sqlite:///{Path(scratch) / 'run.sqlite'}"
            counts = run_paths(
                found.files, settings, db_url, emit, task=task, on_progress=advance,
                roots=found.roots,
            )
    finally:
        if output:
            out.close()
    err.print(summary_line(counts, total, time.monotonic() - started))
    if output:
        err.print(f"results: {output}", soft_wrap=True, highlight=False)
    if any(counts.get(k, 0) for k in NOT_DONE):  # as `submit --wait`
        raise typer.Exit(EXIT_FAILED)


@app.command()
def samples(
    folder: Annotated[Path, typer.Argument(help="Where to write the sample images.")] = Path(
        "samples"
    ),
) -> None:
    """Draw a few sample images for trying ocrq out."""
    from ocrq.core.samples import write_samples

    for path in write_samples(folder):
        typer.echo(path)

