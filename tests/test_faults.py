"""Delivery guarantees under faults, with real worker processes, Redis and PostgreSQL.

Each test prints its figures (jobs, done, lost, duplicated, recycles, seconds) for the record.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from sqlalchemy import func, select

from ocrq.api.client import Client
from ocrq.core.db import get_engine, ocr_jobs
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import BIN, FIGURES, WorkerProcess
from tests.servers import PrivatePostgres, PrivateRedis
from tests.waiting import Budget, WaitTimeout

WORDS = [
    "ALPHA",
    "BRAVO",
    "CHARLIE",
    "DELTA",
    "ECHO",
    "FOXTROT",
    "GOLF",
    "HOTEL",
    "INDIA",
    "JULIET",
    "KILO",
    "LIMA",
    "MIKE",
    "NOVEMBER",
    "OSCAR",
    "PAPA",
]


def make_images(folder: Path, n: int, lines: int = 1) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        text = [f"{WORDS[(i + k) % len(WORDS)]} {i}" for k in range(lines)]
        path = folder / f"img{i:05d}.png"
        draw_text_image(text, size=28, margin=6 if lines == 1 else 20).save(path)
        paths.append(path)
    return paths


def send_all(broker_url: str, paths: list[Path], queue: str = "ocr") -> list[str]:
    app = Celery(broker=broker_url)
    ids = []
    with app.producer_or_acquire() as producer:
        for path in paths:
            job_id = str(uuid.uuid4())
            app.send_task(
                "ocrq.recognize",
                kwargs={"image": {"path": str(path)}, "job_id": job_id},
                queue=queue,
                task_id=job_id,
                producer=producer,
            )
            ids.append(job_id)
    return ids


def final_rows(store: JobStore, ids: list[str]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in store.get(ids).items() if v["status"] in ("done", "failed")}


def not_final(store: JobStore, ids: list[str], show: int = 8) -> str:
    """What a failed wait saw last: how many rows of each status, and the first few jobs
    that are not final with their status, attempts and worker."""
    rows = store.get(ids)
    late = [i for i in ids if rows.get(i, {}).get("status") not in ("done", "failed")]
    counts: dict[str, int] = {}
    for i in ids:
        status = rows.get(i, {}).get("status", "no row")
        counts[status] = counts.get(status, 0) + 1
    shown = [
        f"  {i}: {rows[i]['status']} attempts={rows[i]['attempts']} worker={rows[i]['worker']}"
        if i in rows
        else f"  {i}: no row"
        for i in late[:show]
    ]
    return f"statuses {counts}; not final: {len(late)}\n" + "\n".join(shown)


def wait_all(
    store: JobStore,
    ids: list[str],
    timeout: float,
    budget: Budget | None = None,
    log: WorkerProcess | Sequence[WorkerProcess] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every job's final row, waited for within `timeout` (and the test's `budget`); out of
    time, the error lists the jobs still not final and the tail of each worker's `log`."""
    budget = budget or Budget(timeout, "wait_all", checked=False)

    def final() -> dict[str, dict[str, Any]] | None:
        rows = final_rows(store, ids)
        return rows if len(rows) == len(ids) else None

    def detail() -> str:
        logs = [] if log is None else [log] if isinstance(log, WorkerProcess) else list(log)
        tails = "".join(f"\nworker log tail:\n{w.text()[-2000:]}" for w in logs)
        return not_final(store, ids) + tails

    return budget.until(f"{len(ids)} jobs final", final, timeout, detail, poll_s=0.5)


def done_mid_run(
    store: JobStore,
    ids: list[str],
    budget: Budget | None = None,
    done_at_least: int = 8,
    timeout: float = 90,
) -> dict[str, tuple[Any, Any]]:
    """Wait until some jobs are done and others running; the done ones' (text, finished_at),
    which a kill from here on must leave as they are."""

    def mid_run() -> list[dict[str, Any]] | None:
        rows = store.get(ids)
        done = [r for r in rows.values() if r["status"] == "done"]
        running = any(r["status"] == "running" for r in rows.values())
        return done if len(done) >= done_at_least and running else None

    budget = budget or Budget(timeout, "done_mid_run", checked=False)
    done = budget.until(
        f">= {done_at_least} jobs done and one running",
        mid_run,
        timeout,
        lambda: not_final(store, ids),
        poll_s=0.05,
    )
    return {r["id"]: (r["text"], r["finished_at"]) for r in done}


def row_count(store: JobStore, ids: list[str]) -> int:
    with store.engine.connect() as conn:
        return conn.execute(select(func.count()).where(ocr_jobs.c.id.in_(ids))).scalar_one()


