"""Workers that must not consume (an unmigrated database) and workers that died mid-job.

Real `ocrq worker` processes, Redis and PostgreSQL. The liveness tests set
OCRQ_VISIBILITY_TIMEOUT_S to 3600, so the broker's redelivery cannot explain any recovery:
only the heartbeat sweep can.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from alembic import command
from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from ocrq.api.client import Client
from ocrq.core import workers_table
from ocrq.core.db import get_engine, ocr_jobs, ocr_workers
from ocrq.core.migrate import (
    MIGRATE_LOCK_KEY,
    MigrationRunning,
    alembic_config,
    check_at_head,
    current_revisions,
    head_revisions,
    upgrade,
)
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore, now
from tests.conftest import BIN, FIGURES, TEST_PG, WorkerProcess
from tests.test_faults import WORDS, not_final, report, wait_all
from tests.waiting import Budget

# Fast liveness for tests: beats every second, dead after 6 s of silence, sweeps every second.
LIVENESS = {
    "OCRQ_HEARTBEAT_S": "1",
    "OCRQ_STALLED_AFTER_S": "6",
    "OCRQ_STALLED_SWEEP_S": "1",
    "OCRQ_VISIBILITY_TIMEOUT_S": "3600",
    "OCRQ_MAX_BATCH": "1",
}


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A database that exists but was never migrated."""
    name = f"ocrq_bare_{uuid.uuid4().hex[:8]}"
    admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    yield make_url(TEST_PG).set(database=name).render_as_string(hide_password=False)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.mark.parametrize("revision", [None, "0001"])
def test_worker_refuses_unmigrated_database_and_leaves_messages(
    revision: str | None,
    empty_database: str,
    service_env: dict[str, str],
    broker_url: str,
    text_images: dict[str, Path],
) -> None:
    """Without the check the worker takes the message, fails to claim (no table) and acks it."""
    if revision is not None:
        command.upgrade(alembic_config(empty_database), revision)
    queue = f"ocr-unmigrated-{uuid.uuid4().hex[:6]}"
    job_id = str(uuid.uuid4())
    producer = Client(Settings(broker_url=broker_url, queue=queue))
    producer.app.send_task(
        "ocrq.recognize",
        kwargs={"image": {"path": str(text_images["word"])}, "job_id": job_id},
        queue=queue,
        task_id=job_id,
    )
    env = {**service_env, "OCRQ_DATABASE_URL": empty_database, "OCRQ_QUEUE": queue}
    proc = subprocess.run(
        [str(BIN / "ocrq"), "worker"], env=env, capture_output=True, text=True, timeout=180
    )
    head = ", ".join(head_revisions())
    expected = f"database at revision {revision or 'none'}, ocrq needs {head}: run `ocrq migrate`"
    assert proc.returncode == 78, proc.stderr[-3000:]
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("started worker process") == 1  # the supervisor did not loop
    r = redis.Redis.from_url(broker_url)
    waiting = r.lrange(queue, 0, -1)
    assert len(waiting) == 1 and job_id.encode() in waiting[0]  # still queued, never taken
    assert not [v for v in r.hgetall("unacked").values() if job_id.encode() in v]


