"""What `ocrq status`, `ocrq submit --wait` and the api show for a job that is a document.

A document is submitted as one job (its id is the document's id); the worker finds it is a
document and splits it into page jobs. From then on the job's row says so (`document_id` is
its own id) and readers show the document instead: its status (done, partial or failed only
when every page is final), its pages, and progress counted in pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ocrq.core.documents_store import FINAL as DOCUMENT_FINAL
from ocrq.core.documents_store import DocumentStore
from ocrq.core.store import full_view

JOB_FINAL = ("done", "failed", "cancelled", "expired")


def is_document(row: dict[str, Any]) -> bool:
    """The splitting job of a document: its row names itself as the document."""
    return row.get("document_id") == row["id"] and row.get("page") is None


def views(
    docs: DocumentStore, rows: dict[str, dict[str, Any]], shown: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """`shown` (job id -> public view) with each document's job replaced by its document."""
    out = dict(shown)
    for job_id, row in rows.items():
        if is_document(row):
            view = docs.view(job_id, own_row=row)
            if view is not None:
                out[job_id] = view
    return out


def listed(docs: DocumentStore, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows as a listing shows them: each job's full view, a document's own job with its
    document's status, text, error and page counts. Listed as the bare job row, a document read
    `done (0/0 pages)`: its job is done once it is split, and the pages are not in that row."""
    summaries = docs.summaries([r["id"] for r in rows if is_document(r)])
    return [{**full_view(r), **summaries.get(r["id"], {})} for r in rows]


def progress(
    docs: DocumentStore, ids: Sequence[str], rows: dict[str, dict[str, Any]]
) -> tuple[int, int, int]:
    """(finished units, all units, finished jobs): a document counts as its pages, an image
    (or a document not split yet) as one. A document whose pages are all final but which is
    not assembled yet (its last page's worker died in between) is completed here."""
    documents = docs.progress([j for j, r in rows.items() if is_document(r)])
    units = total = finished = 0
    for job_id in ids:
        if job_id in documents:
            pages_final, pages, status = documents[job_id]
            if status not in DOCUMENT_FINAL and pages and pages_final >= pages:
                status = docs.complete(job_id) or status
            done = status in DOCUMENT_FINAL
            if pages:
                units += pages_final
                total += pages
            else:  # refused whole before its pages were counted
                units += done
                total += 1
            finished += done
        else:
            row = rows.get(job_id)
            done = row is not None and row["status"] in JOB_FINAL and not is_document(row)
            units += done
            total += 1
            finished += done
    return units, total, finished
