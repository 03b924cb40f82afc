"""The HTTP api as an operator scripts it (issue 15): uploads, idempotent job ids, batches, bulk
lookups, listing, long-polls, full rows, 503s that leave nothing half-done, readiness, docs.

A real uvicorn process in front of real Redis and PostgreSQL and a real `ocrq worker` whose only
extra root is the upload folder; the failure cases use FastAPI's TestClient against servers
that are not there.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ocrq.api.client import Client
from ocrq.api.http import create_app
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import TEST_PG, WorkerProcess
from tests.servers import free_port
from tests.test_api import Uvicorn

TOKEN = "test-token-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def queue() -> str:
    return f"ocr-apijobs-{uuid.uuid4().hex[:6]}"


@pytest.fixture(scope="module")
def upload_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Outside every OCRQ_ALLOWED_ROOTS folder: the worker reads it only as the upload root."""
    return tmp_path_factory.mktemp("uploads")


@pytest.fixture(scope="module")
def env(service_env: dict[str, str], queue: str, upload_dir: Path) -> dict[str, str]:
    base = {k: v for k, v in service_env.items() if not k.startswith("OCRQ_API_")}
    return {**base, "OCRQ_QUEUE": queue, "OCRQ_UPLOAD_DIR": str(upload_dir)}


@pytest.fixture(scope="module")
def upload_worker(
    env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    log = tmp_path_factory.mktemp("apiworker") / "ocrq.worker.log"
    proc = WorkerProcess(env, log, "--concurrency", "8").wait_ready()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def server(
    env: dict[str, str], upload_worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("apiserver") / "ocrq.api.log"
    uvicorn = Uvicorn({**env, "OCRQ_API_TOKEN": TOKEN}, log).wait_up()
    with httpx.Client(
        base_url=f"http://127.0.0.1:{uvicorn.port}", headers=AUTH, timeout=90
    ) as client:
        yield client
    uvicorn.stop()


def _final(api: httpx.Client, job_id: str, wait: float = 60) -> dict[str, Any]:
    r = api.get(f"/jobs/{job_id}", params={"wait": wait})
    assert r.status_code == 200, r.text
    return r.json()


def test_uploads_reach_the_worker_and_rows_are_whole(
    server: httpx.Client, text_images: dict[str, Path], upload_dir: Path
) -> None:
    hello = text_images["hello"].read_bytes()
    invoice = text_images["invoice"].read_bytes()
    multipart = server.post("/jobs", files={"file": ("a.png", hello, "image/png")})
    raw = server.post(
        "/jobs", content=invoice, headers={"Content-Type": "image/png"}, params={"task": "text"}
    )
    assert multipart.status_code == 202 and raw.status_code == 202, (multipart.text, raw.text)
    for response, data, word in ((multipart, hello, "HELLO"), (raw, invoice, "INVOICE")):
        started = time.monotonic()
        row = _final(server, response.json()["job_id"])
        assert time.monotonic() - started < 60
        assert row["status"] == "done", row
        assert word in row["text"].upper()
        digest = hashlib.sha256(data).hexdigest()
        # Content-addressed, in the shared folder, and read by the worker from there.
        assert row["path"] == str(upload_dir.resolve() / digest[:2] / digest)
        assert row["sha256"] == digest and row["width"] > 0 and row["height"] > 0
        assert row["engine"] == "rapid" and row["worker"] and row["attempts"] == 1
        assert row["batch_id"] and row["task"] == "text" and row["truncated"] is None
        stamps = [dt.datetime.fromisoformat(row[k]) for k in ("created_at", "started_at")]
        assert stamps[0] <= stamps[1] <= dt.datetime.fromisoformat(row["finished_at"])
        assert row["lines"] and row["error"] is None
    # The same bytes again: a new job, the same file.
    again = server.post("/jobs", content=hello, headers={"Content-Type": "image/png"})
    assert again.status_code == 202
    assert _final(server, again.json()["job_id"])["path"] == row_path(upload_dir, hello)
    assert not list((upload_dir / ".incoming").iterdir())  # nothing half-written left


def row_path(upload_dir: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    return str(upload_dir.resolve() / digest[:2] / digest)


def test_job_id_makes_a_retry_idempotent(
    server: httpx.Client, text_images: dict[str, Path], database_url: str
) -> None:
    job_id = str(uuid.uuid4())
    body = {"image": {"path": str(text_images["word"])}, "job_id": job_id}
    first = server.post("/jobs", json=body)
    retry = server.post("/jobs", json={**body, "job_id": job_id.upper()})  # any UUID spelling
    assert first.status_code == 202 and first.json() == {
        "job_id": job_id,
        "created": True,
        "status": "queued",
    }
    assert retry.status_code == 200 and retry.json()["job_id"] == job_id
    assert not retry.json()["created"]
    other = server.post(
        "/jobs", json={"image": {"path": str(text_images["hello"])}, "job_id": job_id}
    )
    assert other.status_code == 409 and other.json()["job_ids"] == [job_id]
    row = _final(server, job_id)
    assert row["status"] == "done" and "STATION" in row["text"].upper()
    assert row["path"] == str(text_images["word"]) and row["attempts"] == 1  # sent once

    # Uploads: the same bytes under the same id are the same job; other bytes are not.
    upload_id = str(uuid.uuid4())
    hello = text_images["hello"].read_bytes()
    files = {"file": ("h.png", hello, "image/png")}
    assert server.post("/jobs", files=files, data={"job_id": upload_id}).status_code == 202
    assert server.post("/jobs", files=files, data={"job_id": upload_id}).status_code == 200
    changed = server.post(
        "/jobs",
        content=hello + b"\0",
        headers={"Content-Type": "image/png"},
        params={"job_id": upload_id},
    )
    assert changed.status_code == 409
    assert _final(server, upload_id)["status"] == "done"


def test_batch_lookup_and_list(
    server: httpx.Client, text_images: dict[str, Path], image_root: Path
) -> None:
    since = dt.datetime.now(dt.UTC).isoformat()
    jobs = [
        {"image": {"path": str(text_images["hello"])}},
        {"image": {"path": str(text_images["invoice"])}, "max_pixels": 1_000_000},
        {"image": {"path": str(image_root / "no-such-file.png")}},
    ]
    r = server.post("/jobs/batch", json={"jobs": jobs})
    assert r.status_code == 202, r.text
    ids = [j["job_id"] for j in r.json()["jobs"]]
    assert len(set(ids)) == 3 and all(j["created"] for j in r.json()["jobs"])

    unknown = str(uuid.uuid4())
    looked = server.post("/jobs/lookup", json={"job_ids": [*ids, unknown], "wait": 60})
    assert looked.status_code == 200
    rows = looked.json()["jobs"]
    assert [r["job_id"] for r in rows] == [*ids, unknown]
    assert [r["status"] for r in rows] == ["done", "done", "failed", "unknown"]
    assert rows[1]["max_pixels"] == 1_000_000 and "not found" in rows[2]["error"]

    failed = server.get("/jobs", params={"status": "failed", "created_after": since}).json()
    assert [j["job_id"] for j in failed["jobs"]] == [ids[2]]
    assert failed["next_cursor"] is None
    # One row a page, newest first, until the cursor runs out: every job once.
    seen, cursor = [], None
    for _ in range(10):
        params: dict[str, Any] = {"created_after": since, "limit": 1}
        if cursor:
            params["cursor"] = cursor
        page = server.get("/jobs", params=params).json()
        seen += [j["job_id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert sorted(seen) == sorted(ids) and len(seen) == 3
    before = server.get("/jobs", params={"created_before": since, "limit": 1000}).json()
    assert not set(ids) & {j["job_id"] for j in before["jobs"]}
    assert server.get("/jobs", params={"cursor": "garbage"}).status_code == 422

    # A batch is recorded all or none: one reused id and no job of it is recorded.
    fresh = str(uuid.uuid4())
    clash = server.post(
        "/jobs/batch",
        json={
            "jobs": [
                {"image": {"path": str(text_images["word"])}, "job_id": fresh},
                {"image": {"path": str(text_images["word"])}, "job_id": ids[0]},
            ]
        },
    )
    assert clash.status_code == 409 and clash.json()["job_ids"] == [ids[0]]
    assert server.get(f"/jobs/{fresh}").status_code == 404


@pytest.fixture
def idle_settings(broker_url: str, database_url: str, tmp_path: Path) -> Settings:
    """An api whose queue no worker reads."""
    return Settings(
        broker_url=broker_url,
        database_url=database_url,
        queue=f"ocr-idle-{uuid.uuid4().hex[:6]}",
        api_token=TOKEN,
        upload_dir=tmp_path / "up",
        api_max_wait_s=1.0,
        max_image_bytes=4096,
    )


def _messages(broker_url: str, queue: str) -> list[dict[str, Any]]:
    """The kwargs of the messages waiting in a queue (kombu's Redis layout)."""
    out = []
    for raw in redis.Redis.from_url(broker_url).lrange(queue, 0, -1):
        envelope = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
        out.append(kwargs)
    return out


def test_wait_is_capped_and_max_pixels_travels(
    idle_settings: Settings, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    queue = idle_settings.queue
    with TestClient(create_app(idle_settings), headers=AUTH) as api:
        job = api.post(
            "/jobs", json={"image": {"path": str(text_images["hello"])}, "max_pixels": 250_000}
        ).json()["job_id"]
        started = time.monotonic()
        row = api.get(f"/jobs/{job}", params={"wait": 30}).json()
        waited = time.monotonic() - started
        assert row["status"] == "queued" and 0.9 <= waited < 5, waited  # OCRQ_API_MAX_WAIT_S
        # Longer asks are capped too, not refused (above 3600 was a 422).
        for asked in (100_000, 1e300):
            long = api.get(f"/jobs/{job}", params={"wait": asked})
            assert long.status_code == 200 and long.json()["status"] == "queued", long.text
        found = api.post("/jobs/lookup", json={"job_ids": [job], "wait": 100_000})
        assert found.status_code == 200, found.text
        assert api.get(f"/jobs/{job}", params={"wait": "nan"}).status_code == 422
        raw = api.post(
            "/jobs",
            content=b"x" * 100,
            headers={"Content-Type": "image/png"},
            params={"max_pixels": 300_000, "task": "parse"},
        ).json()["job_id"]
        too_big = api.post("/jobs", content=b"x" * 5000, headers={"Content-Type": "image/png"})
        assert too_big.status_code == 413
        assert not list((idle_settings.upload_dir / ".incoming").iterdir())
    sent = {m["job_id"]: m for m in _messages(broker_url, queue)}
    assert sent[job]["max_pixels"] == 250_000
    assert sent[raw]["max_pixels"] == 300_000 and sent[raw]["task"] == "parse"
    # `ocrq requeue` rebuilds the message from the row: the cap comes along.
    redis.Redis.from_url(broker_url).delete(queue)
    resent = Client(idle_settings).requeue(older_than_s=0)
    assert {job, raw} <= set(resent)
    again = {m["job_id"]: m for m in _messages(broker_url, queue)}
    assert again[job]["max_pixels"] == 250_000 and again[raw]["max_pixels"] == 300_000
    redis.Redis.from_url(broker_url).delete(queue)


def test_bad_fields_are_422_never_500(idle_settings: Settings) -> None:
    app = create_app(idle_settings)
    with TestClient(app, headers=AUTH, raise_server_exceptions=False) as api:
        bodies = [
            b'{"image": {"b64": "a\\u0000b"}}',
            b'{"image": {"path": "/a.png"}, "task": "a\\u0000b"}',
            b'{"image": {"path": "/a\\ud800.png"}}',
            b'{"image": {"url": "https://example.org/\\u0000"}}',
            b'{"image": {"path": "/a.png"}, "job_id": "not-a-uuid"}',
            b'{"image": {"path": "/a.png"}, "max_pixels": 5}',
            b'{"image": {"b64": "aGk=", "name": "/srv/other.png"}}',  # a producer's name
            # What no worker can read: accepted, then failed in the worker, until now.
            b'{"image": {"path": "hello.png"}}',
            b'{"image": {"url": "ftp://example.org/a.png"}}',
            b'{"image": {"url": "file:///etc/passwd"}}',
        ]
        for body in bodies:
            r = api.post("/jobs", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (body, r.status_code, r.text)
        relative = api.post("/jobs", json={"image": {"path": "hello.png"}})
        assert "image.path must be absolute" in relative.text, relative.text
        in_batch = api.post("/jobs/batch", json={"jobs": [{"image": {"url": "ftp://a.org/b"}}]})
        assert in_batch.status_code == 422 and "http or https" in in_batch.text, in_batch.text
        r = api.post("/jobs", files={"file": ("a.png", b"x")}, data={"task": "a\x00b"})
        assert r.status_code == 422
        r = api.post("/jobs/batch", json={"jobs": [{"image": {"b64": "a\u0000"}}]})
        assert r.status_code == 422
        r = api.post("/jobs", content=b"x", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415
        pdf = api.post("/jobs", content=b"%PDF-1.7", headers={"Content-Type": "application/pdf"})
        assert pdf.status_code == 415 and "POST /documents" in pdf.text, pdf.text
        # A query parameter a route does not take is refused, as a JSON or multipart field is
        # (a raw upload's `?taks=` was dropped without a word, its task left `text`).
        typo = api.post("/jobs", content=b"x", headers={"Content-Type": "image/png"},
                        params={"taks": "spotting"})
        assert typo.status_code == 422 and "taks" in typo.text and "task" in typo.text, typo.text
        doc = api.post("/documents", content=b"%PDF-1.7", params={"pages": "1-3"})
        assert doc.status_code == 422 and "pages" in doc.text, doc.text
        # A JSON-only route's body sent as a form (curl's -d) says to send JSON.
        for route in ("/jobs/lookup", "/jobs/batch", "/jobs/retry"):
            form = api.post(route, content=b'{"job_ids": []}',
                            headers={"Content-Type": "application/x-www-form-urlencoded"})
            assert form.status_code == 415 and "application/json" in form.text, (route, form.text)


def test_uploads_need_an_upload_folder(idle_settings: Settings) -> None:
    settings = idle_settings.model_copy(update={"upload_dir": None})
    with TestClient(create_app(settings), headers=AUTH) as api:
        r = api.post("/jobs", content=b"x", headers={"Content-Type": "image/png"})
        assert r.status_code == 415 and "OCRQ_UPLOAD_DIR" in r.text


def test_redis_down_is_503_and_leaves_no_row(
    idle_settings: Settings, database_url: str, text_images: dict[str, Path]
) -> None:
    settings = idle_settings.model_copy(update={"broker_url": f"redis://127.0.0.1:{free_port()}/0"})
    store = JobStore(get_engine(database_url))
    job_id = str(uuid.uuid4())
    batch_ids = [str(uuid.uuid4()) for _ in range(2)]
    with TestClient(create_app(settings), headers=AUTH) as api:
        r = api.post("/jobs", json={"image": {"path": str(text_images["hello"])}, "job_id": job_id})
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        assert r.json()["sent"] == [] and r.json()["recorded_not_sent"] == []
        b = api.post(
            "/jobs/batch",
            json={
                "jobs": [
                    {"image": {"path": f"/x{i}.png"}, "job_id": j} for i, j in enumerate(batch_ids)
                ]
            },
        )
        assert b.status_code == 503
        # The row was written, the message refused, the row deleted again: nothing orphaned.
        assert store.get([job_id, *batch_ids]) == {}
        assert api.get(f"/jobs/{job_id}").status_code == 404
        ready = api.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["broker"].startswith("unreachable")
        assert ready.json()["checks"]["database"] == "ok"
        assert api.get("/healthz").status_code == 200  # liveness calls nothing behind it


def test_postgres_down_is_503_and_sends_nothing(
    idle_settings: Settings, broker_url: str, text_images: dict[str, Path]
) -> None:
    settings = idle_settings.model_copy(
        update={"database_url": f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/ocrq"}
    )
    with TestClient(create_app(settings), headers=AUTH) as api:
        r = api.post("/jobs", json={"image": {"path": str(text_images["hello"])}})
        assert r.status_code == 503 and "database" in r.json()["detail"]
        assert api.get(f"/jobs/{uuid.uuid4()}").status_code == 503
        assert api.get("/jobs").status_code == 503
        ready = api.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["checks"]["database"].startswith("unreachable")
        assert ready.json()["checks"]["broker"] == "ok"
    assert _messages(broker_url, settings.queue) == []


def test_readyz_wants_the_schema_at_head(idle_settings: Settings) -> None:
    name = f"ocrq_unmigrated_{uuid.uuid4().hex[:8]}"
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(TEST_PG).set(database=name).render_as_string(hide_password=False)
        settings = idle_settings.model_copy(update={"database_url": url})
        with TestClient(create_app(settings)) as api:
            r = api.get("/readyz")
        assert r.status_code == 503
        assert r.json()["checks"]["schema"].startswith("at none, needs")
        with TestClient(create_app(idle_settings)) as api:
            assert api.get("/readyz").json() == {
                "status": "ready",
                "checks": {"broker": "ok", "database": "ok", "schema": "ok"},
            }
    finally:
        get_engine.cache_clear()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_docs_render_offline(idle_settings: Settings) -> None:
    with TestClient(create_app(idle_settings)) as api:  # default: behind the token
        assert api.get("/docs").status_code == 401
        page = api.get("/docs", headers=AUTH)
        assert page.status_code == 200
        assert "/docs/static/swagger-ui-bundle.js" in page.text
        assert "http://" not in page.text and "https://" not in page.text  # no CDN
        for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js"):
            r = api.get(f"/docs/static/{asset}", headers=AUTH)
            assert r.status_code == 200 and len(r.content) > 10_000
        redoc = api.get("/redoc", headers=AUTH).text
        assert "/docs/static/redoc.standalone.js" in redoc and "https://" not in redoc
        schema = api.get("/openapi.json", headers=AUTH).json()
        assert {"/jobs", "/jobs/batch", "/jobs/lookup", "/jobs/{job_id}"} <= set(schema["paths"])
        upload = schema["paths"]["/jobs"]["post"]["requestBody"]["content"]
        assert {"application/json", "multipart/form-data", "image/*"} <= set(upload)
    public = idle_settings.model_copy(update={"api_docs": "public"})
    with TestClient(create_app(public)) as api:
        assert api.get("/docs").status_code == 200
        assert api.get("/docs/static/swagger-ui.css").status_code == 200
        assert api.get("/jobs").status_code == 401  # only the docs are open
    off = idle_settings.model_copy(update={"api_docs": "off"})
    with TestClient(create_app(off), headers=AUTH) as api:
        assert api.get("/docs").status_code == 404
        assert api.get("/openapi.json").status_code == 404
