"""Prometheus metrics and health probes of real `ocrq worker` processes (real Redis, PostgreSQL,
CPU engine), scraped over HTTP as Prometheus and the kubelet would."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.metrics import STAGES
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker import health
from tests.conftest import BIN, WorkerProcess
from tests.servers import free_port
from tests.test_faults import wait_all


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by name and sorted labels."""
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def probe(port: int, path: str) -> int:
    try:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).status_code
    except httpx.HTTPError:
        return -1


def health_cli(env: dict[str, str], *args: str) -> int:
    return subprocess.run(
        [str(BIN / "ocrq"), "health", *args], env=env, capture_output=True, timeout=60
    ).returncode


def submit(env: dict[str, str], paths: list[Path]) -> list[str]:
    client = Client(
        Settings(
            broker_url=env["OCRQ_BROKER_URL"],
            database_url=env["OCRQ_DATABASE_URL"],
            queue=env["OCRQ_QUEUE"],
        )
    )
    return [client.submit({"path": str(p)}) for p in paths]


def loopback_only(port: int) -> None:
    """By default the metrics listen on 127.0.0.1 alone (issue 31: they bound 0.0.0.0): another
    address of this host, 127.0.0.2 here, finds nothing on the port."""
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.2:{port}/healthz", timeout=5)