def test_a_start_beside_a_running_migrate_waits_for_its_end(
    empty_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Revisions 0005, 0007 and 0008 commit part-way (CREATE INDEX CONCURRENTLY): a worker that
    read the revision beside `ocrq migrate` saw one in between and exited 78 for good. The
    migrate's lock (held here by hand, as `upgrade` holds it) makes a starting worker's read
    wait for its end, and a probe's read say so at once."""
    import ocrq.core.migrate as migrate

    upgrade(empty_database)
    refused = threading.Event()  # set when a start was refused the lock and waits to ask again

    def pause(seconds: float) -> None:
        refused.set()
        time.sleep(seconds)

    monkeypatch.setattr(migrate, "time", type("Clock", (), {"sleep": staticmethod(pause)}))
    db = create_engine(empty_database, isolation_level="AUTOCOMMIT")
    waited: list[BaseException | None] = []
    try:
        with db.connect() as held:
            held.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATE_LOCK_KEY})
            with pytest.raises(MigrationRunning):
                check_at_head(empty_database)  # a probe: answers now

            def start() -> None:
                try:
                    check_at_head(empty_database, wait_for_migrate=True)
                    waited.append(None)
                except BaseException as exc:  # handed to the test's thread
                    waited.append(exc)

            thread = threading.Thread(target=start, daemon=True)
            thread.start()
            assert refused.wait(30), "the start never asked for the lock"
            assert thread.is_alive() and not waited  # it cannot pass while the lock is held
            held.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATE_LOCK_KEY})
        thread.join(30)
        assert waited == [None]  # at head once the "migrate" ended
        with db.connect() as conn:  # and no read left a lock behind for the next migrate
            assert not conn.execute(text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = "
                "(SELECT oid FROM pg_database WHERE datname = current_database())")).scalar()
    finally:
        db.dispose()


