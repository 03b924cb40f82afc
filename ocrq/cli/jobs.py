"""The producer's commands over jobs: submit, status, jobs, wait, retry, cancel. They go through
the api's client (ocrq/api/client.py), as the HTTP api does: the row first, then the message."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from ocrq.cli.app import (
    EXIT_FAILED,
    EXIT_PENDING,
    EXIT_UNKNOWN,
    EXIT_USAGE,
    NO_ROW_YET,
    NOT_DONE,
    TASK_HELP,
    app,
    consumer_check,
    err,
    load_settings,
    progress_bar,
    say_found_inputs,
    since_time,
    summary_line,
    unit_of,
)
from ocrq.core.contract import MAX_NEW_TOKENS_LIMIT, PRIORITIES, queue_for


def _result_line(row: dict[str, Any], width: int | None) -> str:
    """`submit --wait`'s line for one result: id, status, path, the text's start. On a
    terminal (`width`) it fits the line, the path cut from its start (its file name is what
    tells images apart) and the text from its end; every row wrapped at 80 columns before.
    Piped (None), the path whole and 80 characters of text, as scripts have read it."""
    text = (row.get("text") or row.get("error") or "").replace("\n", " | ")
    path = str(row.get("path"))
    head = f"{row['job_id']}  {row['status']:7}  "
    if width is None:
        return f"{head}{path}  {text[:80]}"
    room = max(width - len(head), 24)
    name = path.rsplit("/", 1)[-1]
    keep = min(len(path), max(room // 3, min(len(name) + 1, room - 10)))
    if len(path) > keep:
        path = "…" + path[len(path) - keep + 1 :]
    left = room - len(path) - 2
    if len(text) > left:
        text = text[: max(left - 1, 0)] + "…"
    return f"{head}{path}  {text}".rstrip()


@app.command()
def submit(
    targets: Annotated[
        list[str],
        typer.Argument(
            help="Image or document (PDF, TIFF) paths or URLs, or folders: the images and PDFs "
            "anywhere beneath them, in sorted order (hidden files and folders left out)."
        ),
    ],
    task: Annotated[str, typer.Option(help=TASK_HELP)] = "text",
    wait: Annotated[bool, typer.Option("--wait", help="Wait for results and print them.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
    timeout: Annotated[float | None, typer.Option(help="Seconds to wait at most.")] = None,
    priority: Annotated[
        str,
        typer.Option(
            help="interactive: ahead of the bulk backlog (a live app's jobs); bulk: the default."
        ),
    ] = "bulk",
    batch: Annotated[
        str | None,
        typer.Option(
            help="Name the jobs' batch (`ocrq wait BATCH`, `ocrq export --batch`); "
            "default: a new UUID, printed on stderr."
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_NEW_TOKENS_LIMIT,
            help="Each job's cap on new tokens (a document: each page's), within the "
            "workers' OCRQ_MAX_NEW_TOKENS; kept when a job is sent again.",
        ),
    ] = None,
) -> None:
    """Enqueue one job per image; print job ids, or with --wait the results."""
    import uuid
    from collections import Counter

    from ocrq.api.client import Client, image_ref
    from ocrq.worker.embedded import Inputs, find_inputs

    if priority not in PRIORITIES:
        err.print(f"[red]ocrq submit: --priority must be one of {', '.join(PRIORITIES)}")
        raise typer.Exit(EXIT_USAGE)
    settings = load_settings()
    refs: list[str] = []
    skipped: Counter[str] = Counter()
    unreadable = 0
    for target in targets:
        if target.startswith(("http://", "https://")):
            refs.append(target)
        elif target.endswith(("/", os.sep)) and not Path(target).is_dir():
            # A folder by its spelling that is not there: it became one job per "file" named
            # like the folder, failing on a worker. A missing file still becomes a job (the
            # worker's host may hold it); a folder is walked here, so this host must.
            err.print(
                f"[red]ocrq submit:[/] {escape(target)} is not a folder here (a folder is "
                "searched on this host for the images to submit)",
                soft_wrap=True,
                highlight=False,
            )
            raise typer.Exit(EXIT_USAGE)
        else:
            found = find_inputs([Path(target)])
            refs.extend(str(p) for p in found.files)
            skipped.update(found.skipped)
            unreadable += found.unreadable
    # before the broker is touched
    say_found_inputs("submit", targets, len(refs), Inputs([], skipped, unreadable))
    client = Client(settings)
    batch = batch or str(uuid.uuid4())
    started = time.monotonic()
    ids = [
        client.submit(
            image_ref(t), task, priority=priority, batch=batch, max_new_tokens=max_new_tokens
        )
        for t in refs
    ]
    err.print(f"batch: {escape(batch)}", highlight=False, soft_wrap=True)
    if not wait:
        for job_id in ids:
            typer.echo(json.dumps({"job_id": job_id}) if as_json else job_id)
        return
    check = consumer_check(client, [queue_for(priority, settings.queue)])
    with progress_bar() as progress:
        bar = progress.add_task("waiting", total=len(ids))

        def on_progress(finished: int, total: int) -> None:
            progress.update(bar, completed=finished, total=total)
            check(finished)

        results = client.wait(ids, timeout, on_progress=on_progress)
    counts: dict[str, int] = {}
    width = shutil.get_terminal_size().columns if sys.stdout.isatty() else None
    for row in results:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
        typer.echo(json.dumps(row, ensure_ascii=False) if as_json else _result_line(row, width))
    documents = any("pages" in row for row in results)  # a document's row, not an image's
    err.print(summary_line(counts, len(ids), time.monotonic() - started, unit_of(False, documents)))
    # partial: a document some of whose pages failed (it is finished, and counts as failed)
    pending = len(ids) - sum(counts.get(k, 0) for k in ("done", *NOT_DONE))
    if pending:
        err.print(
            f"[yellow]{pending} job(s) not finished within {timeout} s: "
            f"`ocrq wait {escape(batch)}` goes on waiting",
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_PENDING)
    if any(counts.get(k, 0) for k in NOT_DONE):
        raise typer.Exit(EXIT_FAILED)


def _print_rows(rows: list[dict[str, Any]], as_json: bool, detail: bool = False) -> None:
    """Rows as JSON lines, one job whole (`detail`), or a table of one line per job
    (ocrq/job_table.py); a job id is always printed whole, at any width."""
    from ocrq.job_table import print_detail, print_table

    if as_json:
        for row in rows:
            typer.echo(json.dumps(row, ensure_ascii=False))
        return
    if not rows:  # a table of no rows is no table (its column widths have nothing to fit)
        return
    console = Console()
    if detail and len(rows) == 1:
        print_detail(rows[0], console)
    else:
        print_table(rows, console)


@app.command()
def status(
    job_ids: Annotated[list[str], typer.Argument(help="Job ids.")],
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
) -> None:
    """Show jobs: one id whole (every field, the text), several as a table of one line each.
    Exit code 4 when an id has no row, else 1 when a job failed, was cancelled or expired."""
    from ocrq.api.client import Client

    rows = Client(load_settings()).status(job_ids)
    _print_rows(rows, as_json, detail=len(rows) == 1 and rows[0]["status"] != "unknown")
    if any(r["status"] == "unknown" for r in rows):
        unknown = [r["job_id"] for r in rows if r["status"] == "unknown"]
        err.print(f"[yellow]unknown job id(s):[/] {', '.join(unknown)}")
        err.print(NO_ROW_YET, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_UNKNOWN)
    if any(r["status"] in NOT_DONE for r in rows):
        raise typer.Exit(EXIT_FAILED)


JOBS_PAGE_MAX = 10_000  # rows per page of `ocrq jobs`; --all pages on past it


@app.command()
def jobs(
    status: Annotated[
        list[str] | None,
        typer.Option(help="queued | running | done | failed | cancelled | expired; repeatable."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Created at most this long ago (30m, 2h, 7d) or since an ISO time."),
    ] = None,
    limit: Annotated[
        int, typer.Option(min=1, max=JOBS_PAGE_MAX, help="Rows at most (see --all).")
    ] = 20,
    batch: Annotated[str | None, typer.Option(help="Only this batch's jobs.")] = None,
    every: Annotated[
        bool,
        typer.Option(
            "--all", help="Every matching job, page after page (best with --json: streamed)."
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
) -> None:
    """List recent jobs, newest first, one line each (a document with its pages). When more
    jobs match than --limit shows, stderr says so: nothing is cut silently."""
    from ocrq.api.client import Client

    statuses = [s.strip() for item in status or () for s in item.split(",") if s.strip()]
    known = ("queued", "running", "done", "failed", "cancelled", "expired")
    bad = sorted(set(statuses) - set(known))
    if bad:
        raise typer.BadParameter(
            f"unknown status {', '.join(bad)}; one of {', '.join(known)} (comma-separated for "
            "several)",
            param_hint="--status",
        )
    created_after = since_time(since) if since else None
    client = Client(load_settings())
    after = None
    shown = 0
    while True:
        size = JOBS_PAGE_MAX if every else limit
        rows, after = client.listing(
            statuses, created_after=created_after, limit=size, after=after, batch=batch
        )
        _print_rows(rows, as_json)
        shown += len(rows)
        if after is None:
            if not shown:
                err.print("no job matches", soft_wrap=True)
            return
        if not every:
            err.print(
                f"[yellow]more jobs match than the {shown} shown:[/] page on with --all "
                "(or narrow with --since, --status, --batch)",
                soft_wrap=True,
            )
            return


@app.command("wait")
def wait_for(
    targets: Annotated[list[str], typer.Argument(help="Batch names or job ids.")],
    timeout: Annotated[float | None, typer.Option(help="Seconds to wait at most.")] = None,
    poll: Annotated[float, typer.Option(min=0.05, help="Seconds between checks.")] = 0.5,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each batch's summary and each job's row.")
    ] = False,
) -> None:
    """Wait for batches (`ocrq submit --batch`, or the name `submit` printed) or jobs to
    finish, with a progress bar: resumes a `submit --wait --timeout` that ran out.
    Exit code 3 when --timeout passes first, 4 for a name that is neither, 1 when any job
    ended other than done (failed, cancelled, expired), as `submit --wait`."""
    from ocrq.api.client import Client

    client = Client(load_settings())
    names = client.known_batches(targets)
    ids = [t for t in targets if t not in names]
    rows = {r["job_id"]: r for r in client.status(ids)} if ids else {}
    unknown = [j for j, r in rows.items() if r["status"] == "unknown"]
    if unknown:
        err.print(f"[red]neither a batch nor a job id:[/] {', '.join(unknown)}", soft_wrap=True)
        err.print(NO_ROW_YET, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_UNKNOWN)
    started = time.monotonic()
    deadline = None if timeout is None else started + timeout
    check = consumer_check(client, [queue_for(p, client.settings.queue) for p in PRIORITIES])
    with progress_bar() as progress:
        bar = progress.add_task("waiting", total=None)
        while True:
            summaries = [client.batch(name) for name in names]
            done = sum(s.finished for s in summaries if s)
            total = sum(s.total for s in summaries if s)
            final = all(s is None or s.final for s in summaries)
            if ids:
                units, units_total, jobs_final = client.progress(ids)
                done, total = done + units, total + units_total
                final = final and jobs_final == len(ids)
            etas = [s.eta_s for s in summaries if s and s.eta_s]
            eta = f" eta {max(etas):.0f} s" if etas else ""
            progress.update(bar, completed=done, total=total, description=f"waiting{eta}")
            if final or (deadline is not None and time.monotonic() > deadline):
                break
            check(done)
            time.sleep(poll)
    counts: dict[str, int] = {}
    for s in summaries:
        if s is not None:
            if as_json:
                typer.echo(json.dumps(s.as_json()))
            for status, n in s.jobs.items():
                counts[status] = counts.get(status, 0) + n
    documents = False
    for row in client.status(ids) if ids else []:
        if as_json:
            typer.echo(json.dumps(row, ensure_ascii=False))
        status = "failed" if row["status"] == "partial" else row["status"]
        counts[status] = counts.get(status, 0) + 1
        documents |= "pages" in row  # a document named by its id counts once
    pages = any(s.pages or s.documents for s in summaries if s is not None)
    unit = unit_of(pages, documents)
    err.print(summary_line(counts, sum(counts.values()), time.monotonic() - started, unit))
    if not final:
        err.print(f"[yellow]not finished within {timeout} s")
        raise typer.Exit(EXIT_PENDING)
    if any(counts.get(k, 0) for k in NOT_DONE):  # as `submit --wait`, which this resumes
        raise typer.Exit(EXIT_FAILED)


@app.command()
def retry(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Only these jobs.")] = None,
    status: Annotated[
        str, typer.Option(help="Which jobs to run again: failed (queued or running: requeue).")
    ] = "failed",
    batch: Annotated[str | None, typer.Option(help="Only this batch's jobs.")] = None,
    every: Annotated[
        bool, typer.Option("--all", help="Every failed job in the database, whatever its batch.")
    ] = False,
) -> None:
    """Run failed jobs again, as a new attempt each (the row's attempts and retries count
    it); a document with a re-run page is assembled again. Prints the re-sent job ids; says
    which named jobs were not failed. Exit code 4 for an id (or a batch) with no row, 2 when
    none of ids, --batch or --all says which."""
    from ocrq.api.client import Client

    if status != "failed":
        raise typer.BadParameter(
            "only failed jobs are run again; `ocrq requeue` re-sends queued ones and "
            "`ocrq requeue --stalled` the running jobs of dead workers",
            param_hint="--status",
        )
    client = Client(load_settings())
    if not job_ids and batch is None and not every:
        # Every failed job ever is a large act (permanent failures too: a corrupt file fails
        # again at each re-run): asked for by name, as the api asks for a filter.
        failed = client.store.count_by_status().get("failed", 0)
        err.print(
            f"[red]ocrq retry:[/] say which failed jobs to run again: job ids, --batch B, or "
            f"--all for every one ({failed} failed now)",
            soft_wrap=True,
        )
        raise typer.Exit(EXIT_USAGE)
    named = client.status(job_ids) if job_ids else []
    unknown = [r["job_id"] for r in named if r["status"] == "unknown"]
    if unknown:
        err.print(f"[red]no such job:[/] {', '.join(unknown)}", soft_wrap=True)
        raise typer.Exit(EXIT_UNKNOWN)
    if batch is not None and not client.known_batches([batch]):
        err.print(f"[red]no job names batch {escape(batch)}[/]", soft_wrap=True)
        raise typer.Exit(EXIT_UNKNOWN)
    sent = client.retry_failed(batch, job_ids or None)
    err.print(f"re-sent {len(sent)} failed job(s)")
    left = client.not_rerun(job_ids, sent, batch) if job_ids else {}
    for job_id, why in left.items():
        err.print(f"not re-sent: {job_id}: {why}", soft_wrap=True, markup=False)
    for job_id in sent:
        typer.echo(job_id)


@app.command()
def cancel(
    job_ids: Annotated[list[str] | None, typer.Argument(help="Job ids.")] = None,
    batch: Annotated[
        str | None, typer.Option(help="Cancel every job of this batch not final yet.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines output.")] = False,
) -> None:
    """Cancel jobs, or a whole --batch: a queued one never runs, a running one is dropped from
    the running loop at its next harvest (on other engines its result is not stored); its row
    says `cancelled`. Exit code 4 when an id (or the batch) has no row, else 1 when a job was
    final already (done, failed or expired: not cancelled)."""
    from ocrq.api.client import Client

    if bool(job_ids) == (batch is not None):
        why = "not both" if job_ids else "one of them"
        raise typer.BadParameter(f"give job ids or --batch, {why}", param_hint="JOB_IDS")
    client = Client(load_settings())
    if batch is not None:
        ids, found = client.cancel_batch(batch)
        if found is None:
            err.print(f"[yellow]unknown batch:[/] {escape(batch)}")
            err.print(NO_ROW_YET, soft_wrap=True, markup=False)
            raise typer.Exit(EXIT_UNKNOWN)
        if as_json:
            typer.echo(json.dumps({**found.as_json(), "cancelled": len(ids)}))
        err.print(f"cancelled {len(ids)} job(s) of batch {escape(batch)}", soft_wrap=True)
        return
    rows = client.cancel(job_ids or [])
    _print_rows(rows, as_json)
    done = sum(r["cancelled"] for r in rows)
    err.print(f"cancelled {done} of {len(rows)} job(s)")
    if any(r["status"] == "unknown" for r in rows):
        err.print(NO_ROW_YET, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_UNKNOWN)
    if any(r["status"] != "cancelled" for r in rows):
        raise typer.Exit(EXIT_FAILED)

