"""URL and inline documents split by a real worker (issue 52): stored once, never a copy per
page in Redis; a lost page rebuilt from its row; a cancel seen by the split; page rows made
only as their messages are sent, so the recovery sweep never takes a page not sent yet for
lost. The worker runs the CPU engine under an address-space cap, against the session's Redis
and PostgreSQL.
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from ocrq.api.client import Client
from ocrq.api.http import create_app
from ocrq.core.contract import DOCUMENT_REFUSED, JobRequest
from ocrq.core.db import ocr_jobs
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.intake import documents, splitting
from tests.conftest import FIGURES, WorkerProcess
from tests.pdfs import shared_image_pdf
from tests.test_rapid_bounds import CappedWorker
from tests.waiting import Budget

GiB = 1024**3
QUEUE = f"ocr-split-{uuid.uuid4().hex[:6]}"
TOKEN = "s" * 32
PAGES = 6


@pytest.fixture(scope="module")
def settings(broker_url: str, database_url: str) -> Settings:
    return Settings(
        broker_url=broker_url,
        database_url=database_url,
        queue=QUEUE,
        api_token=TOKEN,
        max_pdf_pages=1000,
    )


@pytest.fixture(scope="module")
def client(settings: Settings) -> Client:
    return Client(settings)


@pytest.fixture(scope="module")
def worker(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A fast recovery sweep: a page row queued without its message for 3 s is re-sent."""
    env = {
        **service_env,
        "OCRQ_QUEUE": QUEUE,
        "OCRQ_MAX_PDF_PAGES": "1000",
        # 417x139 pixel pages: read right (as `PAGE1`), and cheap; at 200 DPI (833x278) the CPU
        # engine took ~5 s a page here, at 100 under 0.6 s.
        "OCRQ_PDF_DPI": "100",
        "OCRQ_URL_ALLOW_NETWORKS": "127.0.0.1/32",
        "OCRQ_HEARTBEAT_S": "1",
        "OCRQ_STALLED_AFTER_S": "3",
        "OCRQ_STALLED_SWEEP_S": "1",
        "MALLOC_ARENA_MAX": "2",
    }
    log = tmp_path_factory.mktemp("split-worker") / "ocrq.worker.log"
    worker = CappedWorker(env, log, 4 * GiB, "--no-supervise", "--concurrency", "8")
    worker.wait_ready()
    yield worker
    worker.stop()


def page_rows(client: Client, document_id: str) -> list[dict[str, Any]]:
    return client.documents.page_rows(document_id)


def texts(doc: dict[str, Any]) -> list[str]:
    """Each page's text, spaces out (the CPU engine reads `PAGE 1` as `PAGE1` at this size)."""
    return [(p["text"] or "").replace(" ", "") for p in doc["page_results"]]


def final_document(client: Client, document_id: str, budget: Budget, seconds: float) -> dict:
    def final() -> dict[str, Any] | None:
        (row,) = client.status([document_id])
        return row if row["status"] in ("done", "partial", "failed", "cancelled") else None

    return budget.until(
        f"document {document_id} final",
        final,
        seconds,
        lambda: str([(r["page"], r["status"]) for r in page_rows(client, document_id)]),
    )


