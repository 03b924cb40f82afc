"""End to end through real parts: `ocrq submit` -> Redis -> `ocrq worker` process -> PostgreSQL.

One worker process serves the module; every test talks to it only through the broker and
the database, as producers and users do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from celery import Celery

from ocrq.core.db import get_engine
from ocrq.core.store import JobStore
from tests.badfiles import write_bad_files
from tests.conftest import BIN, WorkerProcess


def _store(url: str) -> JobStore:
    return JobStore(get_engine(url))


def _wait_rows(url: str, ids: list[str], timeout: float = 180) -> dict[str, dict[str, Any]]:
    store = _store(url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = store.get(ids)
        if len(rows) == len(ids) and all(r["status"] in ("done", "failed") for r in rows.values()):
            return rows
        time.sleep(0.2)
    raise TimeoutError(f"jobs not final after {timeout} s: {store.get(ids)}")


def _ocrq(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ocrq"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_submit_wait_end_to_end(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    database_url: str,
) -> None:
    paths = [str(p) for p in text_images.values()]
    proc = _ocrq(service_env, "submit", *paths, "--wait", "--json", "--timeout", "120")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["path"] for r in rows] == paths
    by_name = {Path(r["path"]).stem: r for r in rows}
    assert all(r["status"] == "done" for r in rows), rows
    assert "HELLO" in by_name["hello"]["text"].upper()
    assert "STATION" in by_name["word"]["text"].upper()
    invoice = by_name["invoice"]
    assert invoice["lines"][0]["text"].upper().startswith("INVOICE")
    assert "134.90" in invoice["text"]
    for line in invoice["lines"]:
        x1, y1, x2, y2 = line["box"]
        assert 0 <= x1 < x2 and 0 <= y1 < y2 and 0 < line["score"] <= 1

    # The row holds everything the contract names.
    db = _store(database_url).get([r["job_id"] for r in rows])
    for r in rows:
        row = db[r["job_id"]]
        assert row["status"] == "done" and row["engine"] == "rapid" and row["attempts"] == 1
        assert len(row["sha256"]) == 64 and row["width"] > 0 and row["height"] > 0
        assert row["batch_id"] and row["worker"]
        assert row["created_at"] <= row["started_at"] <= row["finished_at"]
    # Three images submitted together share a batch: the engine never ran them one by one.
    assert len({db[r["job_id"]]["batch_id"] for r in rows}) < len(rows)

    status = _ocrq(service_env, "status", rows[0]["job_id"], "--json")
    assert json.loads(status.stdout)["text"] == rows[0]["text"]


def test_bare_celery_producer(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
    database_url: str,
) -> None:
    """Another app, with only celery installed and nothing of ocrq imported, sends a job."""
    job_id = str(uuid.uuid4())
    script = textwrap.dedent(f"""
        import sys
        from celery import Celery
        app = Celery(broker={service_env["OCRQ_BROKER_URL"]!r})
        app.send_task("ocrq.recognize", kwargs={{"image": {{"path": {str(text_images["hello"])!r}}},
                      "task": "text", "job_id": {job_id!r}}}, queue="ocr")
        assert not any(m.split(".")[0] in ("ocrq", "worker", "models", "api", "torch")
                       for m in sys.modules), "producer imported ocrq"
    """)
    subprocess.run([sys.executable, "-I", "-c", script], check=True, timeout=60)
    row = _wait_rows(database_url, [job_id])[job_id]
    assert row["status"] == "done" and "HELLO" in row["text"].upper()


def test_duplicate_delivery_one_row(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    app = Celery(broker=broker_url)
    job_id = str(uuid.uuid4())
    kwargs = {"image": {"path": str(text_images["word"])}, "job_id": job_id}

    def ended(task_id: str) -> bool:
        """Celery's own line for this copy of the message (its task id)."""
        return f"Task ocrq.recognize[{task_id}] succeeded" in worker.text()

    def wait_ended(*task_ids: str) -> None:
        deadline = time.monotonic() + 60
        while not all(map(ended, task_ids)):
            assert time.monotonic() < deadline, worker.text()[-3000:]
            time.sleep(0.1)

    copies = [str(uuid.uuid4()) for _ in range(2)]
    for copy in copies:  # delivered twice at once: both may run, one row, done
        app.send_task("ocrq.recognize", kwargs=kwargs, queue="ocr", task_id=copy)
    first = _wait_rows(database_url, [job_id])[job_id]
    assert first["status"] == "done"
    wait_ended(*copies)
    # A late redelivery of a done job changes nothing.
    late = str(uuid.uuid4())
    app.send_task("ocrq.recognize", kwargs=kwargs, queue="ocr", task_id=late)
    wait_ended(late)
    store = _store(database_url)
    from sqlalchemy import func, select

    from ocrq.core.db import ocr_jobs

    with store.engine.connect() as conn:
        n = conn.execute(select(func.count()).where(ocr_jobs.c.id == job_id)).scalar_one()
    after = store.get([job_id])[job_id]
    assert n == 1
    assert after["status"] == "done" and after["text"] == first["text"]
    assert after["finished_at"] >= first["finished_at"] and after["attempts"] <= 2
    assert f"job {job_id} already done; redelivery ignored" in worker.text()


