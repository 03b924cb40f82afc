"""`ocrq export`: a batch's (or a time window's) results written out as JSONL, CSV, markdown
or Parquet; JSONL and CSV also to standard output (`--out -`), for a pipeline.

Rows are streamed from PostgreSQL through a server-side cursor (`stream_results`, `yield_per`):
an export of millions of rows holds one chunk of them in memory, never the whole result.
One record per unit of work: each image job, each page of a document, and a document's own
job only when it failed before it had pages (refused whole, or its file missing); a document's
splitting job that succeeded is plumbing and is left out.

Markdown follows what marker and olmOCR write: one `.md` file per document with its pages in
order (a failed page leaves an HTML comment saying so in its place), one per image job; jobs
that did not finish `done` get no file of their own and are counted as skipped.

Parquet comes from pyarrow, in the optional `parquet` extra (a ~55 MB wheel the service does
not otherwise need): rows are written a chunk at a time as row groups, so memory stays at one
chunk as for the other formats; `lines` is a JSON string column, as in CSV, since its boxes
have no fixed schema a table could hold.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sqlalchemy import Engine, and_, func, not_, select

from ocrq.core.contract import PAGE_MARK
from ocrq.core.db import ocr_jobs
from ocrq.core.documents_store import PAGE_SEPARATOR

FORMATS = ("jsonl", "csv", "md", "parquet")
STDOUT = Path("-")  # `--out -`: jsonl or csv to standard output
CHUNK_ROWS = 500  # rows per round trip of the server-side cursor
TICK_ROWS = 100  # the progress callback is told every this many records (and at the end)
FIELDS = (
    "job_id", "batch", "kind", "document_id", "page", "path", "file_name", "status", "task",
    "text", "error", "truncated", "attempts", "retries", "engine", "width", "height", "created_at",
    "finished_at", "lines",
)  # fmt: skip


@dataclass
class Exported:
    records: int = 0  # rows read
    files: int = 0  # files written (md), else 1
    skipped: int = 0  # md: jobs not done, so without a file


def _where(batch: str | None, since: dt.datetime | None) -> list[Any]:
    split_done = and_(
        ocr_jobs.c.document_id.is_not_distinct_from(ocr_jobs.c.id),  # NULL for images
        ocr_jobs.c.page.is_(None),
        ocr_jobs.c.status == "done",
    )
    conditions: list[Any] = [not_(split_done)]
    if batch is not None:
        conditions.append(ocr_jobs.c.batch == batch)
    if since is not None:
        conditions.append(ocr_jobs.c.created_at >= since)
    return conditions


def count(engine: Engine, batch: str | None, since: dt.datetime | None) -> int:
    with engine.connect() as conn:
        stmt = select(func.count()).select_from(ocr_jobs).where(*_where(batch, since))
        return int(conn.execute(stmt).scalar_one())


def rows(engine: Engine, batch: str | None, since: dt.datetime | None) -> Iterator[dict[str, Any]]:
    """The records, a document's pages together and in order, streamed."""
    group = func.coalesce(ocr_jobs.c.document_id, ocr_jobs.c.id)
    stmt = (
        select(ocr_jobs)
        .where(*_where(batch, since))
        .order_by(group, ocr_jobs.c.page.nulls_first(), ocr_jobs.c.id)
    )
    with engine.connect() as conn:
        result = conn.execution_options(stream_results=True, yield_per=CHUNK_ROWS).execute(stmt)
        for row in result.mappings():
            yield record(dict(row))


def record(row: dict[str, Any]) -> dict[str, Any]:
    if row.get("page") is not None:
        kind = "page"
    elif row.get("document_id") == row["id"]:
        kind = "document"
    else:
        kind = "image"
    return {
        "job_id": row["id"],
        "batch": row.get("batch"),
        "kind": kind,
        "document_id": row.get("document_id"),
        "page": row.get("page"),
        "path": row["source"],
        "file_name": row.get("file_name"),  # an upload's own name (display only)
        "status": row["status"],
        "task": row["task"],
        "text": row.get("text"),
        "error": row.get("error"),
        "truncated": row.get("truncated"),
        "attempts": row.get("attempts"),
        "retries": row.get("retries"),
        "engine": row.get("engine"),
        "width": row.get("width"),
        "height": row.get("height"),
        "created_at": _iso(row.get("created_at")),
        "finished_at": _iso(row.get("finished_at")),
        "lines": row.get("lines") or [],
    }


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _ticks(records: Iterator[dict[str, Any]], advance: Callable[[int], None]) -> Iterator[Any]:
    """`records`, telling `advance` how many went by every TICK_ROWS of them: a progress bar
    redrawn per record cost more than the writing."""
    n = 0
    for rec in records:
        yield rec
        n += 1
        if n == TICK_ROWS:
            advance(n)
            n = 0
    if n:
        advance(n)


def write(
    records: Iterator[dict[str, Any]],
    fmt: str,
    out: Path,
    advance: Callable[[int], None] = lambda n: None,
    stream: IO[str] | None = None,
) -> Exported:
    """Write `records` to `out` (a file; a folder for md; `-`: `stream`, standard output, for
    jsonl and csv, a pipeline's input); `advance(n)`: n more written. The caller takes
    `stream` before any progress bar starts: rich's live display swaps `sys.stdout` for a
    proxy that prints through its own console (stderr here) while it runs."""
    records = _ticks(records, advance)
    if fmt == "md":
        return _write_md(records, out)
    if fmt == "parquet":
        out.parent.mkdir(parents=True, exist_ok=True)  # as md makes its folder
        return _write_parquet(records, out)
    done = Exported(files=1)
    if out == STDOUT:
        return _write_text(records, fmt, stream or sys.stdout, done)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8", newline="") as fh:
        return _write_text(records, fmt, fh, done)