def test_an_inline_document_is_stored_once_not_once_a_page(
    worker: WorkerProcess, broker_url: str, client: Client
) -> None:
    """Six pages sharing one 1 MB image, sent inline by a bare Celery producer: what Redis is
    sent in all stays about the document's own message (sent once, held once in `unacked`)
    plus a little a page, where one-page PDFs carried the image each (issue 52: 153.7 MB for
    40 such pages; 46.6 MB for 12 of these); every page runs once and reads right; the stored
    copy goes once the document is done."""
    budget = Budget(240, "inline document stored once")
    pdf = shared_image_pdf(PAGES)
    b64 = base64.b64encode(pdf).decode()
    r = redis.Redis.from_url(broker_url)
    before = r.info("stats")["total_net_input_bytes"]
    job_id = str(uuid.uuid4())
    Celery(broker=broker_url).send_task(
        "ocrq.recognize",
        kwargs={"image": {"b64": b64}, "job_id": job_id},
        queue=QUEUE,
        task_id=job_id,
    )
    doc = final_document(client, job_id, budget, 200)
    written = r.info("stats")["total_net_input_bytes"] - before
    line = f"[inline document stored once] pages={PAGES} pdf={len(pdf)} redis_in={written}"
    print("\n" + line)
    FIGURES.append(line)
    assert doc["status"] == "done", doc
    assert texts(doc) == [f"PAGE{n}" for n in range(1, PAGES + 1)]
    rows = page_rows(client, job_id)
    assert [r["attempts"] for r in rows] == [1] * PAGES, rows
    assert {r["reference"]["document"] for r in rows} == {job_id}
    # The message once in the queue and once in `unacked`, and what its task's events and
    # result add; one-page PDFs wrote the image twice (queue, unacked) for each page.
    assert written < 3 * len(b64) + PAGES * 16_000, written
    assert client.documents.stored_bytes(job_id) is None  # done: no page can need it again


def test_a_lost_page_of_a_stored_document_is_rebuilt_from_its_row(
    worker: WorkerProcess, broker_url: str, client: Client, settings: Settings
) -> None:
    """A page message lost (never sent here) is re-sent by the worker's recovery sweep from
    its row, `{"document": id, "page": n}`, and runs from the stored copy, under its page's
    name; every page message is small. A producer's job naming a stored document is refused."""
    budget = Budget(200, "lost page of a stored document")
    pdf = shared_image_pdf(4, image_bytes=200_000)
    request = JobRequest.model_validate({"image": {"b64": base64.b64encode(pdf).decode()}})
    send = splitting.celery_sender(settings)
    sent: list[JobRequest] = []

    def all_but_page_2(document_id: str, page: JobRequest) -> None:
        sent.append(page)
        if page.image.page != 2:
            send(document_id, page)

    taken = documents.take(request.image, settings)
    assert isinstance(taken, documents.Document)
    docs = DocumentStore(client.store.engine)
    splitting.split(request, taken, settings, docs, client.store, all_but_page_2)
    assert len(sent) == 4 and all(len(str(p.message())) < 1000 for p in sent), sent
    # Split here, the document has no job row of its own: its row is read, not its job's.
    doc = budget.until(
        "the document done",
        lambda: (v := docs.view(request.job_id)) and v["status"] == "done" and v,
        120,
        lambda: str(page_rows(client, request.job_id)),
    )
    assert texts(doc) == [f"PAGE{n}" for n in range(1, 5)]
    (lost,) = [r for r in page_rows(client, request.job_id) if r["page"] == 2]
    assert lost["source"] == f"b64:{len(request.image.b64 or '')} chars#page=2", lost
    assert lost["attempts"] == 1 and lost["reference"] == {"document": request.job_id, "page": 2}

    # Another producer's job naming that document (its bytes are gone now; a live one's
    # would not be read either): refused, not run.
    other = client.submit({"document": request.job_id, "page": 1})  # type: ignore[dict-item]
    (row,) = client.wait([other], timeout=budget.left())
    assert row["status"] == "failed" and row["error"] == DOCUMENT_REFUSED, row


