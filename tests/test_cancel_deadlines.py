"""Cancel, deadlines, callbacks and retention (issue 30), through a real worker, Redis,
PostgreSQL, the api as users start it, a producer's own Celery worker for its link callbacks,
and a local HTTP server for webhooks and for an image that arrives only when the test says.

What is set up before the worker starts (so nothing depends on timing): jobs cancelled while
their messages wait in Redis, a job whose Celery `expires` passes before any worker sees it, a
job re-sent without `expires` whose row's deadline has passed, and rows and uploads backdated
in SQL for the worker's retention pass at start-up.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery, signature
from sqlalchemy import text

from ocrq.api.client import Client, Delivery
from ocrq.client import Client as HttpClient
from ocrq.client import OcrqError
from ocrq.core import batch_hooks
from ocrq.core.contract import JobRequest
from ocrq.core.db import get_engine
from ocrq.core.requeue import resend
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore, NewJob, now
from ocrq.worker.retention_pass import RetentionPass, day_key
from tests.conftest import BIN, WorkerProcess
from tests.test_api import Uvicorn
from tests.waiting import Budget

QUEUE = f"ocr-cancel-{uuid.uuid4().hex[:6]}"
CALLBACK_QUEUE = f"callbacks-{uuid.uuid4().hex[:6]}"
SECRET = "whsec-" + uuid.uuid4().hex
TOKEN = "cancel-token-" + uuid.uuid4().hex
DAY = dt.timedelta(days=1)
HOUR = dt.timedelta(hours=1)

# The producer's own Celery app and worker: the tasks a job's link and link_error call.
CALLBACK_APP = """
import json, os
from celery import Celery

app = Celery("callbacks", broker=os.environ["CB_BROKER"])
OUT = os.environ["CB_OUT"]

def _write(entry):
    with open(OUT, "a") as f:
        f.write(json.dumps(entry) + "\\n")

@app.task(name="cbtest.done")
def done(result):  # link: the job's result, what AsyncResult(job_id).get() returns
    _write({"kind": "done", "result": result})

@app.task(name="cbtest.failed")
def failed(task_id):  # link_error of a task this worker does not know: called with its id
    _write({"kind": "failed", "task_id": task_id})
