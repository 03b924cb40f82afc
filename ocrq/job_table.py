"""How `ocrq status` and `ocrq jobs` show jobs on a terminal: one line per job, or one job whole.

The table is an index, not the record: every cell stays on one line (rich cuts it with `…`
by display cells, so wide CJK text is measured right), the job id is always whole (it is what
a user copies), and the file column keeps the end of the file's name, where names that share a
folder and a prefix differ (`scan-2026-000123.png`). Everything else is in the detail view of
one id (`ocrq status ID`) and in `--json`. Before this, a table of five free-wrapping columns
folded paths and text to `…` at 80 columns and spread one job over ~20 lines (issue 27).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ocrq.core.contract import PAGE_MARK

JOB_ID_CHARS = 36
BLOCK_BELOW = 72  # narrower terminals get a few lines per job: an id alone takes 36 columns
CREATED_FROM = 100  # the created column only from this width on (it is in the detail and JSON)
FILE_MIN, FILE_MAX = 12, 40  # cells for the file's name, before the text gets the rest
TEXT_MIN = 8  # a text column narrower than this is left out
TEXT_ROOM = 30  # a status says in full why a text was cut only if this much text still shows
DETAIL_TEXT_LINES = 30  # the detail view's text, at most; `--json` has all of it
CUT = "*"  # after a status whose text the engine cut short (max_tokens, repetition)


def file_name(source: str | None) -> str:
    """The part of a job's source that tells it from its neighbours: the file's name (a page
    of a document keeps its `#page=N`), not the folder every job of a batch shares."""
    if not source:
        return ""
    path, mark, page = source.partition(PAGE_MARK)
    name = path.rstrip("/").rsplit("/", 1)[-1] or path
    return f"{name}{mark}{page}"


def tail(text: str, cells: int) -> str:
    """`text` in at most `cells` display cells, cut at the front: its end is what differs."""
    shown = Text(text)
    if shown.cell_len <= cells:
        return text
    if cells <= 1:
        return "…"[:cells]
    keep = Text(text[::-1])
    keep.truncate(cells - 1)
    return "…" + keep.plain[::-1]


def one_line(row: dict[str, Any]) -> str:
    """The text (or error) with its lines joined by ` | `; blank lines (between a document's
    pages) left out."""
    text = row.get("text") or row.get("error") or ""
    return " | ".join(line for line in text.split("\n") if line.strip())


def status_cell(row: dict[str, Any], short: bool = False) -> str:
    """The status, and why the text ended early when it did: in full, or (`short`, on a
    terminal too narrow for it) as a mark the legend explains."""
    cut = row.get("truncated")
    if not cut:
        return row["status"]
    return row["status"] + (CUT if short else f" (truncated: {cut})")


def pages_cell(row: dict[str, Any]) -> str:
    """`final/pages` for a document; blank for an image or one page of a document."""
    if row.get("pages") is None:
        return ""
    return f"{row.get('pages_final') or 0}/{row['pages']}"


def _utc(iso: str) -> str:
    stamp = dt.datetime.fromisoformat(iso)
    if stamp.tzinfo is not None:
        stamp = stamp.astimezone(dt.UTC)
    return f"{stamp:%Y-%m-%d %H:%M:%S} UTC"


def created_cell(row: dict[str, Any]) -> str:
    """MM-DD HH:MM:SS in UTC: the year is this year's, the date says which day."""
    created = row.get("created_at")
    return _utc(created)[5:19] if created else ""