def report(
    name: str,
    ids: list[str],
    rows: dict[str, dict[str, Any]],
    store: JobStore,
    seconds: float,
    recycles: int = 0,
) -> dict[str, int | float]:
    done = sum(r["status"] == "done" for r in rows.values())
    figures = {
        "jobs": len(ids),
        "done": done,
        "lost": len(ids) - len(rows),
        "duplicated": row_count(store, ids) - len(rows),  # rows beyond one per job
        "rerun": sum(max(0, r["attempts"] - 1) for r in rows.values()),
        "recycles": recycles,
        "seconds": round(seconds, 1),
    }
    line = f"[{name}] " + " ".join(f"{k}={v}" for k, v in figures.items())
    print("\n" + line)
    FIGURES.append(line)  # shown in pytest's terminal summary (tests/conftest.py)
    return figures


def worker_env(service_env: dict[str, str], **extra: str) -> dict[str, str]:
    return {**service_env, **{f"OCRQ_{k.upper()}": v for k, v in extra.items()}}


def child_pids(worker: WorkerProcess) -> list[int]:
    return [int(p) for p in re.findall(r"started worker process pid (\d+)", worker.text())]


# Every recycle is a hand-over where a message could be lost or run twice: 400 images at 20 a
# process make as many recycles (14-17) as 1,000 at 50 did, in well under half the time.
RECYCLE_IMAGES = 400
RECYCLE_EVERY = 20
RECYCLE_CONCURRENCY = 16


def test_recycle_400_images_every_20(
    service_env: dict[str, str],
    private_database: str,
    broker_url: str,
    image_root: Path,
    tmp_path: Path,
) -> None:
    """1,000 images at 50 a process took ~3 min on the loaded 2-core machine for 17 recycles;
    400 at 20 make about as many recycles in ~80 s (what is checked is each hand-over)."""
    budget = Budget(480, "recycle")
    paths = make_images(image_root / "recycle", RECYCLE_IMAGES)
    database_url = private_database  # its sweeps would re-run rows other tests left queued
    store = JobStore(get_engine(database_url))
    ids = send_all(broker_url, paths)
    t0 = time.monotonic()
    env = worker_env(service_env, database_url=database_url, max_batch="16")
    worker = WorkerProcess(
        env, tmp_path / "w.log", "--concurrency", str(RECYCLE_CONCURRENCY),
        "--max-images", str(RECYCLE_EVERY),
    )
    try:
        worker.wait_ready(timeout=min(90, budget.left()))
        rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
    recycles = worker.text().count("worker recycled (")
    figures = report("recycle", ids, rows, store, seconds, recycles)
    assert figures["done"] == RECYCLE_IMAGES and figures["lost"] == 0
    assert figures["duplicated"] == 0
    # A process runs at most max_images + concurrency images (those in flight when it decides
    # to recycle: 29-35 were seen at 25), so 400 images make at least 400 // 36 - 1 recycles.
    least = RECYCLE_IMAGES // (RECYCLE_EVERY + RECYCLE_CONCURRENCY) - 1
    assert recycles >= least, worker.text()[-3000:]
    assert len(set(child_pids(worker))) == recycles + 1
    text = {r["id"]: r["text"] for r in rows.values()}
    assert all(text[i] for i in ids)


def test_kill_9_mid_batch(
    service_env: dict[str, str],
    private_database: str,
    broker_url: str,
    image_root: Path,
    tmp_path: Path,
) -> None:
    # 40 pages: a batch of 8 in flight at the kill, 16 threads busy and the rest still queued
    # (80 took twice the time for the same states).
    paths = make_images(image_root / "kill", 40, lines=6)
    database_url = private_database  # its sweeps and requeue would re-run others' rows
    store = JobStore(get_engine(database_url))
    budget = Budget(480, "kill-9")
    env = worker_env(service_env, database_url=database_url, visibility_timeout_s="20",
                     max_batch="8")
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "16").wait_ready(90)
    t0 = time.monotonic()
    try:
        # Through the client, so each job has a queued row: kombu pops a message and marks it
        # unacked in two steps, and a kill between them loses that message; `ocrq requeue`
        # re-sends such jobs from their rows.
        client = Client(Settings(broker_url=broker_url, database_url=database_url))
        ids = [client.submit({"path": str(p)}) for p in paths]
        # Wait until some jobs are done and a batch is in flight, then kill -9 the worker.
        before = done_mid_run(store, ids, budget)
        victim = child_pids(worker)[-1]
        os.kill(victim, signal.SIGKILL)
        try:
            rows = wait_all(store, ids, timeout=120, budget=budget, log=worker)
        except WaitTimeout:
            FIGURES.append(f"[kill-9] re-sent by ocrq requeue: {len(client.requeue(30))}")
            rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
    figures = report("kill-9", ids, rows, store, seconds)
    assert len(child_pids(worker)) >= 2  # the supervisor started a new worker process
    assert figures["done"] == len(ids) and figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["rerun"] >= 1  # jobs of the killed batch ran again after redelivery
    for job_id, (text, finished) in before.items():  # no done result regressed
        assert (rows[job_id]["text"], rows[job_id]["finished_at"]) == (text, finished)


