"""Documents through the whole service: a real worker (CPU engine) under an address-space cap,
Redis, PostgreSQL, `ocrq submit`, a bare Celery producer and the HTTP api.

PDFs are made here from the shared evaluation pages (image PDFs that render back to the very
pixels of each page at the test DPI) and by hand (a text layer), so a document's pages can be
compared with the same pages sent as images.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import func, select

from ocrq.api.client import Client
from ocrq.api.http import create_app
from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.documents_store import DocumentStore
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.broker_probe import where
from tests.conftest import BIN, FIGURES, WorkerProcess, eval_data
from tests.pdfs import TEST_DPI, encrypted_pdf, image_pdf, multipage_tiff, text_pdf
from tests.test_rapid_bounds import MEMORY_FAILURES, CappedWorker
from tests.waiting import Budget

GiB = 1024**3
MAX_PAGES = 40
QUEUE = f"ocr-docs-{uuid.uuid4().hex[:6]}"
EVAL_PAGES = ["sroie/img/009.jpg", "tesseract_test/eurotext.tif", "sroie/img/050.jpg"]
TOKEN = "t" * 32


def docs_env(service_env: dict[str, str], queue: str = QUEUE, **extra: str) -> dict[str, str]:
    return {
        **service_env,
        "OCRQ_QUEUE": queue,
        "OCRQ_PDF_DPI": str(TEST_DPI),
        "OCRQ_MAX_PDF_PAGES": str(MAX_PAGES),
        "MALLOC_ARENA_MAX": "2",
        **{f"OCRQ_{k.upper()}": v for k, v in extra.items()},
    }


@pytest.fixture(scope="module")
def env(service_env: dict[str, str]) -> dict[str, str]:
    return docs_env(service_env)


@pytest.fixture(scope="module")
def capped_worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """One worker for the module, capped at 4 GiB of address space: a page rendered at a
    size the caps should have refused would fail it, not the host."""
    log = tmp_path_factory.mktemp("docs-worker") / "ocrq.worker.log"
    worker = CappedWorker(env, log, 4 * GiB, "--no-supervise", "--concurrency", "8")
    worker.wait_ready()
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def client(broker_url: str, database_url: str) -> Client:
    return Client(Settings(broker_url=broker_url, database_url=database_url, queue=QUEUE))


@pytest.fixture(scope="module")
def folder(image_root: Path) -> Path:
    out = image_root / "documents"
    out.mkdir(exist_ok=True)
    return out


@pytest.fixture(scope="module")
def eval_pages() -> list[Path]:
    root = eval_data()
    return [root / p for p in EVAL_PAGES]


def wait_documents(client: Client, ids: list[str], timeout: float) -> list[dict[str, Any]]:
    rows = client.wait(ids, timeout=timeout)
    late = [r for r in rows if r["status"] not in ("done", "failed", "partial")]
    assert not late, late
    return rows


def send(broker_url: str, image: dict[str, Any], task: str = "text") -> str:
    """A bare Celery producer, as another app would send a job."""
    job_id = str(uuid.uuid4())
    Celery(broker=broker_url).send_task(
        "ocrq.recognize",
        kwargs={"image": image, "task": task, "job_id": job_id},
        queue=QUEUE,
        task_id=job_id,
    )
    return job_id


def child_pids(worker: WorkerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"started worker process pid (\d+)", worker.text())]


def page_count_rows(database_url: str, document_id: str) -> int:
    with get_engine(database_url).connect() as conn:
        return conn.execute(
            select(func.count()).where(
                ocr_jobs.c.document_id == document_id, ocr_jobs.c.page.is_not(None)
            )
        ).scalar_one()


# ------------------------------------------------------------------------------------ results


def test_document_pages_equal_the_same_images(
    capped_worker: WorkerProcess,
    client: Client,
    env: dict[str, str],
    folder: Path,
    eval_pages: list[Path],
    database_url: str,
) -> None:
    """`ocrq submit report.pdf --wait --json`: each page's text and lines equal those of the
    same page sent as an image, the document's text is the pages' in order, boxes are in the
    page's pixels; the page jobs are rows of their own pointing at the document."""
    pdf = image_pdf([Image.open(p) for p in eval_pages], folder / "report.pdf")
    image_ids = [client.submit({"path": str(p)}) for p in eval_pages]
    proc = subprocess.run(
        [str(BIN / "ocrq"), "submit", str(pdf), "--wait", "--json", "--timeout", "400"],
        env=env,
        capture_output=True,
        text=True,
        timeout=450,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (doc,) = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    images = {r["path"]: r for r in wait_documents(client, image_ids, 400)}
    assert doc["status"] == "done", doc
    assert doc["pages"] == len(eval_pages) == doc["pages_final"]
    assert [p["page"] for p in doc["page_results"]] == [1, 2, 3]
    for page, path in zip(doc["page_results"], eval_pages, strict=True):
        image = images[str(path)]
        assert image["status"] == "done", image
        assert page["text"] == image["text"], (path, page["text"][:200], image["text"][:200])
        assert page["lines"] == image["lines"]
        assert (page["width"], page["height"]) == Image.open(path).size
        for line in page["lines"]:
            x1, y1, x2, y2 = line["box"]
            assert 0 <= x1 <= x2 <= page["width"] + 1 and 0 <= y1 <= y2 <= page["height"] + 1
    assert doc["text"] == "\n\n".join(p["text"] for p in doc["page_results"])
    assert page_count_rows(database_url, doc["document_id"]) == 3
    page_rows = JobStore(get_engine(database_url)).get([p["job_id"] for p in doc["page_results"]])
    assert {r["document_id"] for r in page_rows.values()} == {doc["document_id"]}
    assert sorted(r["source"] for r in page_rows.values()) == [f"{pdf}#page={n}" for n in (1, 2, 3)]
    # `ocrq status` shows the document, with its progress in pages.
    shown = subprocess.run(
        [str(BIN / "ocrq"), "status", doc["document_id"]],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert re.search(r"^pages\s+3/3\s*$", shown.stdout, re.M), shown.stdout


def test_text_layer_pdf_tiff_and_upload(
    capped_worker: WorkerProcess,
    client: Client,
    broker_url: str,
    database_url: str,
    folder: Path,
    eval_pages: list[Path],
) -> None:
    """A PDF with a text layer from a bare Celery producer, a multi-page TIFF, and the same
    PDF uploaded through the api (inline: its pages travel as one-page PDFs)."""
    lines = [["HELLO WORLD", "INVOICE 2026"], ["SECOND PAGE", "TOTAL 134.90"], ["STATION"]]
    data = text_pdf(lines, folder / "text.pdf")
    by_path = send(broker_url, {"path": str(folder / "text.pdf")})
    tiff = multipage_tiff([Image.open(p) for p in eval_pages[:2]], folder / "two.tif")
    tiff_id = send(broker_url, {"path": str(tiff)})
    eurotext = client.submit({"path": str(eval_pages[1])})
    settings = Settings(
        broker_url=broker_url, database_url=database_url, queue=QUEUE, api_token=TOKEN
    )
    with TestClient(create_app(settings)) as api:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        mine = str(uuid.uuid4())
        answer = api.post(f"/documents?task=text&job_id={mine}", content=data, headers=auth)
        assert answer.status_code == 202, answer.text
        uploaded = answer.json()["document_id"]
        assert uploaded == mine
        # A retry after a timeout, with the same job_id: the document is recorded once (there
        # was no job_id: every retry made another document).
        again = api.post(f"/documents?job_id={mine.upper()}", content=data, headers=auth)
        assert again.status_code == 200 and again.json()["document_id"] == mine, again.text
        other = api.post(
            f"/documents?job_id={mine}&task=spotting", content=data, headers=auth
        )
        assert other.status_code == 409, other.text
        not_uuid = api.post("/documents?job_id=mine", content=data, headers=auth)
        assert not_uuid.status_code == 422 and "UUID" in not_uuid.text, not_uuid.text
        refused = api.post("/documents", content=b"just text", headers=auth)
        assert refused.status_code == 415
        rows = {r["job_id"]: r for r in wait_documents(client, [by_path, tiff_id, uploaded], 400)}
        via_api = api.get(f"/documents/{uploaded}", headers=auth).json()
        assert api.get(f"/jobs/{uploaded}", headers=auth).json()["document_id"] == uploaded
        # `GET /jobs` lists a document with its own status and pages (its bare job row read
        # `done` with no pages as soon as it was split).
        listed = {r["job_id"]: r for r in api.get("/jobs?limit=200", headers=auth).json()["jobs"]}
        assert (listed[uploaded]["pages"], listed[uploaded]["pages_final"]) == (3, 3)
        assert listed[uploaded]["text"] == "\n\n".join("\n".join(page) for page in lines)
    for job_id in (by_path, uploaded):
        doc = rows[job_id]
        assert doc["status"] == "done", doc
        assert [p["text"] for p in doc["page_results"]] == ["\n".join(page) for page in lines]
        assert doc["text"] == "\n\n".join("\n".join(page) for page in lines)
    assert via_api["text"] == rows[uploaded]["text"] and via_api["pages"] == 3
    assert all(p["job_id"] for p in via_api["page_results"])
    (eurotext_row,) = wait_documents(client, [eurotext], 200)
    tiff_doc = rows[tiff_id]
    assert tiff_doc["status"] == "done" and tiff_doc["pages"] == 2
    assert tiff_doc["page_results"][1]["text"] == eurotext_row["text"]
    assert page_count_rows(database_url, uploaded) == 3


def test_an_uploaded_document_is_kept_in_the_upload_folder(
    capped_worker: WorkerProcess,
    client: Client,
    broker_url: str,
    database_url: str,
    folder: Path,
) -> None:
    """With OCRQ_UPLOAD_DIR set, `POST /documents` stores the file there and sends a path job,
    as `POST /jobs` does with an upload. It always went inline: its row read `b64:17208 chars`,
    the viewer could not draw its pages, a failed one could not be re-run and a retry under its
    job_id was compared by length only. (The folder is inside the worker's allowed roots here;
    a deployment shares it: docs/deploy.md, Uploads.)"""
    data = text_pdf([["KEPT PAGE ONE"], ["KEPT PAGE TWO"]], folder / "kept.pdf")
    settings = Settings(
        broker_url=broker_url, database_url=database_url, queue=QUEUE, api_token=TOKEN,
        upload_dir=folder / "uploads",
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(settings)) as api:
        answer = api.post("/documents", content=data, headers=auth)
        assert answer.status_code == 202, answer.text
        document = answer.json()["document_id"]
        (doc,) = wait_documents(client, [document], 200)
        assert doc["status"] == "done", doc
        assert [p["text"] for p in doc["page_results"]] == ["KEPT PAGE ONE", "KEPT PAGE TWO"]
        row = api.get(f"/jobs/{document}", headers=auth).json()
        assert row["path"].startswith(str((folder / "uploads").resolve())), row["path"]
        page = doc["page_results"][1]["job_id"]
        drawn = api.get(f"/jobs/{page}/image", headers=auth)
        assert drawn.status_code == 200, drawn.text
        assert drawn.headers["content-type"] == "image/jpeg"


def test_a_documents_row_names_its_batch(
    capped_worker: WorkerProcess,
    client: Client,
    env: dict[str, str],
    broker_url: str,
    database_url: str,
    folder: Path,
) -> None:
    """`GET /jobs/{id}` of a document read `"batch": null` while `/batches/B` counted it: the
    document's view left the batch out. Now the job, the document and `ocrq status` name it."""
    data = text_pdf([["FIRST PAGE"], ["SECOND PAGE"]], folder / "batched.pdf")
    batch = f"docs-batch-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        broker_url=broker_url, database_url=database_url, queue=QUEUE, api_token=TOKEN
    )
    with TestClient(create_app(settings)) as api:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        answer = api.post(f"/documents?batch={batch}", content=data, headers=auth)
        assert answer.status_code == 202, answer.text
        doc_id = answer.json()["document_id"]
        (doc,) = wait_documents(client, [doc_id], 200)
        assert doc["status"] == "done" and doc["batch"] == batch, doc
        job = api.get(f"/jobs/{doc_id}", headers=auth).json()
        assert (job["document_id"], job["pages"], job["batch"]) == (doc_id, 2, batch), job
        assert api.get(f"/documents/{doc_id}", headers=auth).json()["batch"] == batch
        summary = api.get(f"/batches/{batch}", headers=auth).json()
        assert summary["documents"] == {"done": 1} and summary["final"], summary
    shown = subprocess.run(
        [str(BIN / "ocrq"), "status", doc_id],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert re.search(rf"^batch\s+{batch}\s*$", shown.stdout, re.M), shown.stdout


# ------------------------------------------------------------------------------------ hostile


def test_bad_documents_fail_alone(
    capped_worker: WorkerProcess,
    client: Client,
    folder: Path,
    eval_pages: list[Path],
) -> None:
    """Each bad document fails with a message that says why, under the worker's 4 GiB cap; a
    bad page fails only itself and its document completes as partial, naming it; the worker
    lives on and reads a good document afterwards."""
    bad = folder / "bad"
    bad.mkdir(exist_ok=True)
    good_page = ["PAGE ONE"]
    cases: dict[str, tuple[Path, str]] = {
        "encrypted": (encrypted_pdf(bad / "encrypted.pdf"), "encrypted PDF: a password is needed"),
        "corrupt": (bad / "corrupt.pdf", "corrupt or unreadable PDF"),
        "zero_pages": (bad / "zero.pdf", "document has no pages"),
        "too_many_pages": (bad / "many.pdf", f"> limit {MAX_PAGES} (OCRQ_MAX_PDF_PAGES)"),
        "bomb_page": (bad / "bomb.pdf", "possible decompression bomb"),
        "not_a_pdf": (bad / "picture.pdf", "not a PDF"),
        "truncated": (bad / "truncated.pdf", "corrupt or unreadable PDF"),
    }
    (bad / "corrupt.pdf").write_bytes(b"%PDF-1.7\n" + os.urandom(4000))
    text_pdf([], bad / "zero.pdf")
    text_pdf([good_page] * (MAX_PAGES + 1), bad / "many.pdf")
    # One page of 200 x 200 inches (PDF's largest): 28800² pixels at 144 dpi, 829 MP.
    text_pdf([good_page], bad / "bomb.pdf", size=(14400, 14400))
    Image.open(eval_pages[1]).save(bad / "picture.pdf", format="PNG")
    whole = image_pdf([Image.open(eval_pages[1])], bad / "whole.pdf")
    (bad / "truncated.pdf").write_bytes(whole.read_bytes()[:2000])
    # Three pages, the middle one a bomb: the document completes as partial, naming page 2.
    partial = bad / "partial.pdf"
    text_pdf([["FIRST PAGE"], ["BOMB"], ["THIRD PAGE"]], partial, sizes={1: (14400, 14400)})

    ids = {name: client.submit({"path": str(path)}) for name, (path, _) in cases.items()}
    partial_id = client.submit({"path": str(partial)})
    rows = {r["job_id"]: r for r in wait_documents(client, [*ids.values(), partial_id], 400)}
    for name, (_path, message) in cases.items():
        row = rows[ids[name]]
        assert row["status"] == "failed", (name, row)
        assert message in row["error"], (name, row["error"])
        assert not any(m in row["error"] for m in MEMORY_FAILURES), row["error"]
    doc = rows[partial_id]
    assert doc["status"] == "partial", doc
    assert [p["status"] for p in doc["page_results"]] == ["done", "failed", "done"]
    assert "page(s) 2 " in doc["error"] and "decompression bomb" in doc["error"], doc["error"]
    assert doc["text"] == "FIRST PAGE\n\nTHIRD PAGE"
    # A document refused whole has its own failed row too.
    refused = DocumentStore(client.store.engine).get([ids["encrypted"]])[ids["encrypted"]]
    assert refused["status"] == "failed" and "password" in refused["error"]
    assert capped_worker.alive(), capped_worker.text()[-3000:]
    text_pdf([good_page], bad / "after.pdf")
    after = client.submit({"path": str(bad / "after.pdf")})
    (row,) = wait_documents(client, [after], 200)
    assert row["status"] == "done" and row["text"] == "PAGE ONE", row
    assert capped_worker.alive()


# ------------------------------------------------------------------------------------ faults


def test_kill_9_mid_document_loses_and_duplicates_nothing(
    service_env: dict[str, str],
    broker_url: str,
    database_url: str,
    folder: Path,
    tmp_path: Path,
) -> None:
    """A 30-page document; the worker process is killed (-9) with pages done and pages
    running; the supervisor starts a new one, the stalled pages are sent again, and the
    document completes with every page once and every page's text right."""
    pages = [[f"PAGE {n} OF THIRTY", f"WORD {n * 7}"] for n in range(1, 31)]
    pdf = folder / "thirty.pdf"
    text_pdf(pages, pdf)
    queue = f"ocr-kill-{uuid.uuid4().hex[:6]}"  # not the module's capped worker's
    client = Client(Settings(broker_url=broker_url, database_url=database_url, queue=queue))
    env = docs_env(
        service_env, queue, visibility_timeout_s="20", max_batch="4", heartbeat_s="1",
        stalled_after_s="5", stalled_sweep_s="2",
    )  # fmt: skip
    # Waits: ready 60 + pages mid-run 120 + the document final 240.
    budget = Budget(420, "kill-9 document")
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8").wait_ready(60)
    store = JobStore(get_engine(database_url))
    t0 = time.monotonic()
    try:
        document_id = client.submit({"path": str(pdf)})

        def page_states() -> str:
            rows = client.documents.page_rows(document_id)
            return "pages: " + ", ".join(f"{r['page']}:{r['status']}/{r['attempts']}" for r in rows)

        def mid_run() -> list[dict[str, Any]] | None:
            rows = client.documents.page_rows(document_id)
            done = [r for r in rows if r["status"] == "done"]
            return done if len(done) >= 5 and any(r["status"] == "running" for r in rows) else None

        done = budget.until(
            ">= 5 pages done and one running",
            mid_run,
            120,
            lambda: page_states() + "\n" + worker.text()[-2000:],
            poll_s=0.05,
        )
        before = {r["id"]: (r["text"], r["finished_at"]) for r in done}
        os.kill(child_pids(worker)[-1], signal.SIGKILL)

        def stuck() -> str:  # where the pages not final are, as the recovery sweep sees them
            rows = client.documents.page_rows(document_id)
            ids = [r["id"] for r in rows if r["status"] not in ("done", "failed")]
            probe = Settings(broker_url=broker_url, database_url=database_url, queue=queue)
            return page_states() + "\n" + where(probe, ids) + "\n" + worker.text()[-3000:]

        budget.until(
            "the document final after the kill",
            lambda: all(
                r["status"] in ("done", "failed") for r in client.documents.page_rows(document_id)
            ),
            240,
            stuck,
            poll_s=0.25,
        )
        (doc,) = wait_documents(client, [document_id], 30)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
    page_rows = client.documents.page_rows(document_id)
    reruns = sum(max(0, r["attempts"] - 1) for r in page_rows)
    line = (
        f"[kill-9 document] pages=30 done={sum(r['status'] == 'done' for r in page_rows)} "
        f"rows={page_count_rows(database_url, document_id)} rerun={reruns} "
        f"seconds={seconds:.1f}"
    )
    print("\n" + line)
    FIGURES.append(line)
    assert doc["status"] == "done", doc
    assert page_count_rows(database_url, document_id) == 30  # nothing duplicated
    assert [p["page"] for p in doc["page_results"]] == list(range(1, 31))  # nothing lost
    assert [p["text"] for p in doc["page_results"]] == ["\n".join(p) for p in pages]
    assert doc["text"] == "\n\n".join("\n".join(p) for p in pages)
    assert reruns >= 1  # pages of the killed process ran again
    rows = store.get(list(before))
    for job_id, (text, finished) in before.items():  # no stored page changed
        assert (rows[job_id]["text"], rows[job_id]["finished_at"]) == (text, finished)


def test_a_large_format_page_is_drawn_within_the_image_caps(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 4961x7016 scan saved at 150 dpi (a 33x47 in page; drawn to exactly 40 MP it came
    out 9,518 pixels over the cap and was refused as a bomb) and a 200x200 in page (too large
    even at OCRQ_PDF_MIN_DPI) are drawn as large as the image caps allow, the second below the
    minimum DPI, which the log says; a page no DPI can fit (too elongated) still fails."""
    from ocrq.core.pixel_budget import PixelBudget, Stage
    from ocrq.intake.documents import Document, DocumentError, render_pdf_page

    settings = Settings()
    budget = PixelBudget(intake_limit=settings.max_image_pixels)  # the CPU engine's
    scan = image_pdf([Image.new("L", (4961, 7016), 255)], folder / "a0.pdf", dpi=150)
    poster = text_pdf([["POSTER"]], size=(14400, 14400))
    strip = text_pdf([["STRIP"]], size=(14400, 10))

    def draw(data: bytes) -> Image.Image:
        document = Document("pdf", data, "large.pdf")
        return render_pdf_page(
            document, 1, settings, budget.render_target(), budget.at(Stage.RENDER)
        )

    for data in (scan.read_bytes(), poster):
        image = draw(data)
        w, h = image.size
        assert 0.995 * settings.max_image_pixels < w * h <= settings.max_image_pixels
    assert re.search(r"large\.pdf page 1 \(200x200 in\) drawn at 31\.\d dpi, below", caplog.text)
    with pytest.raises(DocumentError, match="too elongated"):
        draw(strip)