def print_table(rows: Sequence[dict[str, Any]], console: Console) -> None:
    """One line per job: id, status, pages (documents), created (wide terminals), file, text."""
    if console.width < BLOCK_BELOW:
        print_blocks(rows, console)
        return
    for short in (False, True):  # why a text was cut in full, where that leaves the text room
        columns: list[tuple[str, list[str]]] = [
            ("job id", [r["job_id"] for r in rows]),
            ("status", [status_cell(r, short) for r in rows]),
        ]
        if any(r.get("pages") is not None for r in rows):
            columns.append(("pages", [pages_cell(r) for r in rows]))
        if console.width >= CREATED_FROM:
            columns.append(("created UTC", [created_cell(r) for r in rows]))
        gaps = 2 * len(columns)  # two spaces between columns, the file column included
        fixed = sum(max(len(title), *(len(c) for c in cells)) for title, cells in columns) + gaps
        left = console.width - fixed
        if left >= FILE_MAX + 2 + TEXT_ROOM:
            break
    names = [r.get("file_name") or file_name(r.get("path")) for r in rows]
    longest = max((Text(n).cell_len for n in names), default=0)
    share = max(FILE_MIN, min(FILE_MAX, left // 2))
    file_cells = max(len("file"), min(longest, share, left))
    text_cells = left - file_cells - 2
    table = Table(box=None, pad_edge=False, padding=(0, 1), header_style="bold")
    for title, _ in columns:
        table.add_column(title, no_wrap=True)
    table.add_column("file", no_wrap=True, width=file_cells)
    show_text = text_cells >= TEXT_MIN
    if show_text:
        title = "text / error" if text_cells >= len("text / error") else "text"
        table.add_column(title, no_wrap=True, overflow="ellipsis", width=text_cells)
    for i, row in enumerate(rows):
        cells = [c[i] for _, c in columns] + [tail(names[i], file_cells)]
        if show_text:
            cells.append(one_line(row))
        table.add_row(*cells)
    console.print(table, crop=True)
    if short:
        _legend(rows, console)


def print_blocks(rows: Sequence[dict[str, Any]], console: Console) -> None:
    """Narrow terminals: the whole id and status on one line, then file and text, each cut to
    the width."""
    width = console.width
    for row in rows:
        pages = pages_cell(row)
        status = f"{status_cell(row)}{'  ' + pages + ' pages' if pages else ''}"
        head = f"{row['job_id']}  {status}"
        shown = row.get("file_name") or file_name(row.get("path"))  # an upload's own name
        fields = [("file", shown), ("text", one_line(row))]
        if len(head) > width:
            head = row["job_id"]
            fields.insert(0, ("status", status))
        # soft_wrap: an id is never cut, even on a terminal narrower than itself
        console.print(head, highlight=False, markup=False, soft_wrap=True)
        for label, value in fields:
            if value:
                indent = f"  {label}: "
                cut = tail if label == "file" else _head  # a name's end, a text's start
                console.print(
                    indent + cut(value, max(1, width - len(indent))),
                    highlight=False,
                    markup=False,
                    crop=True,
                )


def _head(text: str, cells: int) -> str:
    shown = Text(text)
    shown.truncate(cells, overflow="ellipsis")
    return shown.plain


def _legend(rows: Sequence[dict[str, Any]], console: Console) -> None:
    if any(r.get("truncated") for r in rows):
        legend = f"{CUT} truncated (max_tokens or repetition): `ocrq status ID` says which"
        console.print(_head(legend, console.width), highlight=False, markup=False, crop=True)


DETAIL_FIELDS = (
    ("status", "status"),
    ("path", "path"),
    ("file", "file_name"),  # an upload's name on the producer's side
    ("pages", "pages"),
    ("pages failed", "pages_failed"),
    ("page", "page"),
    ("document", "document_id"),
    ("task", "task"),
    ("lane", "priority"),
    ("truncated", "truncated"),
    ("engine", "engine"),
    ("worker", "worker"),
    # The producer's `batch` (what `ocrq wait` and `/batches/` take), not the engine's
    # `batch_id`: a UUID shown as "batch" was pasted into `ocrq wait` and found nothing.
    ("batch", "batch"),
    ("engine batch", "batch_id"),
    ("attempts", "attempts"),
    ("retries", "retries"),
    ("size", None),
    ("created", "created_at"),
    ("started", "started_at"),
    ("finished", "finished_at"),
    ("error", "error"),
)


def print_detail(row: dict[str, Any], console: Console) -> None:
    """One job whole: its id on a line of its own (never cut, at any width), each field on
    its own line (long values wrap), then its text."""
    console.print(row["job_id"], style="bold", highlight=False, markup=False, soft_wrap=True)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for label, key in DETAIL_FIELDS:
        if key is None:
            value = f"{row['width']}x{row['height']}" if row.get("width") else None
        elif key == "pages":
            value = pages_cell(row) or None
        elif key.endswith("_at") and row.get(key):
            value = _utc(row[key])
        else:
            value = row.get(key)
        if value not in (None, ""):
            grid.add_row(label, Text(str(value)))
    console.print(grid)
    text = row.get("text")
    if text:
        lines = text.split("\n")
        console.print()
        console.print(Text("\n".join(lines[:DETAIL_TEXT_LINES])), overflow="fold")
        if len(lines) > DETAIL_TEXT_LINES:
            more = len(lines) - DETAIL_TEXT_LINES
            console.print(
                f"… {more} more line(s): ocrq status {row['job_id']} --json",
                highlight=False,
                markup=False,
            )