def test_metrics_survive_recycles_and_cover_every_stage(
    service_env: dict[str, str],
    database_url: str,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    """A supervised worker recycled every 3 images: its supervisor's /metrics counts every
    job of every worker process, and the recycles."""
    port = free_port()
    env = {
        **service_env,
        "OCRQ_QUEUE": f"ocr-metrics-{uuid.uuid4().hex[:6]}",
        "OCRQ_METRICS_PORT": str(port),
        "OCRQ_MAX_IMAGES": "3",
        "OCRQ_MAX_BATCH": "1",
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "2").wait_ready()
    try:
        assert probe(port, "/healthz") == 200
        wait_for(lambda: probe(port, "/readyz") == 200, 30, "/readyz 200")
        loopback_only(port)  # the supervisor's server too
        assert health_cli(env) == 0 and health_cli(env, "--live") == 0
        paths = [text_images[k] for k in ("hello", "invoice", "word")] * 3
        ids = submit(env, paths)
        rows = wait_all(JobStore(get_engine(database_url)), ids, timeout=240)
        assert all(r["status"] == "done" for r in rows.values()), rows
        processes = {r["worker"] for r in rows.values()}
        assert len(processes) >= 2, processes  # the jobs were run by more than one process
        wait_for(
            lambda: total(scrape(port), "ocrq_jobs_total", status="done") == len(ids),
            30,
            f"ocrq_jobs_total == {len(ids)}",
        )
        # The last recycle's process may still be starting; its counters are already counted.
        samples = scrape(port)
        assert total(samples, "ocrq_jobs_total", status="done", engine="rapid") == len(ids)
        assert total(samples, "ocrq_jobs_total", status="failed") == 0
        assert total(samples, "ocrq_recycles_total") >= 1
        assert "recycled" in worker.text()
        for stage in STAGES:
            count = total(samples, "ocrq_stage_seconds_count", stage=stage)
            if stage == "ack":  # observed after the task returned, before the process exits
                wait_for(
                    lambda: (
                        total(scrape(port), "ocrq_stage_seconds_count", stage="ack") == len(ids)
                    ),
                    30,
                    "every ack timed",
                )
            else:
                assert count == len(ids), (stage, count)
            assert total(samples, "ocrq_stage_seconds_sum", stage=stage) >= 0
        # queue_wait: from the row the client wrote to the claim, so at least 0, well under 4 min
        assert 0 < total(samples, "ocrq_stage_seconds_sum", stage="queue_wait") < 240 * len(ids)
        assert total(samples, "ocrq_batches_total") >= len(ids)  # batches of one
        assert total(samples, "ocrq_batch_images_count") == total(samples, "ocrq_batches_total")
        # Gauges: the live process's only (never summed over dead ones).
        wait_for(lambda: probe(port, "/readyz") == 200, 60, "ready after the last recycle")
        samples = scrape(port)
        assert total(samples, "ocrq_worker_ready") == 1
        assert total(samples, "ocrq_images_in_flight") == 0
        assert total(samples, "ocrq_batch_configured_budget_bytes") > 0
        assert total(samples, "ocrq_batch_budget_bytes") == total(
            samples, "ocrq_batch_configured_budget_bytes"
        )
    finally:
        worker.stop()
    assert worker.proc.returncode == 0, worker.text()[-3000:]


def test_liveness_follows_the_heartbeat_of_the_worker_process(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    """A worker process that stops (SIGSTOP: hung, not dead) fails /healthz and `ocrq health
    --live` once its heartbeat is stale; it is live again when it resumes."""
    port = free_port()
    env = {
        **service_env,
        "OCRQ_QUEUE": f"ocr-live-{uuid.uuid4().hex[:6]}",
        "OCRQ_METRICS_PORT": str(port),
        "OCRQ_HEARTBEAT_S": "1",
        "OCRQ_STALLED_AFTER_S": "30",
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "1").wait_ready()
    child = None
    try:
        wait_for(lambda: probe(port, "/readyz") == 200, 30, "/readyz 200")
        children = subprocess.run(
            ["pgrep", "-P", str(worker.proc.pid)], capture_output=True, text=True
        ).stdout.split()
        assert len(children) == 1, children
        child = int(children[0])
        os.kill(child, signal.SIGSTOP)
        wait_for(lambda: probe(port, "/healthz") == 503, 30, "/healthz 503")
        assert probe(port, "/readyz") == 503
        assert health_cli(env, "--live") == 1 and health_cli(env) == 1
        os.kill(child, signal.SIGCONT)
        child = None
        wait_for(lambda: probe(port, "/healthz") == 200, 30, "/healthz 200 again")
        wait_for(lambda: probe(port, "/readyz") == 200, 30, "/readyz 200 again")
    finally:
        if child is not None:
            os.kill(child, signal.SIGCONT)
        worker.stop()


@pytest.fixture
def own_database(database_url: str) -> str:
    """A database of this test's own, at head: the test moves its schema."""
    from sqlalchemy.engine import make_url

    name = f"ocrq_ready_{uuid.uuid4().hex[:8]}"
    url = make_url(database_url).set(database=name).render_as_string(hide_password=False)
    subprocess.run(
        [str(BIN / "ocrq"), "migrate"],
        env={**os.environ, "OCRQ_DATABASE_URL": url},
        check=True,
        timeout=120,
    )
    return url


def test_unsupervised_worker_serves_its_own_metrics_and_readiness_follows_the_schema(
    service_env: dict[str, str], own_database: str, text_images: dict[str, Path], tmp_path: Path
) -> None:
    """`--no-supervise` (under an orchestrator): the worker serves /metrics itself; /readyz
    says no while the database is not at the Alembic head (a newer deploy migrated it)."""
    from sqlalchemy import create_engine, text

    port = free_port()
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": own_database,
        "OCRQ_QUEUE": f"ocr-nosup-{uuid.uuid4().hex[:6]}",
        "OCRQ_METRICS_PORT": str(port),
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-supervise").wait_ready()
    db = create_engine(own_database.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        wait_for(lambda: probe(port, "/readyz") == 200, 30, "/readyz 200")
        asked = httpx.head(f"http://127.0.0.1:{port}/readyz", timeout=5)  # as a load balancer asks
        assert asked.status_code == 200 and asked.content == b"", asked
        loopback_only(port)
        ids = submit(env, [text_images["hello"], text_images["word"]])
        wait_all(JobStore(get_engine(own_database)), ids, timeout=120)
        wait_for(lambda: total(scrape(port), "ocrq_jobs_total", status="done") == 2, 30, "2 done")
        samples = scrape(port)
        assert total(samples, "ocrq_stage_seconds_count", stage="gpu") == 2
        assert total(samples, "ocrq_batch_measured_peak_bytes") > 0  # the process's peak RSS
        assert total(samples, "ocrq_batch_planned_peak_bytes") > 0
        with db.begin() as conn:
            (head,) = conn.execute(text("SELECT version_num FROM alembic_version")).one()
            conn.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
        wait_for(lambda: probe(port, "/readyz") == 503, 30, "/readyz 503 off head")
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()
        assert answer["status"] == "fail" and "ffff" in answer["reason"], answer
        assert probe(port, "/healthz") == 200  # not at head is not dead: no restart loop
        with db.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = :v"), {"v": head})
        wait_for(lambda: probe(port, "/readyz") == 200, 30, "/readyz 200 at head again")
    finally:
        worker.stop()
        db.dispose()


def test_readyz_says_the_worker_waits_for_its_database(
    service_env: dict[str, str], database_url: str, tmp_path: Path
) -> None:
    """A worker started before its database (compose, Kubernetes) waits for it up to a minute:
    /readyz says so, where it said "engine not loaded yet"; once `ocrq migrate` has created
    the database the worker starts and /readyz is 200."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    port = free_port()
    name = f"ocrq_later_{uuid.uuid4().hex[:8]}"
    later = make_url(database_url).set(database=name).render_as_string(hide_password=False)
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": later,  # no such database yet
        "OCRQ_QUEUE": f"ocr-dbwait-{uuid.uuid4().hex[:6]}",
        "OCRQ_METRICS_PORT": str(port),
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "1")
    try:
        seen: list[tuple[int, str]] = []  # /readyz's answers

        def reason() -> str:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
            except httpx.HTTPError:
                return ""
            seen.append((answer.status_code, answer.text))
            return str(answer.json()["reason"]) if answer.status_code == 503 else ""

        # The server answers "no such database": said as that, not as unreachable.
        wait_for(lambda: "for `ocrq migrate` to create it" in worker.text(), 45,
                 f"the worker waiting for its database\n{worker.text()[-2000:]}")
        deadline = time.monotonic() + 10
        while "waiting for the database" not in reason() and time.monotonic() < deadline:
            time.sleep(0.3)
        assert seen and "waiting for the database" in str(seen[-1]), seen[-3:]
        assert probe(port, "/healthz") == 200  # waiting is not dead: no restart
        subprocess.run([str(BIN / "ocrq"), "migrate"], env={**os.environ,
                       "OCRQ_DATABASE_URL": later}, check=True, timeout=120)
        wait_for(lambda: probe(port, "/readyz") == 200, 90,
                 f"/readyz 200 once the database is there\n{worker.text()[-2000:]}")
    finally:
        worker.stop()
        admin = create_engine(make_url(database_url).set(database="postgres"),
                              isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_readyz_names_a_broker_it_cannot_reach_and_the_log_says_where_it_serves(
    service_env: dict[str, str], tmp_path: Path
) -> None:
    """A worker whose broker does not answer (a wrong port) is stuck in Celery's retries for
    ever: /readyz said "engine not loaded yet", the log only Celery's "Cannot connect" lines.
    Now /readyz names OCRQ_BROKER_URL (its password redacted) and one WARNING does, however
    many retries follow. The supervisor's own start-up lines (where the metrics are served,
    which database and broker) were dropped, its logging never configured; alembic's setup
    lines were logged at every start."""
    from ocrq.core.db import shown_database

    port = free_port()
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    shown = f"redis://***@127.0.0.1:{closed}/12"
    env = {
        **service_env,
        "OCRQ_BROKER_URL": f"redis://:hunter2secret@127.0.0.1:{closed}/12",
        "OCRQ_QUEUE": f"ocr-nobroker-{uuid.uuid4().hex[:6]}",
        "OCRQ_METRICS_PORT": str(port),
    }
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "1")
    try:
        def reason() -> str:
            try:
                return str(httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json())
            except (httpx.HTTPError, ValueError):
                return ""

        wait_for(lambda: "waiting for the broker" in reason(), 90,
                 f"/readyz naming the broker\n{worker.text()[-3000:]}")
        answer = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert answer.status_code == 503, answer.text
        assert answer.json()["reason"] == f"waiting for the broker (OCRQ_BROKER_URL={shown})"
        assert probe(port, "/healthz") == 200  # waiting is not dead: no restart loop
        wait_for(lambda: worker.text().count("Trying again") >= 2, 60,
                 f"Celery retrying twice\n{worker.text()[-3000:]}")
        text = worker.text()
        named = [line for line in text.splitlines() if "WARNING" in line
                 and f"OCRQ_BROKER_URL={shown}" in line]
        assert len(named) == 1, text[-3000:]
        assert "hunter2secret" not in text and "hunter2secret" not in answer.text
        assert f"metrics and health on http://127.0.0.1:{port}/" in text, text[:3000]
        database = shown_database(env["OCRQ_DATABASE_URL"])
        assert f"database {database} (OCRQ_DATABASE_URL), broker {shown}" in text, text[:3000]
        assert "alembic" not in text, text[:3000]
        # SIGUSR1 to the supervisor's pid (the one `ocrq worker` shows) is passed on: the
        # worker writes its threads' stacks; it killed the supervisor before.
        os.kill(worker.proc.pid, signal.SIGUSR1)
        wait_for(lambda: "LOCAL VARIABLES" in worker.text(), 30,
                 f"the worker's stacks\n{worker.text()[-3000:]}")
        assert worker.proc.poll() is None, worker.text()[-3000:]
    finally:
        worker.stop()
    assert worker.proc.returncode == 0, worker.text()[-3000:]


def test_health_verdicts() -> None:
    """The decision itself, on the clock's edges."""
    now = 1000.0
    live = health.liveness
    assert live(health.WorkerState(), now, 30, 960).ok  # no process yet: starting
    assert live(health.WorkerState(started_at=990), now, 30, 960).reason == "engine loading"
    waiting = health.WorkerState(started_at=990, database_wait_since=995)
    assert live(waiting, now, 30, 960).reason == "waiting for the database"
    assert health.readiness(waiting, live(waiting, now, 30, 960), None).reason.startswith(
        "waiting for the database"
    )
    broker = health.WorkerState(started_at=990, broker_wait_since=995)
    assert live(broker, now, 30, 960).reason == "waiting for the broker"
    said = health.readiness(broker, live(broker, now, 30, 960), None, "OCRQ_BROKER_URL=redis://h")
    assert said.reason == "waiting for the broker (OCRQ_BROKER_URL=redis://h)", said
    beat = health.WorkerState(ready=1, started_at=900, heartbeat_at=975)
    assert live(beat, now, 30, 960).ok and not live(beat, now, 20, 960).ok
    hung = health.WorkerState(ready=1, started_at=1, heartbeat_at=999, batch_since=30)
    assert not live(hung, now, 30, 960).ok and live(hung, now, 30, 980).ok
    ok = health.Verdict(True, "")
    assert health.readiness(beat, ok, None).ok
    assert not health.readiness(beat, ok, "database at revision x").ok
    assert not health.readiness(health.WorkerState(ready=0, started_at=1), ok, None).ok
    assert not health.readiness(beat, health.Verdict(False, "silent"), None).ok


def test_flower_sees_the_batch_of_each_task(
    worker: WorkerProcess,
    service_env: dict[str, str],
    database_url: str,
    text_images: dict[str, Path],
    image_root: Path,
) -> None:
    """What Flower shows is what the worker's task events carry (there is no result backend):
    a done task's result and a failed task's exception name its batch and the wait for it.
    Received here by a real Celery event receiver, as Flower receives them."""
    import ast
    import threading

    from celery import Celery

    app = Celery(broker=service_env["OCRQ_BROKER_URL"])
    events: list[dict] = []
    with app.connection() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": events.append})
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None}, daemon=True)
        thread.start()
        wait_for(lambda: bool(events), 30, "a first event (the worker's heartbeat)")
        bad = image_root / "not-an-image.png"
        bad.write_bytes(b"this is no image at all" * 10)
        env = {**service_env, "OCRQ_QUEUE": "ocr"}
        done_id, failed_id = submit(env, [text_images["word"], bad])

        def seen(kind: str, job: str) -> list[dict]:
            return [e for e in list(events) if e["type"] == kind and e.get("uuid") == job]

        wait_for(lambda: bool(seen("task-succeeded", done_id)), 60, "task-succeeded")
        wait_for(lambda: bool(seen("task-failed", failed_id)), 60, "task-failed")
        receiver.should_stop = True
        thread.join(10)
    rows = JobStore(get_engine(database_url)).get([done_id, failed_id])
    result = ast.literal_eval(seen("task-succeeded", done_id)[0]["result"])
    assert result["batch_id"] == rows[done_id]["batch_id"] and result["batch_id"]
    assert 0 <= result["batch_wait_s"] < 60
    assert rows[failed_id]["status"] == "failed"  # refused at intake: it never had a batch
    (failure,) = seen("task-failed", failed_id)
    assert "batch" not in failure["exception"] and "image" in failure["exception"]