"""


@dataclass
class Hooks:
    """A local HTTP server: POST /hook answers 500 first, then 200, recording every call
    (POSTs to any other path: 200, recorded in `elsewhere`); GET /slow.png serves `image` once
    `gate` is set."""

    image: bytes
    gate: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    elsewhere: list[tuple[str, bytes]] = field(default_factory=list)
    slow_requested: threading.Event = field(default_factory=threading.Event)

    def serve(self) -> ThreadingHTTPServer:
        hooks = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.path != "/hook":
                    hooks.elsewhere.append((self.path, body))
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                hooks.calls.append((dict(self.headers.items()), body))
                self.send_response(500 if len(hooks.calls) == 1 else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                hooks.slow_requested.set()
                hooks.gate.wait(120)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(hooks.image)))
                self.end_headers()
                self.wfile.write(hooks.image)

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@dataclass
class Scene:
    env: dict[str, str]
    client: Client
    store: JobStore
    worker: WorkerProcess
    api: Uvicorn
    hooks: Hooks
    hook_url: str
    ids: dict[str, str]
    uploads: dict[str, Path]
    images: dict[str, Path]
    budget: Budget
    results: Celery  # the worker's result backend, as a producer reads it


def _ocrq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "ocrq"), *args], env=env, capture_output=True, text=True, timeout=120
    )


def _backdate(store: JobStore, job_id: str, status: str, finished: dt.datetime | None) -> None:
    with store.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE ocr_jobs SET status = :s, finished_at = :f, created_at = :c WHERE id = :i"
            ),
            {"s": status, "f": finished, "c": (finished or now()) - DAY, "i": job_id},
        )


def _upload(folder: Path, age: dt.timedelta) -> Path:
    digest = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    path = folder / digest[:2] / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not really an image")
    stamp = (dt.datetime.now(dt.UTC) - age).timestamp()
    os.utime(path, (stamp, stamp))
    return path


def _request(path: Path) -> JobRequest:
    return JobRequest.model_validate({"image": {"path": str(path)}})


@pytest.fixture(scope="module")
def scene(
    service_env: dict[str, str],
    text_images: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Scene]:
    budget = Budget(360, "cancel and deadlines")
    tmp = tmp_path_factory.mktemp("cancel")
    upload_dir = tmp / "uploads"
    hooks = Hooks(text_images["hello"].read_bytes())
    server = hooks.serve()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    env = {
        **{k: v for k, v in service_env.items() if not k.startswith("OCRQ_API_")},
        "OCRQ_QUEUE": QUEUE,
        "OCRQ_LINK_TASKS": "cbtest.*",
        "OCRQ_LINK_QUEUES": CALLBACK_QUEUE,
        "OCRQ_WEBHOOK_SECRET": SECRET,
        "OCRQ_WEBHOOK_BACKOFF_S": "0.2",
        "OCRQ_URL_ALLOW_NETWORKS": "127.0.0.1/32",
        "OCRQ_RETENTION_DAYS": "30",
        "OCRQ_UPLOAD_DIR": str(upload_dir),
        "OCRQ_API_TOKEN": TOKEN,
    }
    settings = Settings(
        broker_url=env["OCRQ_BROKER_URL"], database_url=env["OCRQ_DATABASE_URL"], queue=QUEUE
    )
    client = Client(settings)
    store = JobStore(get_engine(settings.database_url))
    started = now()
    ids: dict[str, str] = {}

    # Cancelled while queued: their messages wait in Redis for the worker.
    sent = client.submit_many([_request(text_images[n]) for n in ("hello", "invoice", "word")])
    ids["cancel_a"], ids["cancel_b"], ids["kept"] = (s.job_id for s in sent)
    cancelled = _ocrq(env, "cancel", ids["cancel_a"], ids["cancel_b"])
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled 2 of 2" in cancelled.stderr

    # A batch cancelled while queued (`ocrq cancel --batch`), beside a batch left alone.
    doomed, spared = f"doomed-{uuid.uuid4().hex[:6]}", f"spared-{uuid.uuid4().hex[:6]}"
    in_batch = [
        JobRequest.model_validate({"image": {"path": str(text_images[n])}, "batch": b})
        for n, b in (("hello", doomed), ("word", doomed), ("hello", spared))
    ]
    ids["doomed_a"], ids["doomed_b"], ids["spared"] = (
        s.job_id for s in client.submit_many(in_batch)
    )
    ids["doomed"], ids["spared_batch"] = doomed, spared
    by_batch = _ocrq(env, "cancel", "--batch", doomed)
    assert by_batch.returncode == 0, by_batch.stderr
    assert f"cancelled 2 job(s) of batch {doomed}" in by_batch.stderr

    # Deadlines: Celery's `expires` passes before a worker sees the message; a far one does
    # not; a re-send (as `ocrq requeue` makes, no `expires`) of a row whose deadline passed.
    # Both with a webhook: an expired job's is sent like any final job's.
    soon = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    (expired,) = client.submit_many(
        [_request(text_images["hello"])], [Delivery(soon, f"{base}/expired-hook")]
    )
    (far,) = client.submit_many(
        [_request(text_images["word"])], [Delivery(started + dt.timedelta(hours=1))]
    )
    ids["expired"], ids["far"] = expired.job_id, far.job_id
    resent = str(uuid.uuid4())
    source = str(text_images["invoice"])
    past = started - dt.timedelta(seconds=1)
    reference = {"path": source}
    store.enqueue_many(
        [
            NewJob(
                resent, "text", source, reference=reference, expires_at=past,
                callback_url=f"{base}/expired-hook",
            )
        ]
    )
    resend(client.app, settings, JobRequest.model_validate({"image": reference, "job_id": resent}))
    ids["resent_expired"] = resent

    # Retention: rows and uploads backdated; only final ones past 30 days may go.
    uploads = {
        "old_unreferenced": _upload(upload_dir, 40 * DAY),
        "old_referenced": _upload(upload_dir, 40 * DAY),
        "fresh_unreferenced": _upload(upload_dir, dt.timedelta(hours=1)),
    }
    for name, status, finished, src in (
        ("old_done", "done", started - 40 * DAY, "/gone/a.png"),
        ("old_cancelled", "cancelled", started - 31 * DAY, "/gone/b.png"),
        ("old_queued", "queued", None, str(uploads["old_referenced"])),
        ("recent_done", "done", started - 2 * DAY, "/kept/c.png"),
    ):
        ids[name] = str(uuid.uuid4())
        store.enqueue(ids[name], "text", src)
        _backdate(store, ids[name], status, finished)

    # Batch webhooks waiting when the worker starts: one an older ocrq kept in the broker's
    # Redis, one whose batch ended in a worker that died before it looked (both batches done
    # an hour ago: the worker's first sweep sends them), and one registered 40 days ago for a
    # batch no job ever named (retention drops it).
    hooked = {k: f"{k}-{uuid.uuid4().hex[:6]}" for k in ("legacy", "orphan", "stale")}
    for kind in ("legacy", "orphan"):
        ids[f"{kind}_job"] = str(uuid.uuid4())
        store.enqueue(ids[f"{kind}_job"], "text", "/gone/hooked.png", batch=hooked[kind])
        _backdate(store, ids[f"{kind}_job"], "done", started - dt.timedelta(hours=1))
    redis.Redis.from_url(env["OCRQ_BROKER_URL"]).hset(
        batch_hooks.LEGACY_KEY, hooked["legacy"], f"{base}/start-hook"
    )
    for kind, age in (("orphan", dt.timedelta(minutes=2)), ("stale", 40 * DAY)):
        batch_hooks.register(store.engine, hooked[kind], f"{base}/start-hook")
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE ocr_batch_hooks SET registered_at = :t WHERE batch = :b"),
                {"t": started - age, "b": hooked[kind]},
            )
    ids.update({f"{k}_batch": v for k, v in hooked.items()})

    budget.until("the first deadline to pass", lambda: dt.datetime.now(dt.UTC) > soon, 10)
    # The fleet's last pass was over a day ago (another test's runtime may have taken today's).
    redis.Redis.from_url(env["OCRQ_BROKER_URL"]).delete(day_key(env["OCRQ_DATABASE_URL"]))
    worker = WorkerProcess(env, tmp / "ocrq.worker.log", "--concurrency", "4").wait_ready(
        min(120, budget.left())
    )
    api = Uvicorn(env, tmp / "ocrq.api.log").wait_up()
    try:
        yield Scene(
            env, client, store, worker, api, hooks, f"{base}/hook", ids, uploads, text_images,
            budget, Celery(broker=env["OCRQ_BROKER_URL"], backend=env["OCRQ_BROKER_URL"]),
        )
    finally:
        hooks.gate.set()
        api.stop()
        worker.stop()
        server.shutdown()


def _status(scene: Scene, job_id: str) -> str | None:
    row = scene.store.get([job_id]).get(job_id)
    return row["status"] if row else None


def _row(scene: Scene, job_id: str) -> dict[str, Any]:
    return scene.store.get([job_id])[job_id]


def test_cancelled_queued_jobs_never_run(scene: Scene) -> None:
    ids = scene.ids
    scene.budget.until(
        "the job not cancelled to finish", lambda: _status(scene, ids["kept"]) == "done", 90,
        scene.worker.text,
    )
    # Their messages reached the task, whose claim refused them: Celery has each as failed.
    results = [scene.results.AsyncResult(ids[k]) for k in ("cancel_a", "cancel_b")]
    scene.budget.until(
        "the cancelled jobs' messages to be taken and refused",
        lambda: all(r.state == "FAILURE" for r in results), 60, scene.worker.text,
    )
    for key in ("cancel_a", "cancel_b"):
        row = _row(scene, ids[key])
        assert row["status"] == "cancelled"
        assert row["attempts"] == 0 and row["started_at"] is None and row["text"] is None
    assert "cancelled by request" in str(results[0].result)
    # Final already: not cancelled (exit 1); unknown: exit 4.
    again = _ocrq(scene.env, "cancel", "--json", ids["kept"])
    assert again.returncode == 1 and json.loads(again.stdout)["status"] == "done"
    assert _ocrq(scene.env, "cancel", str(uuid.uuid4())).returncode == 4
    for args, why in (([], "one of them"), ([ids["kept"], "--batch", "b"], "not both")):
        usage = _ocrq(scene.env, "cancel", *args)
        assert usage.returncode == 2 and why in usage.stderr, usage.stderr
    status = _ocrq(scene.env, "status", "--json", ids["cancel_a"])
    assert status.returncode == 1 and json.loads(status.stdout)["status"] == "cancelled"
    listed = _ocrq(scene.env, "jobs", "--status", "cancelled", "--json", "--limit", "100")
    assert {ids["cancel_a"], ids["cancel_b"]} <= {
        json.loads(line)["job_id"] for line in listed.stdout.splitlines()
    }


def test_a_cancelled_batch_never_runs_and_no_other_batch_is_touched(scene: Scene) -> None:
    ids = scene.ids
    results = [scene.results.AsyncResult(ids[k]) for k in ("doomed_a", "doomed_b")]
    scene.budget.until(
        "the other batch's job to finish and the cancelled batch's messages to be refused",
        lambda: _status(scene, ids["spared"]) == "done"
        and all(r.state == "FAILURE" for r in results),
        90, scene.worker.text,
    )
    for key in ("doomed_a", "doomed_b"):
        row = _row(scene, ids[key])
        assert row["status"] == "cancelled" and row["attempts"] == 0 and row["text"] is None
    headers = {"Authorization": f"Bearer {TOKEN}"}
    base = f"http://127.0.0.1:{scene.api.port}"
    # Cancelled already: the batch's summary, final, nothing more cancelled.
    again = httpx.delete(f"{base}/batches/{ids['doomed']}", headers=headers, timeout=30)
    assert again.status_code == 200, again.text
    body = again.json()
    assert body["cancelled"] == 0 and body["final"] is True
    assert body["jobs"] == {"cancelled": 2}
    spared = httpx.get(f"{base}/batches/{ids['spared_batch']}", headers=headers, timeout=30)
    assert spared.json()["jobs"] == {"done": 1}
    assert httpx.delete(f"{base}/batches/nope-{uuid.uuid4()}", headers=headers).status_code == 404
    assert _ocrq(scene.env, "cancel", "--batch", f"nope-{uuid.uuid4()}").returncode == 4
    # `ocrq wait` exits as `submit --wait` would: 1 for a batch that ended cancelled.
    waited = _ocrq(scene.env, "wait", ids["doomed"], "--timeout", "30")
    assert waited.returncode == 1 and "cancelled: 2" in waited.stderr, waited.stderr
    assert _ocrq(scene.env, "wait", ids["spared_batch"], "--timeout", "30").returncode == 0

    # Through the api: a batch whose jobs wait in a queue no worker reads (still queued).
    idle = Client(
        scene.client.settings.model_copy(update={"queue": f"nobody-{uuid.uuid4().hex[:6]}"})
    )
    waiting_batch, other_batch = f"api-{uuid.uuid4().hex[:6]}", f"other-{uuid.uuid4().hex[:6]}"
    sent = idle.submit_many(
        [
            JobRequest.model_validate({"image": {"path": str(scene.images[n])}, "batch": b})
            for n, b in (("hello", waiting_batch), ("word", waiting_batch), ("word", other_batch))
        ]
    )
    cancelled = httpx.delete(f"{base}/batches/{waiting_batch}", headers=headers, timeout=30)
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["cancelled"] == 2 and cancelled.json()["jobs"] == {"cancelled": 2}
    assert [_status(scene, s.job_id) for s in sent] == ["cancelled", "cancelled", "queued"]


def test_jobs_past_their_deadline_never_run(scene: Scene) -> None:
    ids = scene.ids
    scene.budget.until(
        "both past-deadline jobs to be expired and the far one done",
        lambda: [_status(scene, ids[k]) for k in ("expired", "resent_expired", "far")]
        == ["expired", "expired", "done"],
        90, scene.worker.text,
    )
    for key in ("expired", "resent_expired"):
        row = _row(scene, ids[key])
        assert "deadline" in row["error"] and row["text"] is None and row["started_at"] is None
    assert scene.results.AsyncResult(ids["expired"]).state == "REVOKED"  # Celery's own

    # Each fired its job.finished, once (neither did before), without the server's path.
    def hooked() -> list[dict[str, Any]] | None:
        bodies = [json.loads(b) for p, b in scene.hooks.elsewhere if p == "/expired-hook"]
        return bodies if len(bodies) >= 2 else None

    bodies = scene.budget.until("the expired jobs' webhooks", hooked, 30, scene.worker.text)
    assert sorted(b["job_id"] for b in bodies) == sorted([ids["expired"], ids["resent_expired"]])
    assert all(b["event"] == "job.finished" and b["status"] == "expired" for b in bodies)
    assert all("path" not in b for b in bodies)


def test_api_cancel_of_a_running_job_drops_only_its_result(scene: Scene) -> None:
    http = HttpClient(f"http://127.0.0.1:{scene.api.port}", TOKEN)
    slow_url = scene.hook_url.replace("/hook", "/slow.png")
    slow = http.submit({"url": slow_url})
    other = http.submit(scene.images["invoice"])
    scene.budget.until(
        "the slow job to be running, its image requested",
        lambda: scene.hooks.slow_requested.is_set() and _status(scene, slow) == "running", 60,
        scene.worker.text,
    )
    row = http.cancel(slow)
    assert row["status"] == "cancelled" and row["cancelled"] is True
    scene.hooks.gate.set()  # the image arrives: the job runs on, its result is not stored
    scene.budget.until(
        "the slow job's task to end and the other job to finish",
        lambda: scene.results.AsyncResult(slow).state == "FAILURE"
        and _status(scene, other) == "done", 60, scene.worker.text,
    )
    row = http.get(slow)
    assert row["status"] == "cancelled" and row["text"] is None
    assert "INVOICE" in http.get(other)["text"]
    assert http.cancel(slow)["cancelled"] is False  # cancelled again: its row, 200
    with pytest.raises(OcrqError) as final:
        http.cancel(other)
    assert final.value.status == 409
    with pytest.raises(OcrqError) as unknown:
        http.cancel(str(uuid.uuid4()))
    assert unknown.value.status == 404


def test_webhook_is_signed_and_retried_after_a_500(scene: Scene) -> None:
    http = HttpClient(f"http://127.0.0.1:{scene.api.port}", TOKEN)
    job = http.submit(scene.images["hello"], callback_url=scene.hook_url)
    scene.budget.until(
        "the webhook's first call (500) and its retry", lambda: len(scene.hooks.calls) >= 2, 60,
        scene.worker.text,
    )
    for headers, body in scene.hooks.calls[:2]:
        stamp, mac = (part.split("=", 1)[1] for part in headers["X-Ocrq-Signature"].split(","))
        expected = hmac.new(SECRET.encode(), f"{stamp}.".encode() + body, hashlib.sha256)
        assert hmac.compare_digest(mac, expected.hexdigest())
        sent = json.loads(body)
        assert sent["job_id"] == job and sent["status"] == "done" and "HELLO" in sent["text"]
    assert http.get(job)["callback_url"] == scene.hook_url


def test_batch_and_document_webhooks_are_sent_once_each(scene: Scene) -> None:
    from PIL import Image

    from tests.pdfs import image_pdf

    folder = scene.images["hello"].parent
    pdf = image_pdf(
        [Image.open(scene.images[n]) for n in ("hello", "invoice")],
        folder / f"hooked-{uuid.uuid4().hex[:6]}.pdf",
    )
    name = f"hooked-{uuid.uuid4().hex[:6]}"
    body = {
        "batch": name,
        "callback_url": scene.hook_url,
        "jobs": [
            {"image": {"path": str(scene.images["word"])}},
            {"image": {"path": str(pdf)}, "callback_url": scene.hook_url},
        ],
    }
    base = f"http://127.0.0.1:{scene.api.port}"
    accepted = httpx.post(
        f"{base}/jobs/batch", json=body, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30
    )
    assert accepted.status_code == 202, accepted.text
    document = accepted.json()["jobs"][1]["job_id"]

    def events() -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for headers, raw in list(scene.hooks.calls):
            sent = json.loads(raw)
            if sent.get("batch") == name or sent.get("job_id") == document:
                stamp, mac = (p.split("=", 1)[1] for p in headers["X-Ocrq-Signature"].split(","))
                expected = hmac.new(SECRET.encode(), f"{stamp}.".encode() + raw, hashlib.sha256)
                assert hmac.compare_digest(mac, expected.hexdigest())
                out.setdefault(sent["event"], []).append(sent)
        return out

    scene.budget.until(
        "the document's and the batch's webhooks",
        lambda: {"document.finished", "batch.finished"} <= events().keys(), 120,
        scene.worker.text,
    )
    got = events()
    assert "job.finished" not in got  # the document's split is not what its producer awaits
    (doc,) = {json.dumps(e, sort_keys=True) for e in got["document.finished"]}  # one (or retried)
    doc_body = json.loads(doc)
    assert doc_body["document_id"] == document and doc_body["status"] == "done"
    assert doc_body["pages"] == 2 and "INVOICE" in doc_body["text"]
    (batch,) = {json.dumps(e, sort_keys=True) for e in got["batch.finished"]}
    batch_body = json.loads(batch)
    assert batch_body["batch"] == name and batch_body["final"] is True
    assert batch_body["jobs"] == {"done": 3}  # the image and the document's two pages
    assert batch_body["documents"] == {"done": 1}


def test_celery_links_call_the_producers_tasks(scene: Scene, tmp_path: Path) -> None:
    (tmp_path / "cbtest.py").write_text(CALLBACK_APP)
    out = tmp_path / "calls.jsonl"
    out.touch()
    broker = scene.env["OCRQ_BROKER_URL"]
    env = {**scene.env, "PYTHONPATH": str(tmp_path), "CB_BROKER": broker, "CB_OUT": str(out)}
    log = (tmp_path / "callbacks.log").open("w")
    callbacks = subprocess.Popen(
        [str(BIN / "celery"), "-A", "cbtest", "worker", "-Q", CALLBACK_QUEUE, "-P", "solo",
         "--without-gossip", "--without-mingle", "--without-heartbeat"],
        env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    producer = Celery(broker=broker)  # a bare producer: Celery alone
    try:
        done = signature("cbtest.done", queue=CALLBACK_QUEUE)
        failed = signature("cbtest.failed", queue=CALLBACK_QUEUE)
        good = producer.send_task(
            "ocrq.recognize", kwargs={"image": {"path": str(scene.images["hello"])}},
            queue=QUEUE, link=done, link_error=failed,
        ).id
        bad = producer.send_task(
            "ocrq.recognize", kwargs={"image": {"path": "/no/such/image.png"}},
            queue=QUEUE, link=done, link_error=failed,
        ).id
        refused = producer.send_task(
            "ocrq.recognize", kwargs={"image": {"path": str(scene.images["word"])}},
            queue=QUEUE, link=signature("otherapp.anything", queue=CALLBACK_QUEUE),
        ).id

        def calls() -> list[dict[str, Any]]:
            return [json.loads(line) for line in out.read_text().splitlines()]

        scene.budget.until(
            "the link and the link_error to be called", lambda: len(calls()) >= 2, 90,
            lambda: scene.worker.text()[-3000:] + (tmp_path / "callbacks.log").read_text(),
        )
        scene.budget.until(
            "the job with a link not allowed to fail", lambda: _status(scene, refused), 30
        )
    finally:
        os.killpg(callbacks.pid, 15)
        callbacks.wait(30)
        log.close()
    by_kind = {c["kind"]: c for c in calls()}
    assert by_kind["done"]["result"]["job_id"] == good
    assert "HELLO" in by_kind["done"]["result"]["text"]
    assert by_kind["failed"]["task_id"] == bad
    row = _row(scene, refused)
    assert row["status"] == "failed" and "OCRQ_LINK_TASKS" in row["error"]
    assert row["started_at"] is not None and row["text"] is None  # refused before any intake
    assert len(calls()) == 2  # nothing was called for it


def test_batch_webhooks_waiting_at_a_workers_start_are_sent_or_pruned(scene: Scene) -> None:
    """Kept in PostgreSQL since migrations/0011: one left in Redis by an older ocrq is moved
    there, and a worker's first sweep sends those whose batch ended while no worker looked."""
    ids = scene.ids
    sent = {ids["legacy_batch"], ids["orphan_batch"]}

    def finished() -> list[str]:
        return [
            json.loads(body)["batch"] for path, body in list(scene.hooks.elsewhere)
            if path == "/start-hook" and json.loads(body)["event"] == "batch.finished"
        ]

    scene.budget.until(
        "the webhooks of the batches that ended before the worker started",
        lambda: sent <= set(finished()), 60, scene.worker.text,
    )
    scene.budget.until(
        "the worker's retention pass at start-up",
        lambda: "retention (older than 30 days): deleted" in scene.worker.text(), 60,
        scene.worker.text,
    )
    assert sorted(finished()) == sorted(sent)  # once each, and not the stale one
    assert "moved 1 batch webhook(s) from the broker's Redis" in scene.worker.text()
    broker = redis.Redis.from_url(scene.env["OCRQ_BROKER_URL"])
    assert not broker.hexists(batch_hooks.LEGACY_KEY, ids["legacy_batch"])
    with scene.store.engine.connect() as conn:
        left = conn.execute(
            text("SELECT batch FROM ocr_batch_hooks WHERE batch IN (:a, :b, :c)"),
            {"a": ids["legacy_batch"], "b": ids["orphan_batch"], "c": ids["stale_batch"]},
        ).all()
    assert left == []


