"""Another app's round trip (issue 27): results back through Celery's result backend and through
the HTTP client, job id = task id, PDFs through `ocrq run` and through the service.

Real processes throughout: a worker on a queue of its own (and Celery's default queue, where a
bare `send_task` without `queue=` lands), Redis, PostgreSQL, a uvicorn api, and a producer
process that imports nothing of ocrq.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery import Celery

from ocrq.client import Client as HttpClient
from ocrq.client import OcrqError
from ocrq.core.db import get_engine
from ocrq.core.samples import draw_text_image
from ocrq.core.store import JobStore
from tests.conftest import BIN, WorkerProcess
from tests.pdfs import image_pdf, multipage_tiff, text_pdf
from tests.test_api import Uvicorn

QUEUE = f"ocr-producers-{uuid.uuid4().hex[:6]}"
TOKEN = "producer-token-" + uuid.uuid4().hex

# The producer another app would write: Celery alone, the ocrq worker's Redis as broker and
# result backend. It must not import ocrq (checked at the end).
BARE_PRODUCER = """
import json, sys, uuid
from celery import Celery

broker, queue, image = sys.argv[1:4]
app = Celery(broker=broker, backend=broker)
out = {}
# 1. No queue=, no job_id, no task_id: the worker consumes Celery's default queue too, and the
#    job takes the task id as its job id.
plain = app.send_task("ocrq.recognize", kwargs={"image": {"path": image}})
out["plain_id"] = plain.id
out["plain"] = plain.get(timeout=60)
# 2. The old README's message: a job_id of its own and no task_id; the result is found under
#    the job id too.
job_id = str(uuid.uuid4())
old = app.send_task("ocrq.recognize", kwargs={"image": {"path": image}, "job_id": job_id},
                    queue=queue)
old.get(timeout=60)
out["old_job_id"] = job_id
out["old_by_job_id"] = app.AsyncResult(job_id).get(timeout=60)
# 3. A malformed job_id: a FAILURE with the reason, and a row under the task id.
bad = app.send_task("ocrq.recognize", kwargs={"image": {"path": image}, "job_id": "nope"},
                    queue=queue)
error = bad.get(timeout=60, propagate=False)
out["bad_id"] = bad.id
out["bad_state"] = bad.state
out["bad_error"] = str(error)
out["imported_ocrq"] = any(m == "ocrq" or m.startswith("ocrq.") for m in sys.modules)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def env(service_env: dict[str, str]) -> dict[str, str]:
    return {**service_env, "OCRQ_QUEUE": QUEUE}


@pytest.fixture(scope="module")
def producer_worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("producers") / "ocrq.worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "4").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def report_pdf(image_root: Path) -> Path:
    """A two-page image PDF whose pages say known words."""
    pages = [draw_text_image([words], margin=30) for words in ("HELLO WORLD", "INVOICE 2026")]
    return image_pdf(pages, image_root / "report.pdf")