def test_bad_inputs_fail_alone(
    worker: WorkerProcess,
    broker_url: str,
    database_url: str,
    image_root: Path,
    text_images: dict[str, Path],
) -> None:
    app = Celery(broker=broker_url)
    bad = write_bad_files(image_root / "bad")
    outside = Path("/etc/hostname")
    cases: dict[str, tuple[dict[str, Any], str]] = {
        name: ({"path": str(path)}, fragment) for name, (path, fragment) in bad.items()
    }
    cases["outside_root"] = ({"path": str(outside)}, "outside allowed roots")
    cases["missing"] = ({"path": str(image_root / "missing.png")}, "not found")
    cases["unreachable_url"] = ({"url": "http://127.0.0.1:9/x.png"}, "unreachable")
    cases["bad_b64"] = ({"b64": "***"}, "invalid base64")
    cases["no_image"] = ({}, "invalid job request")
    ids = {}
    for name, (image, _) in cases.items():
        ids[name] = str(uuid.uuid4())
        app.send_task("ocrq.recognize", kwargs={"image": image, "job_id": ids[name]}, queue="ocr")
    good = str(uuid.uuid4())
    app.send_task(
        "ocrq.recognize",
        kwargs={"image": {"path": str(text_images["hello"])}, "job_id": good},
        queue="ocr",
    )
    rows = _wait_rows(database_url, [*ids.values(), good])
    for name, (_, fragment) in cases.items():
        row = rows[ids[name]]
        assert row["status"] == "failed", (name, row)
        assert fragment in row["error"], (name, row["error"])
    assert rows[good]["status"] == "done"
    assert worker.alive()


def test_task_events_for_flower(
    worker: WorkerProcess, broker_url: str, database_url: str, text_images: dict[str, Path]
) -> None:
    """Flower builds its task list from these events: each image is its own task."""
    app = Celery(broker=broker_url)
    seen: dict[str, set[str]] = {}
    ready = threading.Event()

    def capture() -> None:
        with app.connection() as conn:

            def on_event(event: dict[str, Any]) -> None:
                ready.set()  # subscribed: the first event (a heartbeat) came through
                if event.get("uuid"):
                    seen.setdefault(event["uuid"], set()).add(event["type"])

            recv = app.events.Receiver(conn, handlers={"*": on_event})
            recv.capture(limit=None, timeout=40, wakeup=True)

    thread = threading.Thread(target=capture, daemon=True)
    thread.start()
    assert ready.wait(30), "no event from the worker (its heartbeat) within 30 s"
    ids = [str(uuid.uuid4()) for _ in range(3)]
    for job_id, path in zip(ids, text_images.values(), strict=True):
        app.send_task(
            "ocrq.recognize",
            kwargs={"image": {"path": str(path)}, "job_id": job_id},
            queue="ocr",
            task_id=job_id,
        )
    _wait_rows(database_url, ids)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not all(
        {"task-received", "task-started", "task-succeeded"} <= seen.get(i, set()) for i in ids
    ):
        time.sleep(0.2)
    for job_id in ids:
        assert {"task-received", "task-started", "task-succeeded"} <= seen.get(job_id, set()), seen


def test_embedded_run(tmp_path: Path, text_images: dict[str, Path]) -> None:
    """`ocrq run` with no Redis and no PostgreSQL: JSONL out, SQLite rows, bad file fails alone."""
    folder = tmp_path / "imgs"
    folder.mkdir()
    for p in text_images.values():
        (folder / p.name).write_bytes(p.read_bytes())
    (folder / "broken.png").write_bytes(b"not an image at all")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    env["OCRQ_BROKER_URL"] = "redis://127.0.0.1:1/0"  # proves nothing talks to a broker
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            str(BIN / "ocrq"),
            "run",
            str(folder),
            "--output",
            str(out),
            "--db",
            f"sqlite:///{tmp_path / 'run.sqlite'}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 1, proc.stderr  # broken.png failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [Path(r["path"]).name for r in rows] == sorted(p.name for p in folder.iterdir())
    by_name = {Path(r["path"]).stem: r for r in rows}
    assert set(by_name["broken"]) == {"path", "status", "text", "lines", "error", "truncated"}
    assert by_name["broken"]["status"] == "failed" and "not an image" in by_name["broken"]["error"]
    assert "HELLO" in by_name["hello"]["text"].upper()
    assert "done: 3, failed: 1" in proc.stderr
    db = _store(f"sqlite:///{tmp_path / 'run.sqlite'}")
    assert db.count_by_status() == {"done": 3, "failed": 1}


