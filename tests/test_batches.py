"""Batches, re-runs and exports (issue 30), the way producers and operators use them.

A real `ocrq worker` (CPU engine) behind real Redis and PostgreSQL; `ocrq` commands run as
processes and the api as a real uvicorn. One batch of two images, a two-page PDF and an image
whose file is missing: waited on through the CLI and the api, exported in every format, and
after the missing file appears, re-run until every job is done, its attempts counted.
"""

from __future__ import annotations

import base64
import csv
import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from celery import Celery

from ocrq.client import Client as OcrqClient
from ocrq.core import rerun
from ocrq.core.contract import TASK_NAME
from ocrq.core.db import get_engine
from ocrq.core.store import JobStore, NewJob
from tests.conftest import BIN, WorkerProcess
from tests.pdfs import text_pdf
from tests.terminal import on_terminal
from tests.test_api import Uvicorn
from tests.waiting import Budget

TOKEN = "test-token-" + uuid.uuid4().hex
PAGES = [["FIRST PAGE"], ["SECOND PAGE"]]


def ocrq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ocrq"), *args], env=env, capture_output=True, text=True, timeout=200
    )


@pytest.fixture(scope="module")
def api(service_env: dict[str, str], worker: WorkerProcess, tmp_path_factory: Any) -> Iterator[
    httpx.Client
]:
    log = tmp_path_factory.mktemp("batchapi") / "ocrq.api.log"
    env = {k: v for k, v in service_env.items() if not k.startswith("OCRQ_API_")}
    server = Uvicorn({**env, "OCRQ_API_TOKEN": TOKEN}, log).wait_up()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(
        base_url=f"http://127.0.0.1:{server.port}", headers=headers, timeout=60
    ) as client:
        yield client
    server.stop()