def test_ocrq_run_reads_a_pdf(report_pdf: Path, env: dict[str, str], tmp_path: Path) -> None:
    """`ocrq run report.pdf` as a user types it: one document row with both pages' text."""
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [str(BIN / "ocrq"), "run", str(report_pdf), "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "done" and row["pages"] == 2 and row["pages_failed"] == 0
    assert [p["status"] for p in row["page_results"]] == ["done", "done"]
    assert "HELLO" in row["text"] and "INVOICE" in row["text"]


def test_ocrq_run_counts_a_partly_failed_document_and_exits_1(
    image_root: Path, env: dict[str, str], tmp_path: Path
) -> None:
    """A document whose middle page fails (a page too large to render at the fixed
    OCRQ_PDF_DPI; left to choose, the page is drawn at the DPI that fits) is `partial`: the
    summary line says so and the exit code is 1, as for a failed image (it was 0, and the
    document was in no count of the summary)."""
    pdf = image_root / "partial-run.pdf"
    text_pdf([["FIRST PAGE"], ["BOMB"], ["THIRD PAGE"]], pdf, sizes={1: (14400, 14400)})
    out = tmp_path / "out.jsonl"
    done = subprocess.run(
        [str(BIN / "ocrq"), "run", str(pdf), "-o", str(out)],
        env={**env, "COLUMNS": "200", "OCRQ_PDF_DPI": "200"}, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 1, done.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "partial" and row["pages_failed"] == 1, row
    assert "done: 0, failed: 0, partial: 1, total: 1" in done.stderr, done.stderr


def test_a_document_task_succeeds_with_its_pages(
    producer_worker: WorkerProcess, broker_url: str, database_url: str, report_pdf: Path
) -> None:
    """The document's own Celery task ends in SUCCESS (it was FAILURE though the document was
    done), its result says how many page jobs it made and their ids in page order (a producer
    with Celery only gets its pages' texts through them), and each page task succeeds too."""
    app = Celery(broker=broker_url, backend=broker_url)
    job_id = str(uuid.uuid4())
    sent = app.send_task(
        "ocrq.recognize",
        kwargs={"image": {"path": str(report_pdf)}, "job_id": job_id},
        queue=QUEUE,
        task_id=job_id,
    )
    result = sent.get(timeout=60)
    assert sent.state == "SUCCESS"
    assert result["job_id"] == job_id and result["status"] == "done" and result["pages"] == 2
    store = JobStore(get_engine(database_url))
    rows = store.get(result["page_jobs"])
    assert [(rows[i]["document_id"], rows[i]["page"]) for i in result["page_jobs"]] == [
        (job_id, 1), (job_id, 2)
    ], rows
    texts = [app.AsyncResult(page_id).get(timeout=60) for page_id in result["page_jobs"]]
    assert [t["status"] for t in texts] == ["done", "done"]
    assert all(t["text"] for t in texts), texts


def test_a_page_failed_while_its_inline_document_was_split_has_a_failure_result(
    producer_worker: WorkerProcess, broker_url: str, tmp_path: Path
) -> None:
    """An inline document's page that cannot be read fails while the document is split (a TIFF
    frame is checked there; a PDF page is copied out whole) and is sent to no one; its id is in
    `page_jobs` all the same, and `AsyncResult(id).get()` waited out its whole timeout. Its
    FAILURE is stored by the splitting task: it raises at once, with the page's error, while
    the page beside it is done."""
    import base64

    from PIL import Image

    tiff = multipage_tiff(
        [draw_text_image(["FIRST"]), Image.new("1", (40000, 8), 1)], tmp_path / "sliver.tif"
    )
    app = Celery(broker=broker_url, backend=broker_url)
    job_id = str(uuid.uuid4())
    sent = app.send_task(
        "ocrq.recognize",
        kwargs={"image": {"b64": base64.b64encode(tiff.read_bytes()).decode()}, "job_id": job_id},
        queue=QUEUE,
        task_id=job_id,
    )
    result = sent.get(timeout=60)
    assert result["pages"] == 2 and len(result["page_jobs"]) == 2, result
    first, second = result["page_jobs"]
    assert app.AsyncResult(first).get(timeout=60)["status"] == "done"
    failed = app.AsyncResult(second).get(timeout=10, propagate=False)  # at once, not 10 s late
    assert isinstance(failed, Exception), failed
    assert app.AsyncResult(second).state == "FAILURE"
    assert "page 2" in str(failed) and "too large" in str(failed), failed


def test_bare_celery_producer_round_trip(
    producer_worker: WorkerProcess,
    broker_url: str,
    database_url: str,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    """send_task + AsyncResult.get from a process that imports nothing of ocrq."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", BARE_PRODUCER, broker_url, QUEUE, str(text_images["hello"])],
        env=env,
        cwd=tmp_path,  # not the checkout: `import ocrq` would not even find it by accident
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr + producer_worker.text()[-3000:]
    out = json.loads(done.stdout)
    assert not out["imported_ocrq"]
    # job id = task id: the result and the row are under the id send_task returned
    assert out["plain"]["job_id"] == out["plain_id"] and out["plain"]["status"] == "done"
    assert "HELLO" in out["plain"]["text"] and out["plain"]["lines"][0]["box"]
    assert out["old_by_job_id"]["job_id"] == out["old_job_id"]
    assert out["bad_state"] == "FAILURE" and "job_id" in out["bad_error"]
    rows = JobStore(get_engine(database_url)).get([out["plain_id"], out["bad_id"]])
    assert rows[out["plain_id"]]["status"] == "done"
    assert rows[out["bad_id"]]["status"] == "failed" and "job_id" in rows[out["bad_id"]]["error"]


@pytest.fixture(scope="module")
def api_url(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    api_env = {k: v for k, v in env.items() if not k.startswith("OCRQ_API_")}
    server = Uvicorn(
        {**api_env, "OCRQ_API_TOKEN": TOKEN}, tmp_path_factory.mktemp("api") / "api.log"
    ).wait_up()
    yield f"http://127.0.0.1:{server.port}"
    server.stop()


def test_http_client_submit_get_wait(
    producer_worker: WorkerProcess, api_url: str, text_images: dict[str, Path]
) -> None:
    """ocrq.client against a real api and worker: a path, inline bytes, get and wait."""
    with HttpClient(api_url, token=TOKEN) as ocr:
        by_path = ocr.submit(text_images["hello"])
        inline = ocr.submit(text_images["invoice"].read_bytes())
        rows = ocr.wait([by_path, inline], timeout=60)
        assert [r["status"] for r in rows] == ["done", "done"], rows
        assert "HELLO" in rows[0]["text"] and "INVOICE" in rows[1]["text"]
        assert ocr.get(by_path)["text"] == rows[0]["text"]
        with pytest.raises(OcrqError) as missing:
            ocr.get(str(uuid.uuid4()))
        assert missing.value.status == 404
    with HttpClient(api_url, token="wrong-" + TOKEN) as denied, pytest.raises(OcrqError) as no:
        denied.submit(text_images["hello"])
    assert no.value.status == 401


def test_http_client_refuses_an_empty_image_as_empty(api_url: str) -> None:
    """`submit(b"")` was a 422 saying "image must give exactly one of 'path', 'url' or 'b64'",
    which sent the user looking for a missing field: it says the image is empty."""
    with HttpClient(api_url, token=TOKEN) as ocr:
        for empty in (b"", {"b64": "data:image/png;base64,"}):
            with pytest.raises(OcrqError) as refused:
                ocr.submit(empty)
            assert refused.value.status == 422, refused.value
            assert "image is empty (0 bytes)" in str(refused.value.detail), refused.value.detail
            assert "exactly one" not in str(refused.value.detail)


def test_http_client_sends_an_interactive_job(
    producer_worker: WorkerProcess, api_url: str, text_images: dict[str, Path]
) -> None:
    """`priority` through the api (the client and a plain JSON POST) reaches a worker,
    which consumes the interactive queue beside the bulk one; an unknown lane is a 422."""
    import httpx

    with HttpClient(api_url, token=TOKEN) as ocr:
        live = ocr.submit(text_images["word"], priority="interactive")
        raw = httpx.post(  # what the curl example in docs/producers.md sends
            f"{api_url}/jobs",
            json={"image": {"path": str(text_images["hello"])}, "priority": "interactive"},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        rows = ocr.wait([live, raw.json().get("job_id", "")], timeout=60)
        assert [r["status"] for r in rows] == ["done", "done"], (rows, raw.text)
        with pytest.raises(OcrqError) as refused:
            ocr.submit(text_images["word"], priority="urgent")
        assert refused.value.status == 422 and "interactive" in str(refused.value.detail)