def _write_text(
    records: Iterator[dict[str, Any]], fmt: str, fh: IO[str], done: Exported
) -> Exported:
    if fmt == "jsonl":
        for rec in records:
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            done.records += 1
    elif fmt == "csv":
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        for rec in records:
            row = {**rec, "lines": json.dumps(rec["lines"], ensure_ascii=False)}
            writer.writerow({k: cell(v) for k, v in row.items()})
            done.records += 1
    else:
        raise ValueError(f"unknown format {fmt!r}: one of {', '.join(FORMATS)}")
    fh.flush()
    return done


# A cell a spreadsheet would run as a formula (OWASP, "CSV Injection"): OCR'd text is whatever
# the image said, and `=HYPERLINK(...)` on a receipt must reach the user as text.
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def cell(value: Any) -> Any:
    """A CSV cell that opens as text in a spreadsheet: a string that starts like a formula
    gets a leading `'` (the quote spreadsheets hide and treat as "text"); other values as
    they are. JSONL and Parquet keep the text exactly."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def parquet_missing() -> str | None:
    """Why parquet cannot be written here, or None."""
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return "parquet needs pyarrow: pip install 'ocrq[parquet]' (or export jsonl)"
    return None


def _write_parquet(records: Iterator[dict[str, Any]], out: Path) -> Exported:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ints = {"page", "attempts", "retries", "width", "height"}
    times = {"created_at", "finished_at"}
    schema = pa.schema([
        (name, pa.int64() if name in ints else pa.timestamp("us", tz="UTC") if name in times
         else pa.string())
        for name in FIELDS
    ])
    done = Exported(files=1)
    chunk: list[dict[str, Any]] = []

    def flush(writer: Any) -> None:
        columns = {name: [r[name] for r in chunk] for name in FIELDS}
        columns["lines"] = [None if v is None else json.dumps(v, ensure_ascii=False)
                            for v in columns["lines"]]
        for name in times:
            columns[name] = [None if v is None else dt.datetime.fromisoformat(v)
                             for v in columns[name]]
        writer.write_table(pa.table(columns, schema=schema))
        chunk.clear()

    with pq.ParquetWriter(out, schema) as writer:
        for rec in records:
            chunk.append(rec)
            done.records += 1
            if len(chunk) >= CHUNK_ROWS:
                flush(writer)
        if chunk or done.records == 0:
            flush(writer)
    return done


_UNSAFE = re.compile(r"[^\w.-]+")


def stem(source: str) -> str:
    """A file name from a job's source: its last path segment without extension or page
    mark, made safe (a URL's query and odd characters become `_`)."""
    base = source.partition(PAGE_MARK)[0].split("?", 1)[0].rstrip("/")
    name = base.rsplit("/", 1)[-1] or "job"
    name = name.rsplit(".", 1)[0] if "." in name[1:] else name
    return _shortened(_UNSAFE.sub("_", name)) or "job"


# Bytes of a stem: a file system's name limit is 255 bytes (NAME_MAX), and a stem gets up to
# `-<8 of the job id>.md` after it. Counted in UTF-8 bytes, not characters: 100 characters of
# CJK or Cyrillic are 200-300 bytes, and the export died with ENAMETOOLONG.
STEM_BYTES = 200


def _shortened(name: str) -> str:
    cut = name.encode("utf-8")[:STEM_BYTES]
    return cut.decode("utf-8", errors="ignore")


class _Names:
    """`<stem>.md`, or `<stem>-<job id start>.md` once a stem is taken: a batch of
    `scan.png` files in several folders must not overwrite one another."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.taken: set[str] = set()

    def new(self, source: str, job_id: str) -> Path:
        name = stem(source)
        if name in self.taken:
            name = f"{name}-{job_id[:8]}"
        self.taken.add(name)
        return self.folder / f"{name}.md"


def _write_md(records: Iterator[dict[str, Any]], folder: Path) -> Exported:
    folder.mkdir(parents=True, exist_ok=True)
    names = _Names(folder)
    done = Exported()
    document: str | None = None
    fh: IO[str] | None = None
    written_pages = 0
    try:
        for rec in records:
            done.records += 1
            if rec["kind"] == "page":
                if rec["document_id"] != document:
                    if fh is not None:
                        fh.write("\n")  # a text file ends with its newline
                        fh.close()
                    document = rec["document_id"]
                    fh = names.new(rec["path"], document or rec["job_id"]).open(
                        "w", encoding="utf-8"
                    )
                    done.files += 1
                    written_pages = 0
                assert fh is not None
                if written_pages:
                    fh.write(PAGE_SEPARATOR)
                if rec["status"] == "done":
                    fh.write(rec["text"] or "")
                else:
                    why = (rec["error"] or rec["status"]).replace("--", "- -")
                    fh.write(f"<!-- page {rec['page']} {rec['status']}: {why} -->")
                written_pages += 1
            elif rec["status"] == "done":
                text = rec["text"] or ""
                name = rec["file_name"] or rec["path"]  # an upload: its own name
                names.new(name, rec["job_id"]).write_text(text + "\n", "utf-8")
                done.files += 1
            else:
                done.skipped += 1
    finally:
        if fh is not None:
            fh.write("\n")
            fh.close()
    return done
