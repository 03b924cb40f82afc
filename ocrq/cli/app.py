"""The `ocrq` command's frame: the Typer app, the exit codes scripts rely on, and the helpers
every group of commands shares (settings, progress bars, durations, the summary line). Each
group is a module beside this one; ocrq/cli/__init__.py registers them in `--help`'s order."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ocrq.core.contract import TASKS
from ocrq.core.settings import Settings, warn_unknown_variables
from ocrq.models.registry import ENGINES

if TYPE_CHECKING:
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


def progress_bar() -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
    )


def consumer_check(client: Any, queues: list[str]) -> Any:
    """A wait's callback that prints, once, the warning when no live worker consumes the jobs'
    queue (ocrq/api/consumers.py)."""
    from ocrq.api.consumers import ConsumerCheck

    check = ConsumerCheck(client.app, client.settings.broker_url, queues)

    def on_finished(finished: int) -> None:
        warning = check(finished)
        if warning:
            err.print(f"[yellow]ocrq:[/] {escape(warning)}", soft_wrap=True, highlight=False)

    return on_finished


def db_url_of(db: str) -> str:
    """`ocrq run --db`: a URL as given; a plain path (`--db rows.sqlite`, the natural first
    try, which SQLAlchemy refused with a traceback) as the SQLite file it names."""
    if "://" in db:
        return db
    return f"sqlite:///{Path(db).expanduser().resolve()}"


def load_settings(**overrides: object) -> Settings:
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


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


# Final statuses other than done: each makes `submit --wait` and `status` exit 1. partial: a
# document some of whose pages failed; cancelled and expired: never run (or not stored).
NOT_DONE = ("failed", "partial", "cancelled", "expired")


def summary_line(counts: dict[str, int], total: int, seconds: float, unit: str = "") -> str:
    """The last line of `run`, `submit --wait` and `wait`, on stderr. `unit` names what was
    counted where documents are among them: `submit` counts a document once, as it was sent,
    while `wait BATCH` counts its pages, as its progress bar does."""
    parts = [f"done: {counts.get('done', 0)}", f"failed: {counts.get('failed', 0)}"]
    parts += [f"{s}: {counts[s]}" for s in NOT_DONE[1:] if counts.get(s)]
    pending = total - counts.get("done", 0) - sum(counts.get(s, 0) for s in NOT_DONE)
    if pending:
        parts.append(f"not finished: {pending}")
    return ", ".join(parts) + f", total: {total}{' ' + unit if unit else ''} in {seconds:.1f} s"


def unit_of(pages: bool, documents: bool) -> str:
    """`summary_line`'s unit: a batch's documents count by their pages, a document sent or named
    by its id once; "" where only images were counted."""
    return {
        (True, False): "images and pages",
        (False, True): "images and documents",
        (True, True): "images, pages and documents",
    }.get((pages, documents), "")


def say_found_inputs(command: str, looked: list[str], found: int, inputs: Inputs) -> None:
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

