"""The `ocrq` command. Each command parses options, builds Settings, and calls one function."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ocrq.core.contract import TASKS
from ocrq.core.settings import Settings
from ocrq.models.registry import ENGINES

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
err = Console(stderr=True)
# Help strings name what is there: the registry's engines, the contract's tasks.
ENGINE_HELP = f"OCR engine: {' | '.join(ENGINES)}."
TASK_HELP = f"{' | '.join(TASKS)} | a free prompt."


def _progress() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


def _settings(**overrides: object) -> Settings:
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def _child_env(**overrides: object) -> dict[str, str]:
    """The environment a worker process is started with: this one's, plus the options given on
    the command line as their OCRQ_* variables (the child reads its Settings from it once)."""
    given = {f"OCRQ_{k.upper()}": str(v) for k, v in overrides.items() if v is not None}
    return {**os.environ, **given}


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def run(
    paths: Annotated[list[Path], typer.Argument(help="Image files or folders of images.")],
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="JSONL file.")] = None,
    task: Annotated[str, typer.Option(help=TASK_HELP)] = "text",
    db: Annotated[str, typer.Option(help="SQLite (or other) URL for the job rows.")] = (
        "sqlite:///ocrq-run.sqlite"
    ),
    log_level: Annotated[str, typer.Option(help="Logging level on stderr.")] = "WARNING",
) -> None:
    """OCR images in this process (no Redis, no PostgreSQL): one JSON object per image."""
    from ocrq.worker.embedded import expand, run_paths

    _logging(log_level)
    settings = _settings(engine=engine)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        err.print(f"[yellow]not found (reported as failed):[/] {', '.join(missing)}")
    total = len(expand(paths))
    out = output.open("w", encoding="utf-8") if output else sys.stdout
    try:
        with _progress() as progress:
            bar = progress.add_task(f"OCR ({settings.engine})", total=total)

            def emit(outcome) -> None:  # type: ignore[no-untyped-def]
                row = outcome.as_json()
                row.pop("job_id", None)
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
                out.flush()
                progress.advance(bar)

            counts = run_paths(paths, settings, db, emit, task=task)
    finally:
        if output:
            out.close()
    err.print(
        f"done: {counts.get('done', 0)}, failed: {counts.get('failed', 0)}"
        + (f" -> {output}" if output else "")
    )


@app.command()
def worker(
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Task threads: images fetched + waiting for the batcher.")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="Queue to consume.")] = None,
    max_images: Annotated[
        int | None, typer.Option(help="Recycle the worker process after this many images.")
    ] = None,
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    supervise: Annotated[
        bool,
        typer.Option(
            help="Restart the worker process after a recycle or crash (bare metal); "
            "--no-supervise under Docker/systemd/Kubernetes, which restart it."
        ),
    ] = True,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
) -> None:
    """Consume OCR jobs from the broker, batch them through the engine, store rows."""
    from ocrq.worker.lifecycle import supervise as run_supervised
    from ocrq.worker.main import run as run_worker

    given = {
        "engine": engine,
        "queue": queue,
        "max_images": max_images,
        "concurrency": concurrency,
    }
    settings = _settings(**given)  # checked here, before any process starts
    argv = [
        "worker",
        "--pool",
        "threads",
        "--concurrency",
        str(settings.concurrency),
        "--queues",
        settings.queue,
        "--loglevel",
        loglevel,
        "--task-events",
        # Stable across recycles, so Flower shows one worker going offline and online.
        "--hostname",
        hostname or f"ocrq-{settings.engine}-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
    ]
    if supervise:  # a child interpreter per worker process, its options in its environment
        raise typer.Exit(run_supervised(argv, _child_env(**given)))
    raise typer.Exit(run_worker(argv, settings))


@app.command()
def submit(
    targets: Annotated[
        list[str], typer.Argument(help="Image or document (PDF, TIFF) paths, folders or URLs.")
    ],
    task: Annotated[str, typer.Option(help=TASK_HELP)] = "text",
    wait: Annotated[bool, typer.Option("--wait", help="Wait for results and print them.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
    timeout: Annotated[float | None, typer.Option(help="Seconds to wait at most.")] = None,
) -> None:
    """Enqueue one job per image; print job ids, or with --wait the results."""
    from ocrq.api.client import Client, image_ref
    from ocrq.worker.embedded import expand

    settings = Settings()
    client = Client(settings)
    refs: list[str] = []
    for target in targets:
        if target.startswith(("http://", "https://")):
            refs.append(target)
        else:
            refs.extend(str(p) for p in expand([Path(target)]))
    ids = [client.submit(image_ref(t), task) for t in refs]
    if not wait:
        for job_id in ids:
            typer.echo(json.dumps({"job_id": job_id}) if as_json else job_id)
        return
    with _progress() as progress:
        bar = progress.add_task("waiting", total=len(ids))
        results = client.wait(
            ids, timeout, on_progress=lambda d, t: progress.update(bar, completed=d, total=t)
        )
    pending = 0
    for row in results:
        pending += row["status"] not in ("done", "failed", "partial")  # partial: a document
        typer.echo(
            json.dumps(row, ensure_ascii=False)
            if as_json
            else f"{row['job_id']}  {row['status']:7}  {row.get('path')}  "
            f"{(row.get('text') or row.get('error') or '').replace(chr(10), ' | ')[:80]}"
        )
    if pending:
        err.print(f"[yellow]{pending} job(s) not finished within {timeout} s")
        raise typer.Exit(3)


@app.command()
def status(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
) -> None:
    """Show jobs' status and results from the database."""
    from ocrq.api.client import Client

    rows = Client(Settings()).status(job_ids)
    if as_json:
        for row in rows:
            typer.echo(json.dumps(row, ensure_ascii=False))
        return
    table = Table("job_id", "status", "path", "text / error")
    for row in rows:
        cut = f" (truncated: {row['truncated']})" if row.get("truncated") else ""
        if row.get("document_id"):  # a document: its progress in pages
            cut += f" ({row['pages_final']}/{row['pages'] or 0} pages)"
        table.add_row(
            row["job_id"],
            row["status"] + cut,
            str(row.get("path") or ""),
            (row.get("text") or row.get("error") or "")[:60],
        )
    Console().print(table)


