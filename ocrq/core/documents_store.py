"""Document rows: the only code that writes `ocr_documents` and the page rows of a document.

A document is complete when every one of its page rows is final, and that is decided from the
rows themselves, under a lock on the document's row: whichever page job stores the last page
(or a redelivery of any page, or a reader) assembles the result, and a second attempt finds the
document final and leaves it. No page counter is kept: a redelivered page would make one drift.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Engine, and_, delete, func, select, update

from ocrq.core.db import ocr_document_bytes, ocr_documents, ocr_jobs
from ocrq.core.storable import storable
from ocrq.core.store import CANCELLABLE, CANCELLED, now

# A document cancelled while it was split is final too (`cancel`): its pages made so far are
# cancelled, those not made never will be.
FINAL = ("done", "partial", "failed", "cancelled")
PAGE_JOB_FINAL = ("done", "failed", "cancelled", "expired")  # a page not done fails it
PAGE_SEPARATOR = "\n\n"  # the pages' text joined like paragraphs (markdown for `parse`)
NAMED_FAILURES = 50  # a partial document's error names at most this many failed pages


class DocumentStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        if engine.dialect.name == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        self._insert = insert

    def open(
        self,
        document_id: str,
        task: str,
        source: str,
        sha256: str,
        pages: int,
        data: bytes | None = None,
    ) -> list[int]:
        """Record a split document (and `data`, the bytes of a URL or inline document, kept
        once for its page jobs: `stored_bytes`); return the pages still to send: those with no
        row yet, or a row still queued. Idempotent: a redelivered split keeps every row.

        Page rows are made as their pages are sent (`add_pages`), not all here first: a row
        `queued` long before its message existed looked lost to the recovery sweep, which
        rebuilt it while the split sent its own copy (issue 52: hundreds of copies, and a URL
        document fetched again for each)."""
        t = now()
        with self.engine.begin() as conn:
            conn.execute(
                self._insert(ocr_documents)
                .values(
                    id=document_id,
                    status="running",
                    task=task,
                    source=source,
                    sha256=sha256,
                    pages=pages,
                    created_at=t,
                )
                .on_conflict_do_nothing(index_elements=["id"])
            )
            status = conn.execute(
                select(ocr_documents.c.status).where(ocr_documents.c.id == document_id)
            ).scalar_one()
            if data is not None and status not in FINAL:  # a late copy keeps nothing again
                conn.execute(
                    self._insert(ocr_document_bytes)
                    .values(document_id=document_id, data=data, created_at=t)
                    .on_conflict_do_nothing(index_elements=["document_id"])
                )
            conn.execute(
                update(ocr_jobs).where(ocr_jobs.c.id == document_id).values(document_id=document_id)
            )
            made = dict(
                conn.execute(
                    select(ocr_jobs.c.page, ocr_jobs.c.status).where(_pages_of(document_id))
                ).all()
            )
        if status in FINAL:  # a late copy of a finished (or cancelled) document's split
            return []
        return [n for n in range(1, pages + 1) if made.get(n, "queued") == "queued"]

    def add_pages(
        self,
        document_id: str,
        task: str,
        page_jobs: Sequence[tuple[str, int, str]],
        references: Mapping[str, dict[str, Any]] | None = None,
        batch: str | None = None,
        columns: Mapping[str, Any] | None = None,
    ) -> None:
        """Record page jobs (id, page, source) of a document as queued, just before their
        messages are sent; a row already there is kept.
        `references`: by page job id, what a re-send of the page names (ocr_jobs.reference).
        `columns`: the document's own (JobRequest.columns(): its caps, lane, batch), which
        every page row keeps, so a page re-sent from its row runs as its document asked."""
        if not page_jobs:
            return
        t = now()
        with self.engine.begin() as conn:
            conn.execute(
                self._insert(ocr_jobs)
                .values(
                    [
                        {
                            **(columns or {}),
                            "id": job_id,
                            "status": "queued",
                            "task": task,
                            "source": page_source,
                            "created_at": t,
                            "attempts": 0,
                            "document_id": document_id,
                            "page": page,
                            "reference": (references or {}).get(job_id),
                            "batch": batch,
                            "retries": 0,
                        }
                        for job_id, page, page_source in page_jobs
                    ]
                )
                .on_conflict_do_nothing(index_elements=["id"])
            )

    def stored_bytes(self, document_id: str) -> bytes | None:
        """The bytes `open` kept for a URL or inline document; None when it kept none (a path
        document) or they are gone with it (done, cancelled, pruned)."""
        with self.engine.connect() as conn:
            data = conn.execute(
                select(ocr_document_bytes.c.data).where(
                    ocr_document_bytes.c.document_id == document_id
                )
            ).scalar_one_or_none()
        return None if data is None else bytes(data)

    def cancel(self, document_id: str) -> bool:
        """A document cancelled (its own job's row, by DELETE /jobs/{id}) while it was split:
        its page rows not final are cancelled, and it is `cancelled` itself, final, with the
        pages made so far as its result. True when this call cancelled it; a document final
        already is left as it is."""
        locked = select(ocr_documents).where(ocr_documents.c.id == document_id).with_for_update()
        with self.engine.begin() as conn:
            doc = conn.execute(locked).mappings().first()
            if doc is None or doc["status"] in FINAL:
                return False
            t = now()
            conn.execute(
                update(ocr_jobs)
                .where(_pages_of(document_id), ocr_jobs.c.status.in_(CANCELLABLE))
                .values(status="cancelled", error=CANCELLED, finished_at=t)
            )
            rows = [dict(r) for r in conn.execute(_page_rows(document_id)).mappings()]
            fields = storable(
                {
                    "status": "cancelled",
                    "error": CANCELLED,
                    "result": [page_view(r) for r in rows],
                }
            )
            conn.execute(
                update(ocr_documents)
                .where(ocr_documents.c.id == document_id)
                .values(**fields, finished_at=t)
            )
            conn.execute(_forget_bytes(document_id))
            return True

    def fail(self, document_id: str, task: str, source: str, error: str, **fields: Any) -> None:
        """A document refused whole (unreadable, encrypted, no pages, too many): its row says
        why. A document already final is left as it was."""
        t = now()
        values = storable({"status": "failed", "error": error, "finished_at": t, **fields})
        stmt = self._insert(ocr_documents).values(
            id=document_id, task=task, source=source, created_at=t, **values
        )
        stmt = stmt.on_conflict_do_update(
            index_elements=["id"],
            set_=values,
            where=ocr_documents.c.status.not_in(FINAL),
        )
        with self.engine.begin() as conn:
            conn.execute(stmt)
            conn.execute(
                update(ocr_jobs).where(ocr_jobs.c.id == document_id).values(document_id=document_id)
            )

    def complete(self, document_id: str) -> str | None:
        """Assemble the document if every page row is final; returns its status when final."""
        return self.assemble(document_id)[0]

    def assemble(self, document_id: str) -> tuple[str | None, bool]:
        """`complete`, and whether this very call assembled it (its webhook is sent once).

        The document's row is locked first, so of two page jobs finishing at once one
        assembles and the other then sees it final; page rows are read after the lock, so
        the last page's committed row is seen (READ COMMITTED takes a snapshot per statement).
        """
        locked = select(ocr_documents).where(ocr_documents.c.id == document_id).with_for_update()
        with self.engine.begin() as conn:
            doc = conn.execute(locked).mappings().first()
            if doc is None:
                return None, False
            if doc["status"] in FINAL:
                return doc["status"], False
            pending = conn.execute(
                select(func.count()).where(
                    _pages_of(document_id), ocr_jobs.c.status.not_in(PAGE_JOB_FINAL)
                )
            ).scalar_one()
            stored = conn.execute(select(func.count()).where(_pages_of(document_id))).scalar_one()
            if pending or stored < (doc["pages"] or 0):
                return None, False
            rows = [dict(r) for r in conn.execute(_page_rows(document_id)).mappings()]
            fields = storable(assemble(rows))  # as all stored text (core/storable.py)
            conn.execute(
                update(ocr_documents)
                .where(ocr_documents.c.id == document_id)
                .values(**fields, finished_at=now())
            )
            if fields["status"] == "done":  # no page of it can be re-run: its bytes may go
                conn.execute(_forget_bytes(document_id))
            return str(fields["status"]), True

    def claim_notice(self, document_id: str) -> bool:
        """Whether this call takes the final document's webhook to send: True for exactly one
        call per document (the row's `notified_at` set from NULL), False for every other and
        while the document is not final."""
        stmt = (
            update(ocr_documents)
            .where(
                ocr_documents.c.id == document_id,
                ocr_documents.c.notified_at.is_(None),
                ocr_documents.c.status.in_(FINAL),
            )
            .values(notified_at=now())
        )
        with self.engine.begin() as conn:
            return conn.execute(stmt).rowcount == 1

    def get(self, document_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(ocr_documents).where(ocr_documents.c.id.in_(list(document_ids)))
            )
            return {r["id"]: dict(r) for r in rows.mappings()}

    def page_rows(self, document_id: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            return [dict(r) for r in conn.execute(_page_rows(document_id)).mappings()]

    def progress(self, document_ids: Sequence[str]) -> dict[str, tuple[int, int, str]]:
        """Per document: (final pages, pages, status): cheap enough to poll."""
        docs = self.get(document_ids)
        if not docs:
            return {}
        with self.engine.connect() as conn:
            counts = dict(
                conn.execute(
                    select(ocr_jobs.c.document_id, func.count())
                    .where(
                        ocr_jobs.c.document_id.in_(list(docs)),
                        ocr_jobs.c.page.is_not(None),
                        ocr_jobs.c.status.in_(PAGE_JOB_FINAL),
                    )
                    .group_by(ocr_jobs.c.document_id)
                ).all()
            )
        return {d: (counts.get(d, 0), row["pages"] or 0, row["status"]) for d, row in docs.items()}

    def summaries(self, document_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Per document, what a listing shows (`ocrq jobs`, `GET /jobs`): its status, text
        and error, and its pages counted (all, final, failed), without the pages' results."""
        docs = self.get(document_ids)
        if not docs:
            return {}
        with self.engine.connect() as conn:
            counted = conn.execute(
                select(ocr_jobs.c.document_id, ocr_jobs.c.status, func.count())
                .where(ocr_jobs.c.document_id.in_(list(docs)), ocr_jobs.c.page.is_not(None))
                .group_by(ocr_jobs.c.document_id, ocr_jobs.c.status)
            ).all()
        by_status: dict[str, dict[str, int]] = {d: {} for d in docs}
        for document_id, status, n in counted:
            by_status[document_id][status] = n
        return {
            d: {
                "status": doc["status"],
                "text": doc["text"],
                "error": doc["error"],
                "pages": doc["pages"],
                "pages_final": sum(by_status[d].get(s, 0) for s in PAGE_JOB_FINAL),
                "pages_failed": by_status[d].get("failed", 0),
                "finished_at": _iso(doc["finished_at"]),
            }
            for d, doc in docs.items()
        }

    def view(
        self, document_id: str, own_row: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The JSON object users see for a document (`ocrq status`, the api, `ocrq run`).

        A document whose pages are all final but which nobody assembled yet (its last page's
        worker died between storing the page and completing it) is completed here. `own_row`:
        the document's own job row, where the caller has it (its batch is read from it, not
        queried again).
        """
        doc = self.get([document_id]).get(document_id)
        if doc is None:
            return None
        if doc["status"] not in FINAL and self.complete(document_id) in FINAL:
            doc = self.get([document_id])[document_id]
        pages = doc["result"] if doc["status"] in FINAL and doc["result"] is not None else None
        if pages is None:
            pages = [page_view(r) for r in self.page_rows(document_id)]
        batch = own_row.get("batch") if own_row is not None else self._batch_of(document_id)
        return document_view(doc, pages, batch)

    def _batch_of(self, document_id: str) -> str | None:
        """The producer's batch, from the document's own job row: the document's row has no
        batch column, and a document refused whole has no page rows to take it from."""
        with self.engine.connect() as conn:
            return conn.execute(
                select(ocr_jobs.c.batch).where(ocr_jobs.c.id == document_id)
            ).scalar_one_or_none()


def _forget_bytes(document_id: str) -> Any:
    return delete(ocr_document_bytes).where(ocr_document_bytes.c.document_id == document_id)


def _pages_of(document_id: str) -> Any:
    return and_(ocr_jobs.c.document_id == document_id, ocr_jobs.c.page.is_not(None))


def _page_rows(document_id: str) -> Any:
    return select(ocr_jobs).where(_pages_of(document_id)).order_by(ocr_jobs.c.page)


def page_view(row: dict[str, Any]) -> dict[str, Any]:
    """One page of a document's result: its lines' boxes are in the page's own pixels."""
    return {
        "page": row["page"],
        "job_id": row["id"],
        "status": row["status"],
        "width": row.get("width"),
        "height": row.get("height"),
        "text": row.get("text"),
        "lines": row.get("lines") or [],
        "error": row.get("error"),
        "truncated": row.get("truncated"),
    }


def assemble(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A complete document's fields from its page rows, in page order."""
    pages = [page_view(r) for r in sorted(rows, key=lambda r: r["page"])]
    failed = [p["page"] for p in pages if p["status"] != "done"]
    text = PAGE_SEPARATOR.join(p["text"] or "" for p in pages if p["status"] == "done")
    if not failed:
        status, error = "done", None
    else:
        status = "failed" if len(failed) == len(pages) else "partial"
        named = ", ".join(str(n) for n in failed[:NAMED_FAILURES])
        more = f" and {len(failed) - NAMED_FAILURES} more" if len(failed) > NAMED_FAILURES else ""
        first = next(p for p in pages if p["status"] != "done")
        error = (
            f"{len(failed)} of {len(pages)} pages failed: page(s) {named}{more} "
            f"(page {first['page']}: {first['error']})"
        )
    return {"status": status, "text": text, "result": pages, "error": error}


def document_view(
    doc: dict[str, Any], pages: list[dict[str, Any]], batch: str | None = None
) -> dict[str, Any]:
    final = sum(p["status"] in PAGE_JOB_FINAL for p in pages)
    return {
        "job_id": doc["id"],
        "document_id": doc["id"],
        "path": doc["source"],
        "status": doc["status"],
        "task": doc["task"],
        "batch": batch,
        "sha256": doc["sha256"],
        "pages": doc["pages"],
        "pages_final": final,
        "pages_failed": sum(p["status"] in PAGE_JOB_FINAL[1:] for p in pages),
        "text": doc["text"],
        "error": doc["error"],
        "page_results": pages,
        "created_at": _iso(doc["created_at"]),
        "finished_at": _iso(doc["finished_at"]),
    }


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None