class HeldDocument:
    """A URL document whose answer waits until the test lets it go."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.asked = threading.Event()
        self.go = threading.Event()
        held = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                held.asked.set()
                held.go.wait(60)
                self.send_response(200)
                self.send_header("Content-Type", "application/pdf")
                self.send_header("Content-Length", str(len(held.body)))
                self.end_headers()
                self.wfile.write(held.body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/doc.pdf"

    def close(self) -> None:
        self.go.set()
        self.server.shutdown()


def test_a_document_cancelled_while_it_is_split_sends_no_more_pages(
    worker: WorkerProcess, client: Client, settings: Settings
) -> None:
    """DELETE /jobs/{doc} once its worker has taken it (its URL is being fetched): the split
    that follows sees the cancel before it sends a page, and the document is `cancelled`,
    final; a second DELETE says so (200), GET says cancelled. Before, all 1,000 pages were
    made and run, GET said running and a second DELETE answered 409 (issue 52)."""
    budget = Budget(120, "cancel mid-split")
    held = HeldDocument(shared_image_pdf(300, image_bytes=20_000))
    try:
        document_id = client.submit({"url": held.url})
        budget.until("the worker fetching the document", held.asked.is_set, 60)
        with TestClient(create_app(settings)) as api:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            first = api.delete(f"/jobs/{document_id}", headers=auth)
            assert first.status_code == 200 and first.json()["cancelled"], first.text
            held.go.set()
            # The document's own row (its job's row said cancelled from the DELETE on).
            budget.until(
                "the document's row final",
                lambda: client.documents.get([document_id]).get(document_id, {}).get("status")
                in ("done", "partial", "failed", "cancelled"),
                60,
                lambda: str([(r["page"], r["status"]) for r in page_rows(client, document_id)]),
            )
            (doc,) = client.status([document_id])
            again = api.delete(f"/jobs/{document_id}", headers=auth)
            shown = api.get(f"/jobs/{document_id}", headers=auth)
    finally:
        held.close()
    assert doc["status"] == "cancelled", doc
    assert again.status_code == 200 and again.json()["status"] == "cancelled", again.text
    assert shown.json()["status"] == "cancelled", shown.text
    rows = page_rows(client, document_id)
    assert len(rows) <= splitting.STEP and {r["status"] for r in rows} <= {"cancelled"}, rows
    assert client.documents.stored_bytes(document_id) is None
    assert f"document {document_id} cancelled while it was split" in worker.text()


def test_page_rows_are_made_only_as_their_messages_are_sent(
    client: Client, settings: Settings
) -> None:
    """No page row waits `queued` for a message the split has not sent: made all at once
    first, 1,000 rows sat queued for the 32-85 s their messages took, and the recovery sweep
    re-sent hundreds of them (and fetched a URL document again for each). At every send, the
    rows made are at most the pages sent plus one step."""
    pdf = shared_image_pdf(300, image_bytes=1_000)
    request = JobRequest.model_validate({"image": {"b64": base64.b64encode(pdf).decode()}})
    taken = documents.take(request.image, settings)
    assert isinstance(taken, documents.Document)
    sent: list[str] = []
    ahead: list[int] = []

    def count(document_id: str, page: JobRequest) -> None:
        sent.append(page.job_id)
        with client.store.engine.connect() as conn:
            made = conn.execute(
                select(func.count()).where(ocr_jobs.c.document_id == document_id,
                                           ocr_jobs.c.page.is_not(None))
            ).scalar_one()  # fmt: skip
        ahead.append(made - len(sent))

    docs = DocumentStore(client.store.engine)
    assert splitting.split(request, taken, settings, docs, client.store, count) == 300
    assert max(ahead) < splitting.STEP, max(ahead)
    pages = [splitting.page_job_id(request.job_id, n) for n in range(1, 301)]
    assert sent == pages
    # A redelivered split sends the pages still queued again, and makes nothing twice.
    again: list[str] = []
    splitting.split(request, taken, settings, docs, client.store,
                    lambda _d, p: again.append(p.job_id))  # fmt: skip
    assert again == pages and len(page_rows(client, request.job_id)) == 300


def test_the_stored_copy_is_read_once_for_many_pages(tmp_path: Path) -> None:
    """A worker reads a stored document from the database once for its pages, also when
    they start together, and keeps no more than its budget."""
    from ocrq.intake.stored import StoredDocuments

    reads: list[str] = []
    gate = threading.Event()

    def load(document_id: str) -> bytes | None:
        reads.append(document_id)
        gate.wait(5)
        return document_id.encode() * 10 if document_id != "gone" else None

    kept = StoredDocuments(load, max_bytes=25)
    got: list[bytes | None] = []
    threads = [threading.Thread(target=lambda: got.append(kept.get("ab"))) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert got == [b"ab" * 10] * 8 and reads == ["ab"]
    assert kept.get("gone") is None
    kept.get("cd")  # 20 + 20 bytes > 25: "ab" goes
    kept.get("ab")
    assert reads == ["ab", "gone", "cd", "ab"]