def test_oom_lowered_budget_and_batch_timings_are_exported() -> None:
    """The governor's lowered budget, the OOM count and the batch's planned vs measured peak
    reach the metrics; each image learns its batch wait and engine time. The OOM comes from
    the one fake the project allows (tests/test_batcher.py: a CUDA OOM cannot happen here)."""
    from prometheus_client import REGISTRY

    from ocrq.scheduling.batcher import StaticBatcher as Batcher
    from ocrq.scheduling.vocabulary import BatchConfig
    from ocrq.worker import runtime
    from tests.test_batcher import OomAbovePixels, item

    def value(name: str) -> float:
        return REGISTRY.get_sample_value(name) or 0.0

    ooms_before = value("ocrq_oom_events_total")
    engine = OomAbovePixels(limit=4 * 100 * 100)
    config = BatchConfig(max_items=16, wait_s=0.2, budget_bytes=16 * 100 * 100)
    batcher = Batcher(engine, config, on_batch=lambda r: runtime._count_batch(r, 1000)).start()
    try:
        futures = [batcher.submit(item(f"m{i}", 100)) for i in range(16)]
        outcomes = [f.result(timeout=30) for f in futures]
    finally:
        batcher.stop()
    assert all(o.error is None and o.batch_id for o in outcomes)
    assert all(o.waited_s >= 0 and o.run_s > 0 for o in outcomes)
    assert value("ocrq_oom_events_total") - ooms_before == batcher.oom_events >= 1
    assert value("ocrq_batch_budget_bytes") == batcher.budget_bytes < config.budget_bytes
    last = batcher.records[-1]
    assert value("ocrq_batch_planned_peak_bytes") == 1000 + last.predicted_bytes
    assert last.measured_peak_bytes and value("ocrq_batch_measured_peak_bytes") > 0
    assert value("ocrq_batch_running_since_timestamp_seconds") == 0  # idle again


@pytest.mark.parametrize("mode", [(), ("--no-supervise",)])
def test_a_taken_metrics_port_stops_the_worker_with_a_config_error(
    mode: tuple[str, ...], service_env: dict[str, str]
) -> None:
    """Exit 78 (no restart loop) naming the port, before any message is taken."""
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**service_env, "OCRQ_METRICS_PORT": str(port), "OCRQ_QUEUE": "ocr-port-taken"}
        proc = subprocess.run(
            [str(BIN / "ocrq"), "worker", *mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert f"OCRQ_METRICS_PORT={port}" in proc.stderr
    assert "started worker process" not in proc.stderr
