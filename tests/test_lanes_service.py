"""The interactive lane end to end on the CPU engine: a real `ocrq worker`, Redis, PostgreSQL.

A bulk backlog is queued before the worker starts; once the worker is draining it, interactive
jobs arrive by the three producer paths (the Python client, a bare Celery `send_task` to the
interactive queue with no `priority` kwarg, `ocrq submit --priority interactive`). Each must
finish ahead of nearly all of the bulk jobs still pending when it was sent: at most 20% of them
may finish first, a criterion of order, not of seconds, so a slow, loaded machine does not
change it (first in, first out would let every one of them finish first). Then every bulk job
finishes too (nothing starved, nothing lost), and the worker's metrics count each lane.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import httpx
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from ocrq.api.client import Client
from ocrq.core.contract import INTERACTIVE, TASK_NAME, job_kwargs, queue_for
from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.settings import Settings
from tests.conftest import BIN, WorkerProcess
from tests.servers import free_port
from tests.waiting import Budget

# A backlog deep enough that half of it still waits when `ocrq submit`'s interactive job is
# recorded, the CLI's start-up (seconds on a loaded machine) after the first bulk job ended.
BULK_JOBS = 150
SHARE_AHEAD = 0.8  # of the bulk jobs pending when an interactive job was sent, finishing after it


def _finished(database_url: str, ids: list[str]) -> dict[str, tuple[str, float | None]]:
    with get_engine(database_url).connect() as conn:
        rows = conn.execute(
            select(ocr_jobs.c.id, ocr_jobs.c.status, ocr_jobs.c.finished_at).where(
                ocr_jobs.c.id.in_(ids)
            )
        ).all()
    return {r[0]: (r[1], r[2].timestamp() if r[2] else None) for r in rows}


def _created(database_url: str, ids: list[str]) -> dict[str, float]:
    with get_engine(database_url).connect() as conn:
        rows = conn.execute(
            select(ocr_jobs.c.id, ocr_jobs.c.created_at).where(ocr_jobs.c.id.in_(ids))
        ).all()
    return {r[0]: r[1].timestamp() for r in rows}


def _pending(database_url: str, ids: list[str]) -> list[str]:
    rows = _finished(database_url, ids)
    return [j for j in ids if rows.get(j, ("missing", None))[0] not in ("done", "failed")]


def _samples(port: int, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name
    }


def test_interactive_jobs_pass_the_bulk_backlog_and_bulk_still_finishes(
    service_env: dict[str, str],
    private_database: str,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    queue = f"ocr-lanes-{uuid.uuid4().hex[:6]}"
    port = free_port()
    database_url = private_database  # its sweep would re-run rows other tests left queued
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": database_url,
        "OCRQ_QUEUE": queue,
        "OCRQ_CONSUME_DEFAULT_QUEUE": "false",
        "OCRQ_METRICS_PORT": str(port),
        # 4 task threads, batches of 2: an interactive job waits for at most the batch running
        # when it is sent, the next one (planned before its message is fetched) and its own
        # batch-mate, 5 bulk jobs, against 50 or more pending: far inside the 20% allowed.
        "OCRQ_MAX_BATCH": "2",
    }
    settings = Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    client = Client(settings)
    images = [text_images[n] for n in ("invoice", "hello", "word")]
    bulk = [client.submit({"path": str(images[i % len(images)])}) for i in range(BULK_JOBS)]
    budget = Budget(400, "interactive lane")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-supervise", "--concurrency", "4")
    producer = Celery("producer", broker=env["OCRQ_BROKER_URL"])
    try:
        budget.until(
            "the worker draining the backlog",
            lambda: any(s == "done" for s, _ in _finished(database_url, bulk).values()),
            200,
            detail=lambda: worker.text()[-2000:],
        )
        sent: dict[str, float] = {}  # interactive job -> when it was sent (wall clock)

        sent_at = time.time()
        sent[client.submit({"path": str(text_images["word"])}, priority=INTERACTIVE)] = sent_at
        sent_at = time.time()
        kwargs = job_kwargs({"path": str(text_images["hello"])})
        producer.send_task(  # the queue alone names the lane
            TASK_NAME, kwargs=kwargs, queue=queue_for(INTERACTIVE, queue), task_id=kwargs["job_id"]
        )
        bare_job = kwargs["job_id"]
        sent[bare_job] = sent_at
        sent_at = time.time()
        cli = subprocess.run(
            [str(BIN / "ocrq"), "submit", "--priority", "interactive", str(text_images["word"])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        sent[cli.stdout.split()[-1]] = sent_at

        everything = [*bulk, *sent]

        def all_final() -> dict[str, tuple[str, float | None]] | None:
            rows = _finished(database_url, everything)
            final = len(rows) == len(everything)
            return (
                rows if final and all(s in ("done", "failed") for s, _ in rows.values()) else None
            )

        rows = budget.until(
            "every job final",
            all_final,
            150,
            detail=lambda: f"{_pending(database_url, everything)}\n{worker.text()[-2000:]}",
        )
        assert all(rows[j][0] == "done" for j in everything), rows  # nothing lost or failed
        recorded = _created(database_url, list(sent))
        for job, at in sent.items():
            # When its message went out: its row is recorded just before (the client and
            # `ocrq submit`, whose start-up takes seconds); a bare send_task's row is the
            # worker's, so the time just before sending stands in.
            at = at if job == bare_job else recorded[job]
            finished = rows[job][1]
            assert finished is not None
            pending = [b for b in bulk if rows[b][1] > at]  # type: ignore[operator]
            # The backlog was real when it arrived, or the test would prove nothing.
            assert len(pending) >= BULK_JOBS // 2, (job, len(pending))
            after = [b for b in pending if rows[b][1] > finished]  # type: ignore[operator]
            assert len(after) >= SHARE_AHEAD * len(pending), (job, len(after), len(pending))

        services = _samples(port, "ocrq_lane_service_seconds_count")
        assert services[(("lane", "interactive"),)] == len(sent)
        assert services[(("lane", "bulk"),)] == BULK_JOBS
        waits = _samples(port, "ocrq_lane_wait_seconds_count")
        assert waits[(("lane", "interactive"),)] == len(sent)
        depths = _samples(port, "ocrq_queue_depth")
        lanes = (("lane", "interactive"), ("queue", queue_for(INTERACTIVE, queue)))
        assert depths[lanes] == 0 and depths[(("lane", "bulk"), ("queue", queue))] == 0
    finally:
        producer.close()
        worker.stop()


def test_submit_refuses_an_unknown_priority(service_env: dict[str, str], tmp_path: Path) -> None:
    image = tmp_path / "x.png"
    image.write_bytes(b"not read")
    done = subprocess.run(
        [str(BIN / "ocrq"), "submit", "--priority", "urgent", str(image)],
        env=service_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "interactive, bulk" in done.stderr, done


def test_bulk_is_fetched_within_its_wait_while_interactive_jobs_keep_coming(
    service_env: dict[str, str],
    private_database: str,
    text_images: dict[str, Path],
    tmp_path: Path,
) -> None:
    """Bulk jobs queued first, then an interactive stream that keeps the worker busy: each
    bulk job is taken while interactive messages still wait in Redis (the broker's half of
    OCRQ_BULK_MAX_WAIT_S, ocrq/worker/lane_fetch.py). Strictly interactive-first fetching
    left them there until the last interactive job was gone (seen: 88.7 s)."""
    import redis as redis_py

    queue = f"ocr-starve-{uuid.uuid4().hex[:6]}"
    interactive_queue = queue_for(INTERACTIVE, queue)
    env = {
        **service_env,
        "OCRQ_DATABASE_URL": private_database,
        "OCRQ_QUEUE": queue,
        "OCRQ_CONSUME_DEFAULT_QUEUE": "false",
        "OCRQ_BULK_MAX_WAIT_S": "1",
    }
    settings = Settings(
        broker_url=env["OCRQ_BROKER_URL"], database_url=private_database, queue=queue
    )
    client = Client(settings)
    bulk = [client.submit({"path": str(text_images["word"])}) for _ in range(3)]
    # Interactive jobs that fail at once (their file is missing): the stream is the fetching
    # it causes, not OCR work, so it lasts seconds however fast or slow the machine is.
    missing = str(Path(env["OCRQ_ALLOWED_ROOTS"].split(":")[0]) / "missing.png")
    producer = Celery("producer", broker=env["OCRQ_BROKER_URL"])
    with producer.connection_for_write() as conn:
        for _ in range(200):
            kwargs = job_kwargs({"path": missing}, priority=INTERACTIVE)
            producer.send_task(
                TASK_NAME,
                kwargs=kwargs,
                queue=interactive_queue,
                task_id=kwargs["job_id"],
                connection=conn,
            )
    redis_client = redis_py.Redis.from_url(env["OCRQ_BROKER_URL"])
    budget = Budget(200, "bulk under an interactive stream")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-supervise", "--concurrency", "1")
    try:
        waiting = budget.until(
            "every bulk job final",
            lambda: (
                redis_client.llen(interactive_queue) + 1
                if not _pending(private_database, bulk)
                else None
            ),
            150,
            detail=lambda: f"{_pending(private_database, bulk)}\n{worker.text()[-2000:]}",
        )
        # The interactive stream was still there when the last bulk job ended.
        assert waiting - 1 > 0, worker.text()[-3000:]
        assert "bulk lane not served" in worker.text()
    finally:
        producer.close()
        redis_client.close()
        worker.stop()
