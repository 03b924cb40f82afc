"""The operator's commands over the store and the broker: requeue, export, prune, migrate."""

from __future__ import annotations

import datetime as dt
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from ocrq.cli.app import (
    EXIT_UNKNOWN,
    EXIT_USAGE,
    app,
    duration_s,
    err,
    load_settings,
    progress_bar,
    since_time,
)

if TYPE_CHECKING:
    from ocrq.core.requeue import StalledRequeue


@app.command()
def requeue(
    older_than: Annotated[
        str,
        typer.Option(
            help="How long a job may stay queued before it is sent again: 90s, 10m, 2h (a bare "
            "number is seconds)."
        ),
    ] = "10m",
    stalled: Annotated[
        bool,
        typer.Option(
            "--stalled",
            help="Instead: send again the jobs of dead workers (no heartbeat for "
            "OCRQ_STALLED_AFTER_S), running or taken but not started; a live worker's jobs are "
            "never touched.",
        ),
    ] = False,
) -> None:
    """Send again jobs still queued (never claimed) after --older-than whose message
    Redis no longer holds, or with --stalled the jobs of workers that stopped beating. Workers
    do both by themselves (docs/faults.md); this is for when none is running."""
    from ocrq.api.client import Client

    older_than_s = duration_s(older_than, "--older-than", bare_seconds=True)
    settings = load_settings()
    client = Client(settings)
    if stalled:
        done = client.requeue_stalled()
        for line in _stalled_report(done, settings.stalled_after_s):
            err.print(line, soft_wrap=True, highlight=False)
        sent = done.to_run
    else:
        sent = client.requeue(older_than_s)
        err.print(f"re-sent {len(sent)} queued job(s)")
    for job_id in sent:
        typer.echo(job_id)


def _stalled_report(done: StalledRequeue, after_s: float) -> list[str]:
    """`requeue --stalled`'s lines, one per kind: a single count once added the put-back
    messages of jobs already done to the jobs re-sent, and said nothing of the jobs it left to
    workers not yet silent long enough to count as dead."""
    lines = [f"re-sent {len(done.stalled)} running job(s) of dead workers"]
    if done.put_back:
        final = f" ({len(done.final)} of them of jobs already final: dropped when taken)"
        lines.append(
            f"put back {len(done.put_back)} message(s) dead workers held"
            + (final if done.final else "")
        )
    if done.running_heard:
        lines.append(
            f"{done.running_heard} running job(s) belong to workers heard from less than "
            f"{after_s:g} s ago (OCRQ_STALLED_AFTER_S): alive, or dead too recently to tell; "
            "if they are dead, run again later"
        )
    if done.running_unrecorded:
        lines.append(
            f"{done.running_unrecorded} running job(s) name a worker with no heartbeat on "
            "record: left to the broker's visibility timeout"
        )
    return lines


@app.command()
def export(
    out: Annotated[
        Path,
        typer.Option(
            help="File to write (jsonl, csv, parquet); a folder for md; - for standard output "
            "(jsonl, csv)."
        ),
    ],
    batch: Annotated[str | None, typer.Option(help="This batch's jobs.")] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Jobs created at most this long ago (30m, 2h, 1d) or since an ISO time."),
    ] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            help="jsonl | csv | parquet (pip install 'ocrq[parquet]') | md (one file per "
            "document, pages in order, and per image).",
        ),
    ] = "jsonl",
) -> None:
    """Write results out, streamed from PostgreSQL, with a progress bar: one record per image
    and per document page (documents' pages together, in order)."""
    from ocrq.core import export as exporting
    from ocrq.core.db import engine_for

    if fmt == "parquet" and (missing := exporting.parquet_missing()):
        raise typer.BadParameter(missing, param_hint="--format")
    if fmt not in exporting.FORMATS:
        raise typer.BadParameter(
            f"one of {', '.join(exporting.FORMATS)}", param_hint="--format"
        )
    if batch is None and since is None:
        raise typer.BadParameter("name --batch or --since (or both)")
    to_stdout = out == exporting.STDOUT
    if to_stdout and fmt in ("md", "parquet"):
        raise typer.BadParameter(
            f"{fmt} is written to a {'folder' if fmt == 'md' else 'file'}, not to standard output",
            param_hint="--out",
        )
    if fmt != "md" and not to_stdout and out.is_dir():
        raise typer.BadParameter(
            f"{out} is a folder; {fmt} is written to a file", param_hint="--out"
        )
    created_after = since_time(since) if since else None
    engine = engine_for(load_settings())
    total = exporting.count(engine, batch, created_after)
    if batch is not None and not total and not exporting.count(engine, batch, None):
        err.print(f"[red]no job names batch {escape(batch)}[/]", soft_wrap=True)  # as `ocrq wait`
        raise typer.Exit(EXIT_UNKNOWN)
    stream = sys.stdout  # before the bar, which swaps sys.stdout while it runs on a terminal
    if to_stdout and hasattr(stream, "reconfigure"):
        stream.reconfigure(encoding="utf-8", newline="")  # as the files are written
    with progress_bar() as progress:
        bar = progress.add_task("export", total=total)
        try:
            written = exporting.write(
                exporting.rows(engine, batch, created_after),
                fmt,
                out,
                advance=lambda n: progress.advance(bar, n),
                stream=stream,
            )
        except BrokenPipeError:  # `--out - | head`: the reader has what it wanted
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, stream.fileno())  # Python's flush at exit then writes nowhere
            os.close(devnull)
            return
    skipped = f", {written.skipped} not done (no file)" if written.skipped else ""
    files = f" in {written.files} file(s)" if fmt == "md" else ""
    where = "standard output" if to_stdout else str(out)
    err.print(f"exported {written.records} record(s){files}{skipped} to {where}", soft_wrap=True)