def test_two_migrates_at_once_both_end_at_head() -> None:
    """Two `ocrq migrate` at once (replicas of a compose service) on a database neither has
    created: one creates and upgrades, the other waits for its lock and finds head."""
    name = f"ocrq_twice_{uuid.uuid4().hex[:8]}"
    url = make_url(TEST_PG).set(database=name).render_as_string(hide_password=False)
    errors: list[BaseException] = []

    def migrate() -> None:
        try:
            upgrade(url)
        except BaseException as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=migrate, daemon=True) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert current_revisions(url) == head_revisions()
    finally:
        admin = create_engine(TEST_PG, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def slow_images(folder: Path, n: int, lines: int = 24) -> list[Path]:
    """Pages of many lines: a second or more each through the CPU engine on this machine."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        rows = [f"{WORDS[(i + k) % len(WORDS)]} {i}-{k} SLOW PAGE LINE" for k in range(lines)]
        path = folder / f"slow{i:04d}.png"
        draw_text_image(rows, size=28, margin=20).save(path)
        paths.append(path)
    return paths


def running_rows(store: JobStore, ids: list[str]) -> dict[str, dict]:
    return {k: v for k, v in store.get(ids).items() if v["status"] == "running"}


def test_killed_worker_jobs_resent_by_live_worker_sweep(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path: Path
) -> None:
    queue = f"ocr-stalled-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue}
    store = JobStore(get_engine(database_url))
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
    # Waits: ready 60 + the kill point 120 + rescuer ready 60 + taken 60 + all final 200 (16
    # slow pages one at a time took up to 199 s at a load average of 11-13 on the 2-core
    # machine: 8 pages now).
    budget = Budget(500, "stalled-sweep")
    victim = WorkerProcess(env, tmp_path / "victim.log", "--concurrency", "4", "--no-supervise")
    rescuer: WorkerProcess | None = None
    try:
        victim.wait_ready(60)
        # 8 pages: at the kill one or more done, 4 running under the victim and the rest
        # queued, as with 12 (whose 4 more only lengthened the rescuer's run).
        ids = [client.submit({"path": str(p)}) for p in slow_images(image_root / "stall", 8)]
        # Kill once the victim holds 4 running jobs and has no message it has not yet claimed
        # (an unclaimed one would only come back after the visibility timeout, by design).
        seen = {"stable": 0, "held": set(), "unacked": set()}

        def kill_point() -> bool:
            statuses = {i: row["status"] for i, row in store.get(ids).items()}
            running = {i for i, status in statuses.items() if status == "running"}
            messages = list(r.hgetall("unacked").values())
            unacked = {i for i in ids if any(i.encode() in m for m in messages)}
            ok = len(running) == 4 and unacked == running and "done" in statuses.values()
            seen["stable"] = seen["stable"] + 1 if ok and running == seen["held"] else int(ok)
            seen["held"], seen["unacked"] = running, unacked
            return seen["stable"] >= 3

        budget.until(
            "the victim holding exactly 4 running jobs, all its unacked messages, 3 polls running",
            kill_point,
            120,
            lambda: f"last seen {seen}; {not_final(store, ids)}\n{victim.text()[-2000:]}",
            poll_s=0.1,
        )
        held: set[str] = seen["held"]  # type: ignore[assignment]
        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        left = running_rows(store, ids)
        assert set(left) >= held  # the -9 left them running
        victim_name = {left[i]["worker"] for i in held}
        assert len(victim_name) == 1
        rescuer = WorkerProcess(env, tmp_path / "rescuer.log", "--concurrency", "4")
        rescuer.wait_ready(60)
        # Until the sweep takes them from the dead worker (flipped to queued, then claimed).
        budget.until(
            "the sweep taking the dead worker's running jobs",
            lambda: (
                not any(
                    r["status"] == "running" and r["worker"] in victim_name
                    for r in store.get(list(held)).values()
                )
            ),
            60,
            lambda: not_final(store, list(held)) + "\n" + rescuer.text()[-2000:],
        )
        resent_after = time.monotonic() - killed_at
        rows = wait_all(store, ids, timeout=200, budget=budget, log=rescuer)
        seconds = time.monotonic() - killed_at
    finally:
        victim.stop(signal.SIGKILL)
        if rescuer is not None:
            rescuer.stop()
    figures = report("stalled-sweep", ids, rows, store, seconds)
    FIGURES.append(
        f"[stalled-sweep] running at -9: {len(held)}; taken from the dead worker "
        f"{resent_after:.0f} s after the kill (rescuer start-up + "
        f"{LIVENESS['OCRQ_STALLED_AFTER_S']} s of silence); all done {seconds:.0f} s after it"
    )
    assert figures["done"] == len(ids) and figures["lost"] == 0 and figures["duplicated"] == 0
    # Exactly the killed worker's running jobs ran a second time, each once more.
    assert {i for i, row in rows.items() if row["attempts"] > 1} == held
    assert all(rows[i]["attempts"] == 2 for i in held)
    log = rescuer.text()
    assert "stalled-job sweep: re-sent 4 running job(s)" in log, log[-3000:]
    assert all(i in log for i in held)
    assert resent_after < 120  # against a visibility timeout of 3600 s


def test_live_workers_jobs_are_never_resent(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path: Path
) -> None:
    """Two busy workers sweep every second and `ocrq requeue --stalled` runs while their jobs
    have been running for longer than OCRQ_STALLED_AFTER_S: nothing is re-sent."""
    queue = f"ocr-live-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue}
    store = JobStore(get_engine(database_url))
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    # Waits: ready 60 (both start at once) + a long-running job 90 + all final 290; the warm
    # shutdowns below take up to 90 more (530 s, under pytest's 600). The landing CI of stop 41
    # ran the suite ~2.5x slower than usual and 24 jobs of 32 were final after the old 200 s
    # slice: 16 jobs still keep 16 threads busy for far longer than OCRQ_STALLED_AFTER_S.
    budget = Budget(440, "live-not-resent")
    workers = [
        WorkerProcess(env, tmp_path / f"live{k}.log", "--concurrency", "8") for k in range(2)
    ]
    try:
        for w in workers:
            w.wait_ready(min(60, budget.left()))
        # 16: one job for each of the 16 threads, all running at once past
        # OCRQ_STALLED_AFTER_S; the 4 more of 20 only ran after the first finished, a tail of
        # waiting that checked nothing the first 16 do not.
        ids = [client.submit({"path": str(p)}) for p in slow_images(image_root / "live", 16)]
        stalled_after = float(LIVENESS["OCRQ_STALLED_AFTER_S"])

        def oldest_running() -> float:
            started = [r["started_at"] for r in running_rows(store, ids).values()]
            return max(((now() - t).total_seconds() for t in started), default=0.0)

        budget.until(
            f"a job running for {stalled_after + 2:.0f} s (longer than OCRQ_STALLED_AFTER_S)",
            lambda: oldest_running() >= stalled_after + 2,
            90,
            lambda: not_final(store, ids),
        )
        cli = subprocess.run(
            [str(BIN / "ocrq"), "requeue", "--stalled"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        busy = len(running_rows(store, ids))
        rows = wait_all(store, ids, timeout=290, budget=budget, log=workers)
        names = {row["worker"] for row in rows.values()}
    finally:
        # Both warm shutdowns at once, each given time on a loaded 2-core CI machine; one that
        # still hangs has its threads' stacks written to its log before the kill.
        for w in workers:
            if w.alive():
                os.killpg(w.proc.pid, signal.SIGTERM)
        for w in workers:
            w.stop(timeout=90, send=False)
    assert cli.returncode == 0, cli.stderr
    said = " ".join(cli.stderr.split())
    assert "re-sent 0 running job(s) of dead workers" in said and cli.stdout.strip() == ""
    assert "running job(s) belong to workers heard from less than" in said, said
    assert busy > 0
    again = {i: (r["status"], r["attempts"], r["worker"], r["error"]) for i, r in rows.items()}
    again = {i: v for i, v in again.items() if v[:2] != ("done", 1)}
    assert not again, f"not done once: {again}\n" + "\n".join(w.text()[-2000:] for w in workers)
    for w in workers:
        assert "stalled-job sweep: re-sent" not in w.text()
    # One name per process (both on this host), and a clean stop retires its heartbeat row.
    assert len(names) == 2
    assert not names & set(workers_table.heartbeats(store.engine))


def test_concurrent_sweeps_resend_each_job_once(database_url: str) -> None:
    """While one sweep's UPDATE holds the rows, a second one waits, then finds them no longer
    running and returns nothing: a job is re-sent by one sweeper only."""
    engine = get_engine(database_url)
    dead = f"dead-{uuid.uuid4().hex[:6]}"
    ids = [str(uuid.uuid4()) for _ in range(20)]
    long_ago = now().replace(year=2000)
    with engine.begin() as conn:
        conn.execute(
            insert(ocr_workers).values(
                name=dead, hostname="h", pid=1, started_at=long_ago, heartbeat_at=long_ago
            )
        )
        conn.execute(
            insert(ocr_jobs),
            [
                {
                    "id": i,
                    "status": "running",
                    "task": "text",
                    "source": f"/x/{i}.png",
                    "reference": {"path": f"/x/{i}.png"},
                    "worker": dead,
                    "attempts": 1,
                    "created_at": long_ago,
                    "started_at": long_ago,
                }
                for i in ids
            ],
        )
    first = engine.connect()
    tx = first.begin()
    taken = first.execute(
        text(
            "UPDATE ocr_jobs SET status = 'queued' WHERE worker = :w AND status = 'running' "
            "RETURNING id"
        ),
        {"w": dead},
    ).all()
    assert len(taken) == len(ids)
    second: list[workers_table.StalledJob] = []
    sweeper = threading.Thread(
        target=lambda: second.extend(workers_table.flip_stalled(engine, 60)), daemon=True
    )
    sweeper.start()
    time.sleep(1.0)
    assert sweeper.is_alive()  # blocked behind the first sweep's row locks
    tx.commit()
    first.close()
    sweeper.join(30)
    assert not sweeper.is_alive()
    assert not [j for j in second if j.id in ids]
    # And with nobody holding them, a sweep does flip a dead worker's running rows.
    with engine.begin() as conn:
        conn.execute(text("UPDATE ocr_jobs SET status = 'running' WHERE worker = :w"), {"w": dead})
    assert {j.id for j in workers_table.flip_stalled(engine, 60)} >= set(ids)
    assert workers_table.forget_dead(engine, 60) >= 1
    assert dead not in workers_table.heartbeats(engine)


def _stalled_row(engine: object, image: Path) -> tuple[str, str]:
    """A job `running` under a worker whose last heartbeat is long past (killed with -9):
    its row and its worker's, as the dead worker left them. Returns (job id, worker name)."""
    dead = f"dead-{uuid.uuid4().hex[:6]}"
    job_id = str(uuid.uuid4())
    long_ago = now().replace(year=2000)
    with engine.begin() as conn:  # type: ignore[attr-defined]
        conn.execute(insert(ocr_workers).values(
            name=dead, hostname="h", pid=1, started_at=long_ago, heartbeat_at=long_ago
        ))
        conn.execute(insert(ocr_jobs).values(
            id=job_id, status="running", task="text", source=str(image),
            reference={"path": str(image)}, worker=dead, attempts=1,
            created_at=long_ago, started_at=long_ago,
        ))
    return job_id, dead


def _status(env: dict[str, str], job_id: str) -> dict:
    """The job's row as `ocrq status --json` shows it."""
    import json

    shown = subprocess.run([str(BIN / "ocrq"), "status", job_id, "--json"], env=env,
                           capture_output=True, text=True, timeout=60)
    return json.loads(shown.stdout)


def test_requeue_stalled_clears_the_dead_workers_name(
    service_env: dict[str, str], database_url: str, text_images: dict[str, Path], tmp_path: Path
) -> None:
    """`ocrq requeue --stalled` re-sends the running job of a dead worker: its row is `queued`
    with no worker (it kept the dead one's name, as if that worker still held it), and a live
    worker then runs it under its own name."""
    queue = f"ocr-requeue-{uuid.uuid4().hex[:6]}"
    env = {**service_env, "OCRQ_QUEUE": queue}
    engine = get_engine(database_url)
    job_id, dead = _stalled_row(engine, text_images["word"])
    cli = subprocess.run([str(BIN / "ocrq"), "requeue", "--stalled"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.split() == [job_id], (cli.stdout, cli.stderr)
    row = _status(env, job_id)
    assert row["status"] == "queued" and row["worker"] is None, row
    assert redis.Redis.from_url(env["OCRQ_BROKER_URL"]).llen(queue) == 1
    assert dead not in workers_table.heartbeats(engine)  # forgotten, no job left under it
    worker = WorkerProcess(env, tmp_path / "worker.log", "--concurrency", "1")
    try:
        worker.wait_ready(90)
        (done,) = wait_all(JobStore(engine), [job_id], timeout=90, log=worker).values()
    finally:
        worker.stop()
    assert done["status"] == "done" and done["text"] == "STATION", done
    assert done["worker"] not in (None, dead) and done["attempts"] == 2, done


def test_a_stalled_job_the_broker_refused_stays_with_its_dead_worker(
    broker_url: str, database_url: str, text_images: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The broker refusing the re-send puts the row back `running` under the dead worker's
    name (the flip cleared it), so the next sweep finds it again and re-sends it."""
    from ocrq.core import requeue

    settings = Settings(broker_url=broker_url, database_url=database_url,
                        queue=f"ocr-unflip-{uuid.uuid4().hex[:6]}")
    store = JobStore(get_engine(database_url))
    app = requeue.producer_app(settings)
    job_id, dead = _stalled_row(store.engine, text_images["word"])

    def refused(*_: object) -> None:
        raise ConnectionError("broker away")

    with monkeypatch.context() as patched:
        patched.setattr(requeue, "resend", refused)
        with pytest.raises(ConnectionError):
            requeue.requeue_stalled(store, app, settings)
    row = store.get([job_id])[job_id]
    assert (row["status"], row["worker"]) == ("running", dead), row
    assert requeue.requeue_stalled(store, app, settings).stalled == [job_id]
    row = store.get([job_id])[job_id]
    assert (row["status"], row["worker"]) == ("queued", None), row


def test_a_stop_signal_delivered_twice_is_one_warm_stop() -> None:
    """A stop reaches a worker from its process group and again from its supervisor. Celery's
    handler, entered a second time from inside the first, waited forever on its own lock (a
    worker's stacks showed it). Guarded, the repeat is dropped: here a real SIGTERM sent from
    inside the handler, and another just after it."""
    from ocrq.worker.exit_state import guard_stop_signals

    calls: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        calls.append(signum)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # delivered while this handler runs
            time.sleep(0.05)

    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, handler)
    try:
        guard_stop_signals([signal.SIGTERM])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)  # the supervisor's copy, a moment later
        time.sleep(0.1)
        assert calls == [signal.SIGTERM]
        time.sleep(1.0)  # past REPEAT_SIGNAL_S: a warm stop is under way, still one
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert calls == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


# A real Celery worker (make_app's, as `ocrq worker` runs it) whose broker never answers: at its
# first failed connection it records whether Celery's SIGTERM handler is guarded yet, then
# stops itself twice, as a process group's stop and the supervisor's copy reach it.
_UNREACHABLE_BROKER_WORKER = r"""
import os, signal, sys
from ocrq.core.settings import Settings
from ocrq.worker import broker
from ocrq.worker.celery_app import make_app
from ocrq.worker.exit_state import run_celery

first = broker.BROKER_WAIT.failed
seen = []

def failed(exc):
    first(exc)
    if not seen:
        seen.append(getattr(signal.getsignal(signal.SIGTERM), "ocrq_guarded", False))
        sys.__stderr__.write(f"guarded at the first failed connect: {seen[0]}\n")
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)

broker.BROKER_WAIT.failed = failed
app = make_app(Settings(broker_url=sys.argv[1], queue=sys.argv[2]))
sys.exit(run_celery(app, ["worker", "--pool", "threads", "--concurrency", "1",
                          "--without-mingle", "--without-gossip", "--loglevel", "WARNING"]))
"""


def test_a_worker_still_reaching_its_broker_has_its_stop_signals_guarded(
    tmp_path: Path,
) -> None:
    """The guard was put on at `worker_ready`, which never comes while the broker does not
    answer: a worker stopped then (its group's SIGTERM and the supervisor's) hung in its warm
    shutdown until killed (tests/test_metrics.py's unreachable-broker test, one CI run in
    several). A worker bootstep guards the handlers before the consumer connects."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OCRQ_")}
    proc = subprocess.run(
        [str(BIN / "python"), "-c", _UNREACHABLE_BROKER_WORKER,
         f"redis://127.0.0.1:{closed}/0", f"ocr-guard-{uuid.uuid4().hex[:6]}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert "guarded at the first failed connect: True" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert out.count("Warm shutdown") == 1, out[-3000:]


def test_a_second_ctrl_c_later_is_still_a_cold_stop() -> None:
    """SIGINT keeps its window: the group's and the supervisor's copies of one Ctrl-C are one
    stop, and a person's second Ctrl-C, later, reaches Celery (its cold stop)."""
    from ocrq.worker.exit_state import REPEAT_SIGNAL_S, guard_stop_signals

    calls: list[int] = []
    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, lambda signum, _frame: calls.append(signum))
    try:
        guard_stop_signals([signal.SIGINT])
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGINT)  # the supervisor's copy
        time.sleep(0.1)
        assert calls == [signal.SIGINT]
        time.sleep(REPEAT_SIGNAL_S)
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C
        time.sleep(0.1)
        assert calls == [signal.SIGINT, signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_group_stop_stops_a_worker_once_and_retires_its_row(
    service_env: dict[str, str], database_url: str, tmp_path: Path
) -> None:
    """`kill -- -PGID` (what systemd's control-group kill and a terminal's Ctrl-C do) reaches the
    worker process and its supervisor, which forwards it: one warm shutdown, run to its end."""
    queue = f"ocr-stop-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue}
    store = JobStore(get_engine(database_url))
    others = set(workers_table.heartbeats(store.engine))
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "4").wait_ready(90)
    try:
        names = set(workers_table.heartbeats(store.engine)) - others
        assert len(names) == 1
    finally:
        worker.stop(timeout=120)
    text = worker.text()
    assert worker.proc.returncode == 0, text[-3000:]
    assert text.count("Warm shutdown") == 1, text[-3000:]
    assert "shutdown: heartbeat row of" in text
    # The supervisor says the stop began and how it ended: its last line, not a cut-off log.
    assert text.count("ocrq supervisor: stopping on SIGTERM") == 1, text[-3000:]
    assert "ocrq supervisor: worker exited (code 0)" in text, text[-3000:]
    assert text.rstrip().endswith("ocrq supervisor: stopped (exit 0)"), text[-3000:]
    assert not names & set(workers_table.heartbeats(store.engine))


def test_a_killed_supervisor_takes_its_worker_along(
    service_env: dict[str, str], database_url: str, tmp_path: Path
) -> None:
    """kill -9 of the supervisor (no forwarding possible): its worker process gets SIGTERM from
    Linux (PR_SET_PDEATHSIG), stops consuming and exits with a warm shutdown, its heartbeat row
    retired. Before, it went on consuming as an orphan with no metrics and no one to restart
    it (issue 31)."""
    budget = Budget(150, "supervisor-kill-9")
    queue = f"ocr-orphan-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue}
    store = JobStore(get_engine(database_url))
    others = set(workers_table.heartbeats(store.engine))
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "2").wait_ready(90)
    started = re.compile(r"started worker process pid (\d+)")
    child = 0
    try:
        (child,) = (int(pid) for pid in started.findall(worker.text()))
        names = set(workers_table.heartbeats(store.engine)) - others
        assert len(names) == 1 and os.getpgid(child) == worker.proc.pid
        os.kill(worker.proc.pid, signal.SIGKILL)
        worker.proc.wait(30)
        budget.until(
            "the orphaned worker process to exit",
            lambda: not Path(f"/proc/{child}").exists()
            or Path(f"/proc/{child}/stat").read_text().split(") ")[1].startswith("Z"),
            60,
            lambda: worker.text()[-2000:],
        )
    finally:
        if child and Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)  # an orphan must not outlive the test
        worker.stop(timeout=30)
    text = worker.text()
    assert text.count("Warm shutdown") == 1, text[-3000:]
    assert not names & set(workers_table.heartbeats(store.engine))  # retired on the way out