def test_redis_restart_mid_run(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    """Redis stops and starts again under a running worker; jobs submitted through the client
    (which records them as queued) all finish, with `ocrq requeue` re-sending any job whose
    message died in kombu's pop-then-mark-unacked window."""
    budget = Budget(480, "redis-restart")
    private = PrivateRedis(tmp_path)
    private.start()
    database_url = private_database  # its sweep re-sends every queued row Redis lost
    store = JobStore(get_engine(database_url))
    env = worker_env(service_env, broker_url=private.url, database_url=database_url,
                     visibility_timeout_s="20", max_batch="8")
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8")
    try:
        worker.wait_ready(90)
        client = Client(Settings(broker_url=private.url, database_url=database_url))
        # 60: at the restart 20 are final, 8 in flight and the rest queued (150 took ~2.5x as
        # long for the same states).
        paths = make_images(image_root / "redis", 60, lines=3)
        ids = [client.submit({"path": str(p)}) for p in paths]
        t0 = time.monotonic()
        budget.until(
            "20 jobs final before the restart",
            lambda: len(final_rows(store, ids)) >= 20,
            120,
            lambda: not_final(store, ids) + worker.text()[-2000:],
            poll_s=0.1,
        )
        private.stop()
        time.sleep(5)  # the fault itself: Redis stays down this long, nothing waits on it
        assert worker.alive()
        private.start()
        try:
            rows = wait_all(store, ids, timeout=90, budget=budget, log=worker)
            requeued: list[str] = []
        except WaitTimeout:
            requeued = client.requeue(older_than_s=30)
            rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
        private.stop()
    figures = report("redis-restart", ids, rows, store, seconds)
    FIGURES.append(f"[redis-restart] re-sent by ocrq requeue: {len(requeued)}")
    assert figures["done"] == len(ids) and figures["lost"] == 0 and figures["duplicated"] == 0
    assert len(child_pids(worker)) == 1  # the same process reconnected
    assert "Connected to" in worker.text().split("Connection to broker lost")[-1]


def test_postgres_down_30s(
    service_env: dict[str, str], broker_url: str, image_root: Path, tmp_path: Path
) -> None:
    budget = Budget(480, "postgres-down-30s")
    pg = PrivatePostgres()
    pg.init()
    try:
        subprocess.run(
            [str(BIN / "ocrq"), "migrate"],
            check=True,
            timeout=120,
            env={**os.environ, "OCRQ_DATABASE_URL": pg.url},
        )
        store = JobStore(get_engine(pg.url))
        queue = f"ocr-pg-{uuid.uuid4().hex[:6]}"
        env = worker_env(service_env, database_url=pg.url, queue=queue, max_batch="8")
        worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8")
        app = Celery(broker=broker_url)
        r = redis.Redis.from_url(broker_url)
        try:
            worker.wait_ready(90)
            ids = []
            # 50: at the outage 15 are final, 8 in flight and the rest queued (100 took twice as
            # long after it for the same states).
            for path in make_images(image_root / "pg", 50, lines=3):
                job_id = str(uuid.uuid4())
                app.send_task(
                    "ocrq.recognize",
                    kwargs={"image": {"path": str(path)}, "job_id": job_id},
                    queue=queue,
                )
                ids.append(job_id)
            t0 = time.monotonic()
            budget.until(
                "15 jobs final before the outage",
                lambda: len(final_rows(store, ids)) >= 15,
                120,
                lambda: not_final(store, ids) + worker.text()[-2000:],
                poll_s=0.05,
            )
            pg.stop()
            stopped_at = dt.datetime.now(dt.UTC)
            time.sleep(30)  # the fault itself: the outage lasts this long
            # During the outage: which messages has the worker acked?
            unacked = sum(1 for v in r.hgetall("unacked").values() if queue.encode() in v)
            queued = r.llen(queue)
            acked = len(ids) - queued - unacked
            assert worker.alive()
            pg.start()
            rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
            seconds = time.monotonic() - t0
        finally:
            worker.stop()
        figures = report("postgres-down-30s", ids, rows, store, seconds)
        stored_before = sum(1 for row in rows.values() if row["finished_at"] <= stopped_at)
        FIGURES.append(
            f"[postgres-down-30s] during the outage: acked={acked} queued={queued} "
            f"unacked={unacked}; rows stored before it: {stored_before}"
        )
        assert figures["done"] == len(ids) and figures["lost"] == 0
        assert figures["duplicated"] == 0
        assert acked <= stored_before  # no message acked before its row existed
        assert "retrying" in worker.text().lower() or "Retrying" in worker.text()
    finally:
        pg.destroy()


def test_postgres_down_past_the_retry_window(
    service_env: dict[str, str], broker_url: str, image_root: Path, tmp_path: Path
) -> None:
    """PostgreSQL away for longer than OCRQ_DB_RETRY_S (3 s here, 300 by default): the jobs that
    waited it out give their messages back instead of failing them. Acked as a failed task, a
    job whose row the worker had claimed stayed `running` under a worker that was alive, which
    no sweep re-sends: lost for good."""
    budget = Budget(420, "postgres-down-past-retry")
    pg = PrivatePostgres()
    pg.init()
    try:
        subprocess.run(
            [str(BIN / "ocrq"), "migrate"], check=True, timeout=120,
            env={**os.environ, "OCRQ_DATABASE_URL": pg.url},
        )
        store = JobStore(get_engine(pg.url))
        queue = f"ocr-pgw-{uuid.uuid4().hex[:6]}"
        env = worker_env(
            service_env, database_url=pg.url, queue=queue, max_batch="8", db_retry_s="3"
        )
        worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8")
        try:
            worker.wait_ready(90)
            ids = send_all(broker_url, make_images(image_root / "pgw", 60, lines=3), queue)
            t0 = time.monotonic()
            budget.until(
                "10 jobs final before the outage",
                lambda: len(final_rows(store, ids)) >= 10,
                120,
                lambda: not_final(store, ids) + worker.text()[-2000:],
                poll_s=0.05,
            )
            # The outage begins with claimed jobs inside the worker, never between two of its
            # batches: its processes are frozen until one of the rows reads `running`, then the
            # database stops, then they go on. Those jobs have run and cannot store a result.
            group = worker.proc.pid  # its own session: the supervisor, child and engine process
            claimed: set[str] = set()

            def frozen_with_a_claimed_job() -> bool:
                os.killpg(group, signal.SIGSTOP)
                rows = store.get(ids)
                claimed.update(i for i, r in rows.items() if r["status"] == "running")
                if claimed:
                    return True
                os.killpg(group, signal.SIGCONT)
                return False

            try:
                budget.until(
                    "the worker frozen with a claimed job in it", frozen_with_a_claimed_job,
                    60, lambda: not_final(store, ids), poll_s=0.02,
                )
                pg.stop()
            finally:
                os.killpg(group, signal.SIGCONT)
            # Every claimed job gives its message back (none can store while the database is
            # away); started on the first give-back, the database let slower ones store.
            budget.until(
                "each claimed job giving its message back after OCRQ_DB_RETRY_S",
                lambda: all(f"job {i}: the database stayed" in worker.text() for i in claimed),
                90,
                lambda: worker.text()[-3000:],
            )
            assert worker.alive()
            pg.start()
            rows = wait_all(store, ids, timeout=budget.left(), budget=budget, log=worker)
            seconds = time.monotonic() - t0
        finally:
            worker.stop()
        figures = report("postgres-down-past-retry", ids, rows, store, seconds)
        text = worker.text()
        given_back = text.count("goes back to the queue")
        resumed = text.count("while the database was away; running it again (not a retry)")
        FIGURES.append(
            f"[postgres-down-past-retry] messages given back: {given_back}, "
            f"of claimed jobs (resumed): {resumed}"
        )
        assert figures["done"] == len(ids) and figures["lost"] == 0
        assert figures["duplicated"] == 0
        # A job given back with its row claimed (it had run, and could not store its result)
        # runs again beside the others: no worker died, so it is neither run alone nor
        # charged an attempt (a poison message's budget), and the log does not say it died.
        assert resumed >= len(claimed) >= 1, text[-3000:]
        assert "died with its worker" not in text, text[-3000:]
        assert figures["rerun"] == 0, {i: r["attempts"] for i, r in rows.items()}
    finally:
        pg.destroy()