def test_http_api(
    worker: WorkerProcess,
    service_env: dict[str, str],
    text_images: dict[str, Path],
) -> None:
    from fastapi.testclient import TestClient

    from ocrq.api.http import create_app
    from ocrq.core.settings import Settings

    token = uuid.uuid4().hex
    settings = Settings(
        broker_url=service_env["OCRQ_BROKER_URL"],
        database_url=service_env["OCRQ_DATABASE_URL"],
        api_token=token,
    )
    api = TestClient(create_app(settings), headers={"Authorization": f"Bearer {token}"})
    job_id = api.post("/jobs", json={"image": {"path": str(text_images["word"])}}).json()["job_id"]
    deadline = time.monotonic() + 60
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        body = api.get(f"/jobs/{job_id}").json()
        if body["status"] in ("done", "failed"):
            break
        time.sleep(0.2)
    assert body["status"] == "done" and "STATION" in body["text"].upper()
    assert api.get(f"/jobs/{uuid.uuid4()}").status_code == 404
    assert api.post("/jobs", json={"image": {}}).status_code == 422


def test_flower_lists_each_image(
    worker: WorkerProcess,
    service_env: dict[str, str],
    broker_url: str,
    database_url: str,
    tmp_path: Path,
    text_images: dict[str, Path],
) -> None:
    """A real Flower, started as the README says, shows each image's task and its state."""
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = (tmp_path / "flower.log").open("w")
    flower = subprocess.Popen(
        [
            str(BIN / "celery"),
            f"--broker={broker_url}",
            "flower",
            f"--port={port}",
            "--address=127.0.0.1",
        ],
        env={**service_env, "FLOWER_UNAUTHENTICATED_API": "true"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{base}/healthcheck", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "Flower did not answer within 30 s"
                time.sleep(0.3)
        app = Celery(broker=broker_url)

        def seen_by_flower() -> bool:
            """A probe job Flower saw arrive: its event consumer is attached (a fixed wait
            for that lost the first events on a loaded machine)."""
            probe = str(uuid.uuid4())
            app.send_task(
                "ocrq.recognize",
                kwargs={"image": {"path": str(text_images["word"])}, "job_id": probe},
                queue="ocr",
                task_id=probe,
            )
            until = time.monotonic() + 5
            while time.monotonic() < until:
                if httpx.get(f"{base}/api/tasks", timeout=5).json().get(probe, {}).get(
                    "received"
                ):
                    return True
                time.sleep(0.3)
            return False

        assert any(seen_by_flower() for _ in range(8)), "Flower saw no task event in 40 s"
        ids = [str(uuid.uuid4()) for _ in text_images]
        for job_id, path in zip(ids, text_images.values(), strict=True):
            app.send_task(
                "ocrq.recognize",
                kwargs={"image": {"path": str(path)}, "job_id": job_id},
                queue="ocr",
                task_id=job_id,
            )
        _wait_rows(database_url, ids)
        tasks: dict[str, Any] = {}
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            tasks = httpx.get(f"{base}/api/tasks", timeout=5).json()
            if all(tasks.get(i, {}).get("state") == "SUCCESS" for i in ids):
                break
            time.sleep(0.5)
        for job_id in ids:
            assert tasks[job_id]["name"] == "ocrq.recognize"
            assert tasks[job_id]["state"] == "SUCCESS"
            assert tasks[job_id]["started"] and tasks[job_id]["received"]
    finally:
        flower.terminate()
        flower.wait(20)
        log.close()


def test_worker_with_missing_model_stops_with_clear_error(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    """A missing model is a start-up error: the worker says so and exits; no restart loop."""
    env = {
        **service_env,
        "OCRQ_ENGINE": "hunyuan",
        "OCRQ_MODEL": str(tmp_path / "no-such-model"),
        "OCRQ_QUEUE": f"ocr-missing-{uuid.uuid4().hex[:6]}",
    }
    proc = subprocess.run(
        [str(BIN / "ocrq"), "worker"], env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "does not exist" in proc.stderr and "OCRQ_MODEL" in proc.stderr
    assert proc.stderr.count("started worker process") == 1