def test_a_database_still_away_is_waited_for_out_loud(caplog: pytest.LogCaptureFixture) -> None:
    """A worker started before its database (compose, Kubernetes) says it is waiting, once,
    then exits 1 for its supervisor to start it again (78 is kept for a schema not at head,
    which no restart mends)."""
    from ocrq.worker import exit_state

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(
        database_url=f"postgresql+psycopg://postgres@127.0.0.1:{port}/ocrq", database_wait_s=1.5
    )
    with caplog.at_level(logging.WARNING, logger=exit_state.__name__):
        assert exit_state.check_database(settings) == 1
    said = [r.getMessage() for r in caplog.records]
    assert sum("waiting up to 2 s" in m for m in said) == 1, said
    assert any("cannot reach the database" in m and "Start PostgreSQL" in m for m in said), said


def test_a_missing_database_is_said_as_missing(caplog: pytest.LogCaptureFixture) -> None:
    """The server answers but the database was never created: the worker says so and names
    `ocrq migrate`, where it once said "unreachable or missing" for both faults; and it exits
    EX_CONFIG, which its supervisor does not restart (it restarted every minute for ever)."""
    from ocrq.worker import exit_state

    missing = make_url(TEST_PG).set(database=f"ocrq_missing_{uuid.uuid4().hex[:8]}")
    settings = Settings(
        database_url=missing.render_as_string(hide_password=False), database_wait_s=1.5
    )
    with caplog.at_level(logging.WARNING, logger=exit_state.__name__):
        assert exit_state.check_database(settings) == exit_state.STARTUP_FAILED_EXIT_CODE
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.CRITICAL]
    assert len(said) == 1 and "does not exist: run `ocrq migrate`" in said[0], said