@app.command()
def requeue(
    older_than: Annotated[
        float, typer.Option(help="Seconds a job may stay queued before it is sent again.")
    ] = 600.0,
    stalled: Annotated[
        bool,
        typer.Option(
            "--stalled",
            help="Instead: send again the running jobs of dead workers (no heartbeat for "
            "OCRQ_STALLED_AFTER_S); a live worker's jobs are never touched.",
        ),
    ] = False,
) -> None:
    """Send again jobs still queued (never claimed) after --older-than seconds, or with
    --stalled the running jobs of workers that stopped beating."""
    from ocrq.api.client import Client

    client = Client(Settings())
    if stalled:
        sent = client.requeue_stalled()
        err.print(f"re-sent {len(sent)} stalled job(s)")
    else:
        sent = client.requeue(older_than)
        err.print(f"re-sent {len(sent)} queued job(s)")
    for job_id in sent:
        typer.echo(job_id)


@app.command()
def migrate() -> None:
    """Create the database if missing and apply every Alembic revision."""
    from ocrq.core.migrate import upgrade

    url = Settings().database_url
    upgrade(url)
    err.print(f"database at {url.split('@')[-1]} is at the latest revision")


@app.command()
def tune(
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    budget: Annotated[
        float | None, typer.Option(help="GiB the engine may use in all, fixed part included.")
    ] = None,
    budget_fraction: Annotated[
        float | None,
        typer.Option(help="Share of the device's memory (host memory for rapid); default 0.8."),
    ] = None,
    max_seconds: Annotated[float, typer.Option(help="Time for all probes together.")] = 90.0,
    max_batch: Annotated[
        int | None, typer.Option(help="Largest batch probed (default OCRQ_MAX_BATCH).")
    ] = None,
    profile_dir: Annotated[
        Path | None, typer.Option(help="Where profiles go (default OCRQ_PROFILE_DIR).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Logging level on stderr.")] = "WARNING",
) -> None:
    """Probe the device with real batches, fit the memory cost model, write the profile that
    workers load at start (plus a PNG of throughput and peak memory against batch size)."""
    from ocrq.worker.tune import BudgetError, fit_summary, table, tune_engine

    _logging(log_level)
    try:  # checked before minutes of probing, not after
        import matplotlib  # noqa: F401
    except ImportError:
        err.print("ocrq tune draws its plot with matplotlib: pip install 'ocrq[tune]'")
        raise typer.Exit(2) from None
    settings = _settings(engine=engine, profile_dir=profile_dir, max_batch=max_batch)
    try:
        outcome = tune_engine(
            settings, budget, budget_fraction, max_seconds=max_seconds, say=err.print
        )
    except BudgetError as exc:
        raise typer.BadParameter(str(exc)) from exc
    assert outcome.report.fit is not None
    Console(width=140).print(table(outcome.report, f"ocrq tune: {settings.engine}"))
    typer.echo(fit_summary(outcome.report.fit))
    typer.echo(f"profile: {outcome.profile}")
    typer.echo(f"plot: {outcome.plot}")


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


if __name__ == "__main__":
    app()
