"""The `ocrq` command. Each command parses options, builds Settings, and calls one function."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ocrq.core.contract import MAX_NEW_TOKENS_LIMIT, PRIORITIES, TASKS, queue_for
from ocrq.core.process import STATE, setup_process
from ocrq.core.settings import Settings, warn_unknown_variables
from ocrq.models.registry import ENGINES

if TYPE_CHECKING:
    from ocrq.core.requeue import StalledRequeue
    from ocrq.worker.embedded import Inputs

# Exit codes scripts can rely on; `ocrq --help` shows them (EPILOG), docs/operations.md too.
EXIT_FAILED = 1  # at least one job failed
EXIT_USAGE = 2  # a bad option or argument (click's own code)
EXIT_PENDING = 3  # --timeout passed with jobs still queued or running
EXIT_UNKNOWN = 4  # a job id has no row
# Why a name a producer sent may have no row yet (said wherever one is looked up and missing).
NO_ROW_YET = (
    "`ocrq submit`, the api and ocrq.client write a job's row before sending it; a job sent "
    "straight to Celery (`send_task`) gets its row when a worker takes it, so it is unknown "
    "here until then (wait on its Celery result meanwhile: `AsyncResult(id).get()`)"
)
EXIT_DATABASE = 5  # PostgreSQL unreachable, the database missing or not migrated
EXIT_BROKER = 6  # the broker (Redis) unreachable
EXIT_UNAVAILABLE = 69  # `ocrq api`: its address cannot be bound (EX_UNAVAILABLE; uvicorn's 3
# would have read as EXIT_PENDING)
EXIT_CONFIG = 78  # invalid settings, e.g. an unknown engine (EX_CONFIG; also `ocrq worker`'s)
# What `ocrq --help` says first: the two ways to use ocrq (the module's docstring is for its
# readers, and was the help's first line until stop 48).
HELP = (
    "OCR at volume. `ocrq run` OCRs files in this process (no Redis, no PostgreSQL); "
    "`ocrq worker` consumes jobs that `ocrq submit`, `ocrq api` or another app's Celery "
    "`send_task` put into Redis and stores each result in PostgreSQL, read back with "
    "`ocrq status`, `wait` or `export`. Settings come from OCRQ_* variables (docs/settings.md)."
)
EPILOG = (
    "Exit codes: 0 ok; 1 a job failed; 2 bad usage; 3 jobs still pending at --timeout; "
    "4 unknown job id; 5 database unreachable, missing or not migrated; 6 broker unreachable; "
    "69 `ocrq api` cannot listen (its port taken); "
    "78 invalid settings (an unknown engine, a bad OCRQ_* value); 75 a worker process's "
    "recycle (its supervisor starts the next)."
)


class ConfigProblem(Exception):
    """A setting that cannot work (an unknown engine name): one line, EXIT_CONFIG."""


class _App(typer.Typer):
    """The `ocrq` Typer app, with infrastructure failures turned into one line and an exit code
    of their own: a 460-line traceback ending in exit code 1 (a failed job's) told a user
    neither what was wrong nor what to do, and told a script the wrong thing."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except Exception as exc:
            from ocrq.core.problems import infrastructure_problem

            problem = infrastructure_problem(exc)
            if problem is None:
                raise
            code = {"database": EXIT_DATABASE, "broker": EXIT_BROKER, "config": EXIT_CONFIG}
            err.print(f"[red]ocrq:[/] {problem.message}", soft_wrap=True, highlight=False)
            sys.exit(code[problem.kind])


def _hide_flag_types() -> None:
    """Typer 0.29's help prints `<bool>` beside every flag (`--json <bool>`), which reads as if
    the flag took a value: `--json true` then fails on an unexpected argument. Flags show no
    type; options that take a value keep theirs (`<str>`, `<path>`)."""
    option = getattr(getattr(typer, "core", None), "TyperOption", None)
    shown = getattr(option, "display_type_rich", None)
    if shown is None or getattr(shown, "ocrq_flags_hidden", False):
        return

    def display_type_rich(self: Any, ctx: Any) -> str | None:
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich.ocrq_flags_hidden = True  # type: ignore[attr-defined]
    option.display_type_rich = display_type_rich


_hide_flag_types()
app = _App(
    add_completion=False,
    no_args_is_help=True,
    help=HELP,
    epilog=EPILOG,
    rich_markup_mode="markdown",
)
err = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        import ocrq

        typer.echo(f"ocrq {ocrq.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """OCR images through Celery into PostgreSQL, batched to a measured memory budget."""

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


def _consumer_check(client: Any, queues: list[str]) -> Any:
    """A wait's callback that prints, once, the warning when no live worker consumes the jobs'
    queue (ocrq/api/consumers.py)."""
    from ocrq.api.consumers import ConsumerCheck

    check = ConsumerCheck(client.app, client.settings.broker_url, queues)

    def on_finished(finished: int) -> None:
        warning = check(finished)
        if warning:
            err.print(f"[yellow]ocrq:[/] {escape(warning)}", soft_wrap=True, highlight=False)

    return on_finished


def _db_url(db: str) -> str:
    """`ocrq run --db`: a URL as given; a plain path (`--db rows.sqlite`, the natural first
    try, which SQLAlchemy refused with a traceback) as the SQLite file it names."""
    if "://" in db:
        return db
    return f"sqlite:///{Path(db).expanduser().resolve()}"


def _settings(**overrides: object) -> Settings:
    """Settings from OCRQ_* and the options given; an unknown engine is refused here, before
    any model, broker or database is touched."""
    warn_unknown_variables(os.environ)  # a misspelt OCRQ_* variable would be ignored silently
    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    if settings.engine not in ENGINES:
        raise ConfigProblem(
            f"unknown engine {settings.engine!r} (--engine / OCRQ_ENGINE): choose one of "
            f"{', '.join(ENGINES)}"
        )
    return settings


def _logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# Final statuses other than done: each makes `submit --wait` and `status` exit 1. partial: a
# document some of whose pages failed; cancelled and expired: never run (or not stored).
NOT_DONE = ("failed", "partial", "cancelled", "expired")


def _summary(counts: dict[str, int], total: int, seconds: float, unit: str = "") -> str:
    """The last line of `run`, `submit --wait` and `wait`, on stderr. `unit` names what was
    counted where documents are among them: `submit` counts a document once, as it was sent,
    while `wait BATCH` counts its pages, as its progress bar does."""
    parts = [f"done: {counts.get('done', 0)}", f"failed: {counts.get('failed', 0)}"]
    parts += [f"{s}: {counts[s]}" for s in NOT_DONE[1:] if counts.get(s)]
    pending = total - counts.get("done", 0) - sum(counts.get(s, 0) for s in NOT_DONE)
    if pending:
        parts.append(f"not finished: {pending}")
    return ", ".join(parts) + f", total: {total}{' ' + unit if unit else ''} in {seconds:.1f} s"


def _unit(pages: bool, documents: bool) -> str:
    """`_summary`'s unit: a batch's documents count by their pages, a document sent or named
    by its id once; "" where only images were counted."""
    return {
        (True, False): "images and pages",
        (False, True): "images and documents",
        (True, True): "images, pages and documents",
    }.get((pages, documents), "")


def _found_inputs(command: str, looked: list[str], found: int, inputs: Inputs) -> None:
    """Say on stderr what the folders held that is not OCR'd (and any folder that could not be
    listed); finding nothing at all is a usage error naming where it looked (it was `total: 0`
    and exit 0, not a word said)."""
    from ocrq.worker.embedded import IMAGE_SUFFIXES

    skipped = sum(inputs.skipped.values())
    suffixes = sorted(inputs.skipped)
    shown = ", ".join(suffixes[:8]) + (", ..." if len(suffixes) > 8 else "")
    what = f"{skipped} file(s) skipped as not images or PDFs" + (
        f" (suffixes: {shown})" if skipped else ""
    )
    if inputs.unreadable:
        what += f"; {inputs.unreadable} folder(s) beneath could not be read (permissions?)"
    if not found:
        err.print(
            f"[red]ocrq {command}:[/] no image or PDF found in {escape(', '.join(looked))} "
            f"(folders are searched with their subfolders, hidden ones left out); {what}; "
            f"accepted: {', '.join(sorted(IMAGE_SUFFIXES))}",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(EXIT_USAGE)
    if skipped or inputs.unreadable:
        err.print(f"[yellow]ocrq {command}:[/] {what}", soft_wrap=True, highlight=False)


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

    _logging(log_level)
    settings = _settings(engine=engine)
    refusal = task_refusal(settings.engine, task)
    if refusal:  # said before the engine loads, not once per image after
        err.print(
            f"[red]ocrq run: --task {escape(repr(task))}:[/] {escape(refusal)}",
            soft_wrap=True,
            highlight=False,
        )
        raise typer.Exit(EXIT_USAGE)
    found = find_inputs(paths)
    _found_inputs("run", [str(p) for p in paths], len(found.files), found)
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
        with tempfile.TemporaryDirectory(prefix="ocrq-run-") as scratch, _progress() as progress:
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

            db_url = _db_url(db) if db else f"sqlite:///{Path(scratch) / 'run.sqlite'}"
            counts = run_paths(
                found.files, settings, db_url, emit, task=task, on_progress=advance,
                roots=found.roots,
            )
    finally:
        if output:
            out.close()
    err.print(_summary(counts, total, time.monotonic() - started))
    if output:
        err.print(f"results: {output}", soft_wrap=True, highlight=False)
    if any(counts.get(k, 0) for k in NOT_DONE):  # as `submit --wait`
        raise typer.Exit(EXIT_FAILED)


def worker_queues(settings: Settings) -> str:
    """`--queues`: the configured queue, and Celery's default one where a producer's
    `send_task` without `queue=` lands (OCRQ_CONSUME_DEFAULT_QUEUE)."""
    from ocrq.worker.queue_depth import consumed_queues

    return ",".join(consumed_queues(settings))


@app.command()
def worker(
    engine: Annotated[str | None, typer.Option(help=ENGINE_HELP)] = None,
    concurrency: Annotated[
        int | None, typer.Option(help="Task threads: images fetched + waiting for the batcher.")
    ] = None,
    queue: Annotated[str | None, typer.Option(help="Queue to consume.")] = None,
    max_images: Annotated[
        int | None,
        typer.Option(
            help="Recycle the worker process after at least this many images (the jobs in "
            "flight finish first)."
        ),
    ] = None,
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    gpus: Annotated[
        str | None,
        typer.Option(
            help="all | 0,1,...: one worker process per GPU (nvidia-smi's indices), each "
            "restarted on its own; off: one worker process, CUDA_VISIBLE_DEVICES as it is."
        ),
    ] = None,
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
    from ocrq.core.problems import infrastructure_problem
    from ocrq.worker.exit_state import STARTUP_FAILED_EXIT_CODE
    from ocrq.worker.gpus import GpuSelectionError, select
    from ocrq.worker.main import announce, log_to_stderr
    from ocrq.worker.main import run as run_worker
    from ocrq.worker.supervisor import supervise as run_supervised
    from ocrq.worker.supervisor import worker_children

    # With --no-supervise this process is the worker: the first phases of its start-up timeline
    # (ocrq/core/startup.py; ocrq/worker/main.py times the rest).
    STATE.timeline.imported()
    given = {
        "engine": engine,
        "queue": queue,
        "max_images": max_images,
        "concurrency": concurrency,
        "gpus": gpus,
    }
    try:
        with STATE.timeline.phase("settings"):
            settings = _settings(**given)  # checked here, before any process starts
    except (ValueError, ConfigProblem) as exc:
        # One line naming the variable, as every other command says it (pydantic's own text
        # names the field, `max_images`, over several lines); 78 kept, the worker's own code.
        problem = infrastructure_problem(exc)
        said = problem.message if problem else f"invalid settings: {exc}"
        err.print(f"[red]ocrq worker:[/] {escape(said)}", soft_wrap=True, highlight=False)
        raise typer.Exit(STARTUP_FAILED_EXIT_CODE) from None
    argv = [
        "worker",
        "--pool",
        "threads",
        "--queues",
        worker_queues(settings),
        "--loglevel",
        loglevel,
        "--task-events",
        "--without-gossip",
        "--without-mingle",
    ]
    if settings.concurrency is not None:  # else the worker follows its batch cap (main.py)
        argv += ["--concurrency", str(settings.concurrency)]
    # Stable across recycles, so Flower shows one worker going offline and online.
    node = hostname or f"ocrq-{settings.engine}-{os.getpid()}@%h"
    log_to_stderr()  # the worker's own lines, or the supervisor's (where it serves metrics)
    announce(settings)
    if not supervise:
        if settings.gpus:
            err.print(
                "[red]ocrq worker: --gpus/OCRQ_GPUS starts one process per GPU and needs the "
                "supervisor; under systemd or Kubernetes run one --no-supervise worker per GPU "
                "with CUDA_VISIBLE_DEVICES set",
                soft_wrap=True,
            )
            raise typer.Exit(STARTUP_FAILED_EXIT_CODE)
        raise typer.Exit(run_worker([*argv, "--hostname", node], settings))
    # A child interpreter per worker process (per GPU with --gpus), its options in its
    # environment. GPUs are found without CUDA: this process never initialises it.
    try:
        found = select(settings.gpus) if settings.gpus else []
        children = worker_children(argv, node, os.environ, given, found)
        last = (settings.metrics_port or 0) + len(children) - 1
        if settings.metrics_port is not None and last > 65_535:
            raise GpuSelectionError(
                f"OCRQ_METRICS_PORT={settings.metrics_port}: each GPU's worker is served on the "
                f"next port, and {len(children)} need ports up to {last} (> 65535)"
            )
    except GpuSelectionError as exc:
        err.print(f"[red]ocrq worker:[/] {exc}", soft_wrap=True)
        raise typer.Exit(STARTUP_FAILED_EXIT_CODE) from None
    raise typer.Exit(run_supervised(children, settings))


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
    settings = _settings()
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
    _found_inputs("submit", targets, len(refs), Inputs([], skipped, unreadable))
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
    check = _consumer_check(client, [queue_for(priority, settings.queue)])
    with _progress() as progress:
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
    err.print(_summary(counts, len(ids), time.monotonic() - started, _unit(False, documents)))
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

    rows = Client(_settings()).status(job_ids)
    _print_rows(rows, as_json, detail=len(rows) == 1 and rows[0]["status"] != "unknown")
    if any(r["status"] == "unknown" for r in rows):
        unknown = [r["job_id"] for r in rows if r["status"] == "unknown"]
        err.print(f"[yellow]unknown job id(s):[/] {', '.join(unknown)}")
        err.print(NO_ROW_YET, soft_wrap=True, markup=False)
        raise typer.Exit(EXIT_UNKNOWN)
    if any(r["status"] in NOT_DONE for r in rows):
        raise typer.Exit(EXIT_FAILED)


JOBS_PAGE_MAX = 10_000  # rows per page of `ocrq jobs`; --all pages on past it
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration_s(value: str, option: str, *, bare_seconds: bool = False) -> float:
    """A duration option (90s, 30m, 2h, 7d, 1w) in seconds: every command spells durations
    alike. `bare_seconds`: a plain number is seconds too (`requeue --older-than 600` was its
    only spelling once); `prune` refuses one, where `30` could as well mean days."""
    match = _DURATION.match(value)
    if match:
        return float(match[1]) * _SECONDS[match[2]]
    if bare_seconds:
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if seconds >= 0:
            return seconds
    raise typer.BadParameter("a duration such as 90s, 30m, 12h, 30d or 1w", param_hint=option)


def since_time(value: str, now: dt.datetime | None = None) -> dt.datetime:
    """`--since`: a duration back from now (90s, 30m, 2h, 7d, 1w) or an ISO time (UTC if it
    names no zone)."""
    now = now or dt.datetime.now(dt.UTC)
    match = _DURATION.match(value)
    if match:
        return now - dt.timedelta(seconds=float(match[1]) * _SECONDS[match[2]])
    try:
        stamp = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter("a duration (30m, 2h, 7d) or an ISO time") from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)


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
    client = Client(_settings())
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
    settings = _settings()
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

    client = Client(_settings())
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
    check = _consumer_check(client, [queue_for(p, client.settings.queue) for p in PRIORITIES])
    with _progress() as progress:
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
    unit = _unit(pages, documents)
    err.print(_summary(counts, sum(counts.values()), time.monotonic() - started, unit))
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
    client = Client(_settings())
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
    engine = engine_for(_settings())
    total = exporting.count(engine, batch, created_after)
    if batch is not None and not total and not exporting.count(engine, batch, None):
        err.print(f"[red]no job names batch {escape(batch)}[/]", soft_wrap=True)  # as `ocrq wait`
        raise typer.Exit(EXIT_UNKNOWN)
    stream = sys.stdout  # before the bar, which swaps sys.stdout while it runs on a terminal
    if to_stdout and hasattr(stream, "reconfigure"):
        stream.reconfigure(encoding="utf-8", newline="")  # as the files are written
    with _progress() as progress:
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
    client = Client(_settings())
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
    settings = _settings()
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

    url = _settings().database_url
    upgrade(url)
    err.print(f"database at {url.split('@')[-1]} is at the latest revision")


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

    _logging(log_level)
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
    settings = _settings(engine=engine, profile_dir=profile_dir, max_batch=max_batch)
    setup_process(settings)  # before the engine loads: it measures the allocator's memory
    if images:
        _tune_images(settings, images, task, sample_size, knee, headroom, budget,
                     budget_fraction, max_seconds)
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
) -> None:
    """`ocrq tune --images`: the sweep with a progress bar, then the tables and the lines to
    paste; a sample or sweep that cannot support a recommendation exits 2 saying why."""
    from ocrq.tuning.anatomy import anatomy_table
    from ocrq.tuning.images import sweep_table, tune_images
    from ocrq.tuning.sample import SampleProblem
    from ocrq.tuning.sweep import SweepProblem
    from ocrq.tuning.tune import BudgetError, fit_summary

    try:
        with _progress() as progress:
            bar = progress.add_task(f"sweep ({settings.engine})", total=None)
            outcome = tune_images(
                settings, paths, task=task, budget_gib=budget, budget_fraction=budget_fraction,
                max_seconds=max_seconds, sample_size=sample_size, fraction=knee,
                headroom=headroom, say=err.print,
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


@app.command()
def api(
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface.")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int,
        typer.Option(
            help="Port. 8080 here because `vllm serve` takes 8000 on a host that runs both; the "
            "containers of docker-compose.yml and deploy/k8s have their own and serve on 8000."
        ),
    ] = 8080,
    log_level: Annotated[str, typer.Option(help="uvicorn's log level.")] = "info",
) -> None:
    """Serve the HTTP api (extra `api`): submit, look up and wait for jobs over HTTP.

    The same app as `uvicorn ocrq.api.http:app`; it needs OCRQ_API_TOKEN (or
    OCRQ_API_ALLOW_NO_AUTH=true behind an authenticating proxy). Bound to a loopback address,
    its /docs page opens in a browser without the token (only this machine can reach it) unless
    OCRQ_API_DOCS says otherwise; the api itself still needs the token. /view/JOB_ID shows a
    job's lines drawn over its image (the page asks for the token)."""
    import ipaddress
    import os

    try:
        import uvicorn
    except ImportError:
        err.print("the api needs its extra: pip install 'ocrq[api]'", markup=False)
        raise typer.Exit(78) from None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    public_docs = loopback and "OCRQ_API_DOCS" not in os.environ
    if public_docs:
        os.environ["OCRQ_API_DOCS"] = "public"  # before the app module reads its settings
    from ocrq.api.http import auth_problem

    problem = auth_problem(_settings())
    if problem is not None:  # the app would refuse it at start-up, in a uvicorn traceback
        err.print(f"[red]ocrq api cannot start:[/] {problem}", soft_wrap=True)
        raise typer.Exit(EXIT_CONFIG)
    if public_docs:
        err.print(f"api docs: http://{host}:{port}/docs (open on loopback; OCRQ_API_DOCS=token "
                  "puts them behind the token)")
    refused = _cannot_listen(host, port)
    if refused is not None:
        err.print(f"[red]ocrq api cannot start:[/] {refused}", soft_wrap=True, highlight=False)
        raise typer.Exit(EXIT_UNAVAILABLE)
    err.print(f"results viewer: http://{host}:{port}/view/JOB_ID#token=... (docs/api.md#viewer)")
    try:
        uvicorn.run("ocrq.api.http:app", host=host, port=port, log_level=log_level)
    except SystemExit as exc:
        # uvicorn's start-up failure is exit 3, which ocrq's scripts read as "jobs pending"
        # (a port taken between the look above and the bind, the app's lifespan failing).
        if exc.code == 3:
            raise typer.Exit(EXIT_UNAVAILABLE) from None
        raise


def _cannot_listen(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (the port taken, the address not this host's),
    or None. Asked before uvicorn starts: its own answer is a log line and exit 3."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve --host {host}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            hint = " (another `ocrq api`? pick one with --port)" if taken else ""
            return f"cannot listen on {host}:{port}: {exc.strerror}{hint}"
    return None


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



@app.command()
def health(
    live: Annotated[
        bool, typer.Option("--live", help="Liveness (/healthz) instead of readiness (/readyz).")
    ] = False,
    url: Annotated[
        str | None,
        typer.Option(help="Worker monitor base URL; default http://127.0.0.1:OCRQ_METRICS_PORT."),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the answer.")] = 5.0,
) -> None:
    """Probe a worker: exit 0 when ready (or live, with --live), 1 when not, 2 if unreachable.

    For Docker HEALTHCHECK and exec probes, where no curl is installed."""
    import httpx

    if url is None:
        port = _settings().metrics_port
        if port is None:
            err.print("OCRQ_METRICS_PORT is not set: the worker serves no health endpoints")
            raise typer.Exit(2)
        url = f"http://127.0.0.1:{port}"
    path = "/healthz" if live else "/readyz"
    try:
        answer = httpx.get(url.rstrip("/") + path, timeout=timeout)
    except httpx.HTTPError as exc:
        err.print(f"{url}{path}: {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    typer.echo(answer.text.strip())
    raise typer.Exit(0 if answer.status_code == 200 else 1)


if __name__ == "__main__":
    app()