def test_retention_deletes_only_old_final_rows_and_unreferenced_uploads(scene: Scene) -> None:
    ids, uploads = scene.ids, scene.uploads
    scene.budget.until(
        "the worker's retention pass at start-up",
        lambda: _status(scene, ids["old_done"]) is None, 60, scene.worker.text,
    )
    assert _status(scene, ids["old_cancelled"]) is None
    assert _status(scene, ids["old_queued"]) == "queued"  # in flight: never touched
    assert _status(scene, ids["recent_done"]) == "done"
    assert not uploads["old_unreferenced"].exists()
    assert uploads["old_referenced"].exists() and uploads["fresh_unreferenced"].exists()
    assert "retention (older than 30 days): deleted" in scene.worker.text()

    # `ocrq prune`: the same rule on demand, any age.
    assert _ocrq(scene.env, "prune", "--older-than", "1d").returncode == 0
    assert _status(scene, ids["recent_done"]) is None
    assert _status(scene, ids["old_queued"]) == "queued"
    assert uploads["old_referenced"].exists()
    bad = _ocrq(scene.env, "prune", "--older-than", "soon")
    assert bad.returncode == 2 and "--older-than" in bad.stderr


def test_prune_where_the_upload_folder_is_read_only_prunes_rows_and_says_why(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped workers mount the upload folder read-only: a prune there deletes the rows,
    leaves the files (a prune where the folder is writable deletes them later: unreferenced
    by then) and says why, instead of failing the pass after the rows were gone. The
    read-only mount itself cannot be made here (no mount rights): `os.unlink` answers as on
    one (EROFS)."""
    import errno

    from ocrq.core import retention

    store = JobStore(get_engine(database_url))
    old = str(uuid.uuid4())
    store.enqueue(old, "text", "/gone/ro.png")
    _backdate(store, old, "done", now() - 40 * DAY)
    files = [_upload(tmp_path / "uploads", 40 * DAY) for _ in range(2)]

    def read_only(path: Any, *_: Any) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(retention.os, "unlink", read_only)
    monkeypatch.setattr(retention.os, "rename", read_only)
    pruned = retention.prune(store.engine, now() - 30 * DAY, tmp_path / "uploads")
    assert _status_of(store, old) is None and pruned.jobs >= 1
    assert pruned.uploads == 0 and all(f.exists() for f in files)
    assert pruned.uploads_left is not None and "Read-only file system" in pruned.uploads_left
    monkeypatch.undo()  # where the folder is writable: the same files go
    again = retention.prune(store.engine, now() - 30 * DAY, tmp_path / "uploads")
    assert again.uploads == 2 and again.uploads_left is None
    assert not any(f.exists() for f in files)


def _status_of(store: JobStore, job_id: str) -> str | None:
    row = store.get([job_id]).get(job_id)
    return row["status"] if row else None


def test_one_retention_pass_at_a_time_its_lock_pinned_to_one_transaction(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daily pass of one worker prunes while another's skips (None). During the pass the
    lock's session stays in the transaction that took it (what PgBouncer's transaction mode
    needs for the unlock to reach it; tests/test_pgbouncer.py); the lock is free afterwards."""
    from ocrq.core import retention

    engine = get_engine(database_url)
    seen: dict[str, Any] = {}
    real_prune = retention.prune

    def observed(db: Any, cutoff: dt.datetime, upload_dir: Path | None, **kwargs: Any) -> Any:
        with db.connect() as conn:
            seen["holders"] = conn.execute(text(
                "SELECT a.state FROM pg_locks l "
                "JOIN pg_stat_activity a USING (pid) "
                "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
                "AND l.classid::bigint = :high AND l.objid::bigint = :low "
                "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ), {"high": retention.LOCK_KEY >> 32, "low": retention.LOCK_KEY & 0xFFFFFFFF}
            ).scalars().all()
            # (a bigint key is (classid, objid): its high and low halves)
        seen["rival"] = retention.prune_once_locked(db, cutoff, upload_dir)
        return real_prune(db, cutoff, upload_dir, **kwargs)

    # A key of this test's own: a worker of this session pruning at its start cannot take it.
    monkeypatch.setattr(retention, "LOCK_KEY", int.from_bytes(os.urandom(6)) + 1)
    with monkeypatch.context() as patched:
        patched.setattr(retention, "prune", observed)
        pruned = retention.prune_once_locked(engine, now() - 3650 * DAY, None)
    assert pruned is not None and seen["rival"] is None  # the other worker skipped
    assert seen["holders"] == ["idle in transaction"], seen
    assert retention.prune_once_locked(engine, now() - 3650 * DAY, None) is not None  # freed


def test_the_fleet_prunes_once_a_day_not_once_a_process(
    broker_url: str, database_url: str
) -> None:
    """Processes replaced at every recycle each started a pass; now the first to ask after the
    fleet's day is over takes it and the others do not, through a key in the broker's Redis:
    held two hours while the pass runs (one cut short by its process's end is tried again
    then), a day once it is done, given back when it failed. Without Redis a process keeps its
    own day (a pass at start, then daily)."""
    from ocrq.worker import retention_pass

    settings = Settings(broker_url=broker_url, database_url=database_url, retention_days=30)
    db = get_engine(database_url)
    client = redis.Redis.from_url(broker_url)
    key = day_key(database_url)
    client.delete(key)
    first, second = RetentionPass(db, settings), RetentionPass(db, settings)
    assert first._due() and not second._due()
    assert retention_pass.CLAIM_S - 60 < client.ttl(key) <= retention_pass.CLAIM_S
    second._settle(False)  # not its claim: the key is not its to give back
    assert client.exists(key)
    first._settle(True)  # done: the fleet's day
    assert 86_000 < client.ttl(key) <= 86_400
    assert not first._due() and not second._due()

    client.delete(key)  # a day later
    assert second._due()
    second._settle(False)  # failed: given back, the next to ask tries again
    assert not client.exists(key) and first._due()
    first._settle(True)
    # One key per database, its default port written or not; the password is no part of it.
    assert day_key("postgresql://u@db.example/ocrq") == day_key(
        "postgresql+psycopg://u:secret@db.example:5432/ocrq"
    )
    assert day_key(database_url.rsplit("/", 1)[0] + "/another_fleet") != key

    alone = RetentionPass(db, settings.model_copy(update={"broker_url": "amqp://127.0.0.1//"}))
    assert alone._due()
    alone._own_last = time.monotonic()
    assert not alone._due()
    alone._own_last = time.monotonic() - 86_401
    assert alone._due()
    for rp in (first, second, alone):
        rp.stop()  # never started: closes its Redis client


def test_prune_dry_run_counts_and_a_cutoff_under_an_hour_needs_yes(
    private_database: str, broker_url: str, tmp_path: Path
) -> None:
    """`ocrq prune --older-than 0s` deleted every finished job at once, with no way to look
    first. `--dry-run` says what the prune would delete, deleting nothing, and the prune then
    deletes exactly that; a cutoff under one hour is refused (exit 2) unless `--yes` is given.
    A database of its own: the counts asserted are this test's rows, not the session's."""
    store = JobStore(get_engine(private_database))
    env = {**os.environ, "OCRQ_DATABASE_URL": private_database, "OCRQ_BROKER_URL": broker_url,
           "OCRQ_UPLOAD_DIR": str(tmp_path / "uploads")}
    rows: dict[str, tuple[str, dt.datetime | None]] = {
        "old_done": ("done", now() - 2 * HOUR),
        "old_failed": ("failed", now() - 3 * HOUR),
        "recent_done": ("done", now() - dt.timedelta(minutes=5)),
        "old_queued": ("queued", None),
    }
    ids = {}
    for name, (status, finished) in rows.items():
        ids[name] = str(uuid.uuid4())
        store.enqueue(ids[name], "text", f"/gone/{name}.png")
        _backdate(store, ids[name], status, finished)
    old_files = [_upload(tmp_path / "uploads", 2 * HOUR) for _ in range(2)]
    fresh = _upload(tmp_path / "uploads", dt.timedelta(minutes=5))

    def left() -> dict[str, str | None]:
        return {name: _status_of(store, job_id) for name, job_id in ids.items()}

    everything = left()
    dry = _ocrq(env, "prune", "--older-than", "1h", "--dry-run")
    said = " ".join(dry.stderr.split())
    assert dry.returncode == 0, dry.stderr
    assert "would delete 2 job(s), 0 document(s) and 2 upload(s)" in said, said
    assert "nothing deleted" in said, said
    assert left() == everything and all(f.exists() for f in old_files)
    # A dry run needs no --yes, whatever the cutoff.
    dry_all = _ocrq(env, "prune", "--older-than", "0s", "--dry-run")
    assert "would delete 3 job(s), 0 document(s) and 3 upload(s)" in dry_all.stderr, dry_all

    short = _ocrq(env, "prune", "--older-than", "0s")
    said = " ".join(short.stderr.split())
    assert short.returncode == 2, short.stderr
    assert "under one hour" in said and "--yes" in said and "--dry-run" in said, said
    assert left() == everything and fresh.exists()

    real = _ocrq(env, "prune", "--older-than", "1h")
    said = " ".join(real.stderr.split())
    assert real.returncode == 0 and "deleted 2 job(s), 0 document(s) and 2 upload(s)" in said, said
    assert left() == {**everything, "old_done": None, "old_failed": None}
    assert not any(f.exists() for f in old_files) and fresh.exists()

    forced = _ocrq(env, "prune", "--older-than", "0s", "--yes")
    said = " ".join(forced.stderr.split())
    assert forced.returncode == 0 and "deleted 1 job(s), 0 document(s) and 1 upload(s)" in said
    assert left() == {**everything, "old_done": None, "old_failed": None, "recent_done": None}


def test_prune_keeps_what_a_queued_message_needs_and_its_dry_run_counts_the_uploads_it_frees(
    private_database: str, broker_url: str, tmp_path: Path
) -> None:
    """Two holes of `ocrq prune`. A job cancelled while its message waited in Redis lost its
    row, and a worker then took the message for a new job and ran it (`done`): such a row stays
    while the broker holds its message, and goes once it does not. And `--dry-run` counted 0
    uploads where the prune then deleted them: an upload named only by a row the prune deletes
    is freed by it, and the dry run counts it."""
    store = JobStore(get_engine(private_database))
    queue = f"prune-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "OCRQ_DATABASE_URL": private_database, "OCRQ_BROKER_URL": broker_url,
           "OCRQ_UPLOAD_DIR": str(tmp_path / "uploads"), "OCRQ_QUEUE": queue}
    upload = _upload(tmp_path / "uploads", 2 * HOUR)
    ids = {name: str(uuid.uuid4()) for name in ("waiting", "cancelled", "done")}
    for name, job_id in ids.items():
        store.enqueue(job_id, "text", str(upload) if name == "done" else f"/gone/{name}.png")
        _backdate(store, job_id, "done" if name == "done" else "cancelled", now() - 2 * HOUR)
    producer = Celery("prune-test", broker=broker_url)
    try:
        producer.send_task(
            "ocrq.recognize", kwargs={"image": {"path": "/gone/waiting.png"}},
            task_id=ids["waiting"], queue=queue,
        )
    finally:
        producer.close()

    dry = _ocrq(env, "prune", "--older-than", "1h", "--dry-run")
    said = " ".join(dry.stderr.split())
    assert "would delete 2 job(s), 0 document(s) and 1 upload(s)" in said, said
    real = _ocrq(env, "prune", "--older-than", "1h")
    said = " ".join(real.stderr.split())
    assert real.returncode == 0 and "deleted 2 job(s), 0 document(s) and 1 upload(s)" in said, said
    assert _status_of(store, ids["waiting"]) == "cancelled" and not upload.exists()
    assert _status_of(store, ids["cancelled"]) is None and _status_of(store, ids["done"]) is None

    redis.Redis.from_url(broker_url).delete(queue)  # a worker took the message and dropped it
    again = _ocrq(env, "prune", "--older-than", "1h")
    assert "deleted 1 job(s)" in " ".join(again.stderr.split()), again.stderr
    assert _status_of(store, ids["waiting"]) is None


def test_prune_keeps_an_upload_uploaded_again_while_it_runs(
    database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prune deleted an upload that a new job had just re-used (4 of 4 runs): the api found
    the file, touched it and named it in the new row while the prune, which had listed it as
    old and unreferenced, deleted it. Here the same bytes are uploaded again at the worst
    moment, as the prune's first change to the folder happens: the file survives, fresh."""
    import asyncio

    from ocrq.api.uploads import Uploads
    from ocrq.core import retention

    folder = tmp_path / "uploads"
    uploads = Uploads(folder, 1 << 20)
    data = uuid.uuid4().bytes * 8
    path = asyncio.run(uploads.store_bytes(data))
    stamp = (dt.datetime.now(dt.UTC) - 40 * DAY).timestamp()
    os.utime(path, (stamp, stamp))
    store = JobStore(get_engine(database_url))
    real_rename, real_unlink = os.rename, os.unlink
    raced: list[str] = []

    def uploaded_again_first(real: Any) -> Any:
        def call(*args: Any) -> Any:
            if not raced:
                raced.append(str(args[0]))
                assert asyncio.run(uploads.store_bytes(data)) == path
                store.enqueue(str(uuid.uuid4()), "text", str(path))
            return real(*args)

        return call

    monkeypatch.setattr(retention.os, "rename", uploaded_again_first(real_rename))
    monkeypatch.setattr(retention.os, "unlink", uploaded_again_first(real_unlink))
    pruned = retention.prune(store.engine, now() - 30 * DAY, folder)
    assert raced == [str(path)]  # the race did happen, on this file
    assert path.exists() and path.read_bytes() == data and pruned.uploads == 0
    assert not list(path.parent.glob("*.pruning-*"))