def test_batch_wait_export_and_retry(
    worker: WorkerProcess,
    api: httpx.Client,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    image_root: Path,
    tmp_path: Path,
) -> None:
    folder = image_root / f"batch-{uuid.uuid4().hex[:6]}"
    folder.mkdir()
    for name in ("hello", "invoice"):
        shutil.copy(text_images[name], folder / f"{name}.png")
    text_pdf(PAGES, folder / "report.pdf")
    missing = image_root / f"late-{uuid.uuid4().hex[:6]}.png"
    late_pdf = image_root / f"late-{uuid.uuid4().hex[:6]}.pdf"
    batch = f"nightly-{uuid.uuid4().hex[:6]}"
    submitted = ocrq(
        service_env, "submit", "--batch", batch, str(folder), str(missing), str(late_pdf)
    )
    assert submitted.returncode == 0, submitted.stderr
    assert f"batch: {batch}" in submitted.stderr
    ids = submitted.stdout.split()
    assert len(ids) == 5

    # `ocrq wait BATCH`: a failed job makes it exit 1, once every job is final.
    waited = ocrq(service_env, "wait", batch, "--timeout", "150", "--json")
    assert waited.returncode == 1, waited.stderr
    summary = json.loads(waited.stdout.splitlines()[0])
    assert summary["final"] and summary["batch"] == batch
    # 2 images + 2 pages; the missing image, and the missing PDF (not known as one yet)
    assert summary["jobs"] == {"done": 4, "failed": 2}
    assert summary["pages"] == {"done": 2} and summary["documents"] == {"done": 1}
    assert summary["eta_s"] == 0 and summary["first_finished_at"] <= summary["last_finished_at"]
    assert "done: 4, failed: 2, total: 6 images and pages" in waited.stderr
    # A document named by its id counts once, and the line says so.
    (document,) = [r["job_id"] for r in api.post("/jobs/lookup", json={"job_ids": ids}).json()[
        "jobs"] if r.get("pages")]
    one = ocrq(service_env, "wait", document, "--timeout", "60")
    assert one.returncode == 0 and "total: 1 images and documents" in one.stderr, one.stderr
    # The api says the same.
    answer = api.get(f"/batches/{batch}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["jobs"] == summary["jobs"] and answer.json()["rate_per_s"] > 0
    assert api.get(f"/batches/nope-{uuid.uuid4().hex}").status_code == 404
    listed = api.get("/jobs", params={"batch": batch, "limit": 100}).json()["jobs"]
    assert len(listed) == 7 and {r["batch"] for r in listed} == {batch}  # + the PDF's own job

    # `ocrq jobs`: a page smaller than the batch says there is more; --all pages through it.
    few = ocrq(service_env, "jobs", "--batch", batch, "--limit", "2", "--json")
    assert len(few.stdout.splitlines()) == 2 and "more jobs match" in few.stderr
    every = ocrq(service_env, "jobs", "--batch", batch, "--all", "--json")
    assert len(every.stdout.splitlines()) == 7 and "more jobs" not in every.stderr

    # Export in every format (into a folder that does not exist yet).
    out = tmp_path / "new" / "out.jsonl"
    exported = ocrq(service_env, "export", "--batch", batch, "--format", "jsonl", "--out", str(out))
    assert exported.returncode == 0, exported.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 and "exported 6 record(s)" in exported.stderr
    by_kind = {(r["kind"], r["page"]): r for r in records}
    assert by_kind[("page", 1)]["text"] == "FIRST PAGE"
    assert by_kind[("page", 2)]["text"] == "SECOND PAGE"
    pages = [r["page"] for r in records if r["kind"] == "page"]
    assert pages == [1, 2]  # in order
    texts = {Path(r["path"]).name: r["text"] for r in records if r["kind"] == "image"}
    assert texts["hello.png"] == "HELLO WORLD" and texts[missing.name] is None
    assert all(r["batch"] == batch and r["lines"] is not None for r in records)

    # `--out -`: the same records on standard output (a pipeline's input), the bar on stderr.
    piped = ocrq(service_env, "export", "--batch", batch, "--out", "-")
    assert piped.returncode == 0, piped.stderr
    assert [json.loads(line) for line in piped.stdout.splitlines()] == records
    assert "exported 6 record(s) to standard output" in piped.stderr
    # As a user types it (`... --out - > file`): the bar on a terminal, which makes rich swap
    # sys.stdout for its own proxy while the bar runs; the records still reach the pipe.
    code, terminal, out = on_terminal(
        service_env, "export", "--batch", batch, "--out", "-", stream="stderr"
    )
    assert code == 0, terminal
    assert [json.loads(line) for line in out.splitlines()] == records
    assert "exported 6 record(s)" in terminal and records[0]["job_id"] not in terminal
    folder_only = ocrq(service_env, "export", "--batch", batch, "--format", "md", "--out", "-")
    assert folder_only.returncode == 2 and "not to standard output" in folder_only.stderr

    unknown = ocrq(service_env, "export", "--batch", f"nope-{uuid.uuid4().hex[:6]}", "--out",
                   str(tmp_path / "none.jsonl"))
    assert unknown.returncode == 4 and "no job names batch" in unknown.stderr, unknown.stderr
    assert ocrq(service_env, "export", "--batch", batch, "--out", str(tmp_path)).returncode == 2
    table = tmp_path / "out.csv"
    assert ocrq(service_env, "export", "--batch", batch, "--format", "csv", "--out", str(table))
    with table.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 and {r["job_id"] for r in rows} == {r["job_id"] for r in records}
    assert any(json.loads(r["lines"]) for r in rows)  # the boxes, as JSON in a cell

    md = tmp_path / "md"
    made = ocrq(service_env, "export", "--batch", batch, "--format", "md", "--out", str(md))
    assert made.returncode == 0, made.stderr
    assert sorted(p.name for p in md.iterdir()) == ["hello.md", "invoice.md", "report.md"]
    assert (md / "report.md").read_text() == "FIRST PAGE\n\nSECOND PAGE\n"
    assert (md / "invoice.md").read_text() == "INVOICE 2026\nTOTAL 134.90\n"
    assert "2 not done (no file)" in made.stderr
    pq_out = tmp_path / "out.parquet"
    parquet = ocrq(service_env, "export", "--batch", batch, "--format", "parquet", "--out",
                   str(pq_out))
    assert parquet.returncode == 0, parquet.stderr
    import pyarrow.parquet as pq

    frame = pq.read_table(pq_out).to_pylist()
    assert [r["job_id"] for r in frame] == [r["job_id"] for r in records]
    assert [r["text"] for r in frame] == [r["text"] for r in records]
    assert frame[0]["created_at"].tzinfo is not None  # a timestamp column, not a string
    assert any(r["lines"] and json.loads(r["lines"]) for r in frame)

    # The files appear; the failed jobs are run again, and counted.
    shutil.copy(text_images["word"], missing)
    text_pdf([["THIRD PAGE"]], late_pdf)
    retried = ocrq(service_env, "retry", "--status", "failed", "--batch", batch)
    assert retried.returncode == 0, retried.stderr
    assert sorted(retried.stdout.split()) == sorted(ids[-2:])
    assert "re-sent 2 failed job(s)" in retried.stderr
    assert ocrq(service_env, "wait", batch, "--timeout", "150").returncode == 0
    row = api.get(f"/jobs/{ids[-2]}").json()
    assert (row["status"], row["text"], row["attempts"], row["retries"]) == (
        "done",
        "STATION",
        2,
        1,
    )
    document = api.get(f"/jobs/{ids[-1]}").json()  # split on its re-run, into its page
    assert (document["status"], document["text"], document["pages"]) == ("done", "THIRD PAGE", 1)
    after = api.get(f"/batches/{batch}").json()
    assert after["jobs"] == {"done": 6} and after["documents"] == {"done": 2}  # 3 images, 3 pages
    # Nothing failed is left to re-run, through the api too.
    assert api.post("/jobs/retry", json={"batch": batch}).json() == {
        "job_ids": [], "not_retried": {}
    }
    done_again = ocrq(service_env, "retry", ids[-2])
    assert done_again.returncode == 0 and done_again.stdout == "", done_again.stderr
    assert f"not re-sent: {ids[-2]}: done, not failed" in done_again.stderr
    for unknown in ([str(uuid.uuid4())], ["--batch", f"nope-{uuid.uuid4().hex[:6]}"]):
        assert ocrq(service_env, "retry", *unknown).returncode == 4, unknown
    assert api.post("/jobs/retry", json={}).status_code == 422
    # Each named job not re-run says why; a batch no job names is a 404, as GET says. (The api
    # answered `{"job_ids": []}` to all of these, and the CLI called a failed inline job
    # "not failed".)
    inline = api.post("/jobs", json={"image": {"b64": base64.b64encode(b"not an image").decode()}})
    inline_id = inline.json()["job_id"]
    assert api.get(f"/jobs/{inline_id}", params={"wait": 60}).json()["status"] == "failed"
    stranger = str(uuid.uuid4())
    answer = api.post("/jobs/retry", json={"job_ids": [ids[-2], inline_id, stranger]})
    assert answer.status_code == 200 and answer.json()["job_ids"] == [], answer.text
    assert answer.json()["not_retried"] == {
        ids[-2]: "done, not failed",
        inline_id: "an inline (b64) image: its bytes were not kept, so submit it again",
        stranger: "no such job",
    }
    nope = api.post("/jobs/retry", json={"batch": f"nope-{uuid.uuid4().hex[:6]}"})
    assert nope.status_code == 404 and "no job names this batch" in nope.text
    told = ocrq(service_env, "retry", inline_id)
    assert told.returncode == 0 and f"not re-sent: {inline_id}: an inline (b64)" in told.stderr
    # A failed job that could run again, named with a batch it is not in: not re-run, and why.
    gone = api.post("/jobs", json={"image": {"path": str(image_root / "never-there.png")}})
    gone_id = gone.json()["job_id"]
    assert api.get(f"/jobs/{gone_id}", params={"wait": 60}).json()["status"] == "failed"
    both = api.post("/jobs/retry", json={"batch": batch, "job_ids": [gone_id]}).json()
    assert both == {"job_ids": [], "not_retried": {gone_id: f"not in batch {batch}"}}, both
    assert api.post("/jobs/retry", json={"job_ids": [gone_id]}).json()["job_ids"] == [gone_id]
    # Nor does the CLI re-run every failed job unless asked by name (--all); the count is said.
    bare = ocrq(service_env, "retry")
    said = " ".join(bare.stderr.split())
    assert bare.returncode == 2 and "job ids, --batch B, or --all" in said, bare.stderr
    assert re.search(r"\(\d+ failed now\)", said), said


def test_api_batches_and_wait_resumes_after_submit_timeout(
    worker: WorkerProcess,
    api: httpx.Client,
    service_env: dict[str, str],
    text_images: dict[str, Path],
) -> None:
    """A batch request without a name gets one back; `ocrq submit --wait --timeout` that runs
    out says how to go on, and `ocrq wait` does."""
    jobs = [{"image": {"path": str(text_images[n])}} for n in ("hello", "word")]
    answer = api.post("/jobs/batch", json={"jobs": jobs})
    assert answer.status_code == 202, answer.text
    batch = answer.json()["batch"]
    uuid.UUID(batch)
    ids = [j["job_id"] for j in answer.json()["jobs"]]
    assert ocrq(service_env, "wait", *ids, "--timeout", "150").returncode == 0
    summary = api.get(f"/batches/{batch}").json()
    assert summary["final"] and summary["jobs"] == {"done": 2}
    with OcrqClient(str(api.base_url), token=TOKEN) as ocr:  # the producers' HTTP client
        assert ocr.batch(batch)["jobs"] == {"done": 2}
        assert ocr.retry(batch=batch) == []  # nothing failed
        one = ocr.submit(str(text_images["word"]), batch=batch)
        assert ocr.wait([one], timeout=150)[0]["batch"] == batch
    assert {api.get(f"/jobs/{i}").json()["batch"] for i in ids} == {batch}

    named = f"resume-{uuid.uuid4().hex[:6]}"
    cut = ocrq(
        service_env, "submit", "--batch", named, str(text_images["invoice"]), "--wait",
        "--timeout", "0",
    )  # fmt: skip
    assert cut.returncode == 3 and f"ocrq wait {named}" in cut.stderr, cut.stderr
    resumed = ocrq(service_env, "wait", named, "--timeout", "150")
    assert resumed.returncode == 0 and "done: 1, failed: 0, total: 1" in resumed.stderr
    unknown = ocrq(service_env, "wait", f"no-such-{uuid.uuid4().hex[:6]}")
    assert unknown.returncode == 4
    # says why a name a producer just sent may not be known yet (a send_task job has no row
    # until a worker takes it), and where to wait meanwhile
    said = " ".join(unknown.stderr.split())
    assert "gets its row when a worker takes it" in said and "AsyncResult" in said, said


def test_a_late_copy_of_an_old_message_does_not_run_a_re_run(
    worker: WorkerProcess, service_env: dict[str, str], database_url: str, image_root: Path
) -> None:
    """Redeliveries keep a failed row final; only the re-run's own message runs it again, and
    a copy of the old message arriving after the re-run began is refused by the claim."""
    store = JobStore(get_engine(database_url))
    job_id = str(uuid.uuid4())
    source = str(image_root / "nowhere.png")
    store.enqueue_many([NewJob(job_id, "text", source, reference={"path": source}, batch="claims")])
    assert store.claim(job_id, "text", source, "w", max_attempts=1).run
    store.finish(job_id, status="failed", error="boom")
    assert not store.claim(job_id, "text", source, "w", max_attempts=1).run  # final
    (reopened,) = rerun.reopen_failed(store.engine, job_ids=[job_id])
    assert reopened.retries == 1 and reopened.batch == "claims"
    late = store.claim(job_id, "text", source, "w", max_attempts=1, rerun=0)
    assert not late.run and late.error is None  # the old generation: not run, nothing written
    # The re-run's message runs it: a new attempt, under a cap that counts from the re-run.
    assert store.claim(job_id, "text", source, "w", max_attempts=1, rerun=1).run
    row = store.get([job_id])[job_id]
    assert (row["status"], row["attempts"], row["retries"]) == ("running", 2, 1)
    # Through the worker: an old message (no `retry`) for a re-run row leaves it queued.
    store.finish(job_id, status="failed", error="boom again")
    rerun.reopen_failed(store.engine, job_ids=[job_id])
    app = Celery(broker=service_env["OCRQ_BROKER_URL"])
    stale = app.send_task(
        TASK_NAME, kwargs={"image": {"path": source}, "job_id": job_id}, queue="ocr"
    )
    Budget(60, "stale copy").until(
        "the worker to ignore the stale copy",
        lambda: f"job {job_id} already queued" in worker.text(),
        60,
        detail=lambda: worker.text()[-2000:],
    )
    assert stale.id == job_id or stale.id
    row = store.get([job_id])[job_id]
    assert (row["status"], row["attempts"], row["retries"]) == ("queued", 2, 2)


def test_parquet_is_written_a_chunk_at_a_time(tmp_path: Path) -> None:
    """More rows than one chunk: several row groups, every record once, in order."""
    import pyarrow.parquet as pq

    from ocrq.core import export as exporting

    stamp = "2026-12-02T06:00:00+00:00"
    records = [
        {**dict.fromkeys(exporting.FIELDS), "job_id": f"j{i}", "page": i, "text": f"T{i}",
         "created_at": stamp, "lines": [{"text": f"T{i}", "box": [0, 0, 1, 1]}]}
        for i in range(exporting.CHUNK_ROWS * 2 + 7)
    ]
    out = tmp_path / "rows.parquet"
    done = exporting.write(iter(records), "parquet", out)
    assert done.records == len(records)
    meta = pq.ParquetFile(out).metadata
    assert meta.num_row_groups == 3 and meta.num_rows == len(records)
    table = pq.read_table(out).to_pylist()
    assert [r["job_id"] for r in table] == [r["job_id"] for r in records]
    assert json.loads(table[-1]["lines"])[0]["text"] == table[-1]["text"]


def test_csv_cells_open_as_text_and_md_names_fit_the_file_system(tmp_path: Path) -> None:
    """Two export faults a probe found. CSV cells that begin like a formula (`=HYPERLINK(...)`
    read off a receipt) were written as they are, and a spreadsheet ran them (OWASP's CSV
    injection): they get the leading `'` that makes them text. And `--format md` died with
    ENAMETOOLONG on a long non-ASCII file name (100 characters of Chinese are 300 bytes, past
    the 255 a name may have), losing every later record."""
    from ocrq.core import export as exporting

    stamp = "2026-12-02T06:00:00+00:00"

    def rec(i: int, path: str, text: str) -> dict[str, Any]:
        return {**dict.fromkeys(exporting.FIELDS), "job_id": f"{i:08d}-job", "kind": "image",
                "status": "done", "path": path, "text": text, "created_at": stamp, "lines": []}

    hostile = ['=HYPERLINK("http://x.invalid","pay")', "+1+2", "-3+4", "@SUM(A1)", "\tTAB"]
    records = [rec(i, f"/in/r{i}.png", t) for i, t in enumerate(hostile)]
    records.append(rec(9, "/in/plain.png", "TOTAL 12.50 - paid"))
    table = tmp_path / "out.csv"
    exporting.write(iter(records), "csv", table)
    with table.open(newline="") as fh:
        texts = [r["text"] for r in csv.DictReader(fh)]
    assert texts == ["'" + t for t in hostile] + ["TOTAL 12.50 - paid"]

    long_name = "/in/" + "销售报告" * 40 + ".png"  # 160 characters, 480 bytes
    named = [rec(20, long_name, "one"), rec(21, long_name, "two"), rec(22, "/in/after.png", "3")]
    md = tmp_path / "md"
    done = exporting.write(iter(named), "md", md)
    assert done.files == 3
    names = sorted(p.name for p in md.iterdir())
    assert all(len(n.encode()) <= 255 for n in names) and "after.md" in names, names
    assert sorted(p.read_text() for p in md.iterdir()) == ["3\n", "one\n", "two\n"]