def older_than_cutoff(value: str, now: dt.datetime | None = None) -> dt.datetime:
    """`--older-than`: a duration (90s, 30m, 2h, 30d, 1w) back from now."""
    now = now or dt.datetime.now(dt.UTC)
    return now - dt.timedelta(seconds=duration_s(value, "--older-than"))


# The shortest --older-than `ocrq prune` takes without --yes: `--older-than 0s` (meant as a
# dry look, or a typo for 0d... 30d) deleted every finished job at once, with no way back.
PRUNE_UNASKED_S = 3600


@app.command()
def prune(
    older_than: Annotated[
        str, typer.Option(help="Delete what finished longer ago than this (30d, 12h, 1w).")
    ],
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Print what would be deleted, and delete nothing."),
    ] = False,
    yes: Annotated[
        bool,
        typer.Option("--yes", help="Take an --older-than shorter than one hour (refused else)."),
    ] = False,
) -> None:
    """Delete final job rows (done, failed, cancelled, expired), finished documents and
    uploads no row names, older than --older-than; nothing queued or running is touched.
    An --older-than under one hour needs --yes; --dry-run counts without deleting.
    OCRQ_RETENTION_DAYS has workers do the same daily (docs/operations.md, Retention)."""
    from ocrq.core.db import engine_for
    from ocrq.core.retention import prune as prune_rows
    from ocrq.core.retention import queued_in_broker

    now = dt.datetime.now(dt.UTC)
    cutoff = older_than_cutoff(older_than, now)
    if not dry_run and not yes and now - cutoff < dt.timedelta(seconds=PRUNE_UNASKED_S):
        err.print(
            f"[red]ocrq prune:[/] --older-than {escape(older_than.strip())} is under one hour: it "
            "deletes jobs that finished moments ago, results not yet fetched included. Check "
            "with --dry-run, then add --yes to delete",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(EXIT_USAGE)
    settings = load_settings()
    pruned = prune_rows(
        engine_for(settings),
        cutoff,
        settings.upload_dir,
        dry_run=dry_run,
        still_queued=queued_in_broker(settings),
    )
    hooks = f", {pruned.batch_hooks} unsent batch webhook(s)" if pruned.batch_hooks else ""
    verb = "would delete" if dry_run else "deleted"
    err.print(
        f"{verb} {pruned.jobs} job(s), {pruned.documents} document(s) and {pruned.uploads} "
        f"upload(s) finished before {cutoff.isoformat(timespec='seconds')}{hooks}"
        + (" (dry run: nothing deleted)" if dry_run else "")
    )
    if pruned.uploads_left:
        err.print(f"[yellow]{escape(pruned.uploads_left)}", soft_wrap=True)


@app.command()
def migrate() -> None:
    """Create the database if missing and apply every Alembic revision."""
    from ocrq.core.migrate import upgrade

    url = load_settings().database_url
    upgrade(url)
    err.print(f"database at {url.split('@')[-1]} is at the latest revision")

