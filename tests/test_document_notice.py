"""A document's webhook is claimed once in PostgreSQL (ocr_documents.notified_at,
migrations/0010): two page jobs that end together, or a redelivered copy of a page, found the
document final and could both send `document.finished`; now only the caller whose UPDATE sets
the column from NULL sends it, and a re-run (`ocrq retry`) of one of its pages opens it again.

Real PostgreSQL (the session's database, migrated by `ocrq migrate`), real threads racing.
"""

from __future__ import annotations

import threading
import uuid

from sqlalchemy import update

from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.documents_store import DocumentStore
from ocrq.core.rerun import reopen_failed
from ocrq.intake.splitting import page_job_id


def _document(store: DocumentStore) -> tuple[str, list[str]]:
    doc = str(uuid.uuid4())
    pages = [page_job_id(doc, n) for n in (1, 2)]
    source = f"/data/{doc}.pdf"
    references = {p: {"path": source, "page": n} for n, p in enumerate(pages, start=1)}
    assert store.open(doc, "text", source, "0" * 64, 2) == [1, 2]
    store.add_pages(doc, "text", [(pages[0], 1, f"{source}#1"), (pages[1], 2, f"{source}#2")],
                    references)
    return doc, pages


def _finish(store: DocumentStore, page: str, status: str = "done") -> None:
    with store.engine.begin() as conn:
        conn.execute(update(ocr_jobs).where(ocr_jobs.c.id == page)
                     .values(status=status, text=f"text of {page}",
                             error=None if status == "done" else "boom"))


def test_two_pages_ending_together_send_the_webhook_once(database_url: str) -> None:
    store = DocumentStore(get_engine(database_url))
    doc, pages = _document(store)
    _finish(store, pages[0])
    assert store.assemble(doc) == (None, False)
    assert not store.claim_notice(doc)  # not final: nothing to send yet
    _finish(store, pages[1])  # both stored before either page job assembles
    assert store.assemble(doc) == ("done", True)
    assert store.assemble(doc) == ("done", False)  # the other page job: final, not its doing
    # Both page jobs try to claim at once (and a redelivered copy beside them): one wins.
    barrier, won = threading.Barrier(8), []

    def claim() -> None:
        barrier.wait(timeout=30)
        won.append(store.claim_notice(doc))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(won) == [False] * 7 + [True]
    assert not store.claim_notice(doc)


def test_a_rerun_page_reopens_the_documents_webhook(database_url: str) -> None:
    store = DocumentStore(get_engine(database_url))
    doc, pages = _document(store)
    _finish(store, pages[0])
    _finish(store, pages[1], status="failed")
    assert store.assemble(doc) == ("partial", True)
    assert store.claim_notice(doc)
    reopened = reopen_failed(store.engine, job_ids=[pages[1]])
    assert [r.id for r in reopened] == [pages[1]]
    assert store.get([doc])[doc]["status"] == "running"
    assert not store.claim_notice(doc)  # running again: nothing to send until it ends
    _finish(store, pages[1])
    assert store.assemble(doc) == ("done", True)
    assert store.claim_notice(doc)  # the new outcome goes out once more
    assert not store.claim_notice(doc)
