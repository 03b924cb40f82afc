"""Recovery without a person (issue 31, item 3): lost messages, a dead worker's unstarted
messages, a Redis that came back empty, and `ocrq requeue` beside a live backlog.

Real `ocrq worker` processes, Redis and PostgreSQL. The visibility timeout is 3600 s, so
Redis's own redelivery explains no recovery here: only the sweep (ocrq/core/requeue.py) can.
A lost message is made the way kombu loses one: popped from the queue's list (RPOP, what a
worker's BRPOP does) and never written to `unacked`, as when the worker is killed in between.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from ocrq.api.client import Client
from ocrq.core import workers_table
from ocrq.core.broker_scan import HOLDERS_KEY, broker_view, holder_entry, message_job_id
from ocrq.core.contract import TASK_NAME, JobRequest, queue_for
from ocrq.core.db import get_engine
from ocrq.core.requeue import recover
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore, NewJob
from tests import conftest
from tests.conftest import BIN, FIGURES, WorkerProcess
from tests.servers import PrivateRedis
from tests.test_faults import make_images, not_final, report, wait_all
from tests.test_liveness import LIVENESS
from tests.waiting import Budget


def queue_ids(r: redis.Redis, queue: str) -> list[str]:
    return [message_job_id(m) or "?" for m in r.lrange(queue, 0, -1)]


def lose(r: redis.Redis, queue: str, n: int) -> list[str]:
    """Pop `n` messages as a worker's BRPOP does, and drop them: what a kill -9 between kombu's
    pop and its `unacked` write leaves. Their rows stay `queued`."""
    return [message_job_id(r.rpop(queue)) or "?" for _ in range(n)]


def holders(r: redis.Redis) -> dict[str, str]:
    return {v.decode().split("\t")[1]: v.decode().split("\t")[0] for v in r.hvals(HOLDERS_KEY)}


def fully_held(r: redis.Redis, job_id: str) -> bool:
    """The job's message taken to the end: ocrq's holder entry and kombu's `unacked` entry,
    written one round trip apart. A kill between the two leaves a lost message, not a held
    one (the sweep then re-sends it as lost: a CI run met that window once)."""
    return any(
        v.decode().split("\t")[1] == job_id and r.hexists("unacked", tag)
        for tag, v in r.hgetall(HOLDERS_KEY).items()
    )


@pytest.fixture(scope="module")
def own_services(
    service_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], str]]:
    """A Redis and a migrated database of this module's own. Why: requeue and the sweep look
    at every `queued` row and every queue, as they do in production; in the session's shared
    ones, rows and messages other tests left behind would be found and re-sent too, and the
    counts asserted here would be theirs."""
    server = PrivateRedis(tmp_path_factory.mktemp("recovery-redis"), persist=False)
    server.start()
    name = f"ocrq_test_{uuid.uuid4().hex[:8]}"
    url = make_url(conftest.TEST_PG).set(database=name).render_as_string(hide_password=False)
    migrate = {**os.environ, "OCRQ_DATABASE_URL": url}
    subprocess.run([str(BIN / "ocrq"), "migrate"], env=migrate, check=True, timeout=120)
    try:
        yield {**service_env, "OCRQ_BROKER_URL": server.url, "OCRQ_DATABASE_URL": url}, url
    finally:
        server.stop()
        admin = create_engine(conftest.TEST_PG, isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def test_requeue_resends_only_what_the_broker_lost(
    own_services: tuple[dict[str, str], str], image_root: Path
) -> None:
    """`ocrq requeue --older-than 0s` with a backlog of 30 waiting messages and 3 lost ones:
    it re-sends the 3, and the queue holds 30 messages again, not 57."""
    service_env, database_url = own_services
    queue = f"ocr-requeue-{uuid.uuid4().hex[:6]}"
    env = {**service_env, "OCRQ_QUEUE": queue}
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
    ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "rq", 30)]
    assert r.llen(queue) == 30
    lost = lose(r, queue, 3)
    assert set(lost) <= set(ids) and r.llen(queue) == 27
    cli = subprocess.run(
        [str(BIN / "ocrq"), "requeue", "--older-than", "0s"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "re-sent 3 queued job(s)" in cli.stderr, cli.stderr
    assert sorted(cli.stdout.split()) == sorted(lost)
    waiting = queue_ids(r, queue)
    assert len(waiting) == 30 and sorted(waiting) == sorted(ids)
    FIGURES.append(f"[requeue-backlog] waiting 27 + lost 3: re-sent {len(cli.stdout.split())}")


def test_a_bulk_backlog_does_not_hide_a_lost_interactive_job(
    own_services: tuple[dict[str, str], str], image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep checks the oldest queued rows of each lane for a lost message. It checked the
    oldest of all: behind a bulk backlog longer than that, every one of them a bulk job waiting
    in its queue, an interactive job whose message was lost was never looked for. Here the
    sweep checks 3 a lane, behind 6 waiting bulk jobs."""
    from ocrq.core import requeue

    service_env, database_url = own_services
    queue = f"ocr-lanes-{uuid.uuid4().hex[:6]}"
    settings = Settings(broker_url=service_env["OCRQ_BROKER_URL"], database_url=database_url,
                        queue=queue)  # fmt: skip
    client = Client(settings)
    r = redis.Redis.from_url(settings.broker_url)
    images = make_images(image_root / "lanes", 7)
    bulk = [client.submit({"path": str(p)}) for p in images[:6]]
    lost = client.submit({"path": str(images[6])}, priority="interactive")
    interactive = queue_for("interactive", queue)
    assert lose(r, interactive, 1) == [lost] and r.llen(queue) == 6
    monkeypatch.setattr(requeue, "LOST_CANDIDATES", 3)
    app = requeue.producer_app(settings)
    found = requeue.recover(JobStore(get_engine(database_url)), app, settings, stalled_after_s=0.0)
    assert found.failed is None and found.lost == [lost], found
    assert queue_ids(r, interactive) == [lost]  # sent again, to its own lane's queue
    assert sorted(queue_ids(r, queue)) == sorted(bulk)  # the backlog untouched


def test_a_backlog_in_another_queue_does_not_hide_a_lost_job(
    own_services: tuple[dict[str, str], str], image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog no worker takes (another engine's queue, one whose workers are gone) is older
    than anything lost after it, in the same lane. The sweep looked only at the oldest rows, all
    of them that backlog's: a job whose message was lost was never re-sent. It looks at the
    newest too now. Here 3 a lane, behind 6 waiting in another queue."""
    from ocrq.core import requeue

    service_env, database_url = own_services
    waiting_queue, queue = (f"ocr-{n}-{uuid.uuid4().hex[:6]}" for n in ("idle", "busy"))
    broker = service_env["OCRQ_BROKER_URL"]
    images = make_images(image_root / "queues", 7)
    idle = Client(Settings(broker_url=broker, database_url=database_url, queue=waiting_queue))
    waiting = [idle.submit({"path": str(p)}) for p in images[:6]]
    settings = Settings(broker_url=broker, database_url=database_url, queue=queue)
    lost = Client(settings).submit({"path": str(images[6])})
    r = redis.Redis.from_url(broker)
    assert lose(r, queue, 1) == [lost]
    monkeypatch.setattr(requeue, "LOST_CANDIDATES", 3)
    app = requeue.producer_app(settings)
    found = requeue.recover(JobStore(get_engine(database_url)), app, settings, stalled_after_s=0.0)
    assert found.failed is None and lost in found.lost, found
    assert queue_ids(r, queue) == [lost]
    assert sorted(queue_ids(r, waiting_queue)) == sorted(waiting)  # the backlog untouched


def test_lost_and_unstarted_messages_recovered_by_a_live_worker(
    own_services: tuple[dict[str, str], str], image_root: Path, tmp_path: Path
) -> None:
    """A worker is killed holding a message it had not started (an ETA job, in `unacked`);
    three other messages are lost outright. A live worker's sweep puts the first back and
    re-sends the three: every job done once, no person, no visibility timeout."""
    service_env, database_url = own_services
    queue = f"ocr-recover-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue}
    store = JobStore(get_engine(database_url))
    settings = Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    client = Client(settings)
    r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
    # Waits: victim ready 90 + holding 60 + rescuer ready 90 + all final 150.
    budget = Budget(390, "recover")
    victim = WorkerProcess(env, tmp_path / "victim.log", "--concurrency", "2", "--no-supervise")
    rescuer: WorkerProcess | None = None
    try:
        victim.wait_ready(90)
        # A job whose message the victim takes and holds unstarted: its ETA is 40 s away.
        request = JobRequest.model_validate(
            {"image": {"path": str(make_images(image_root / "eta", 1)[0])}, "task": "text"}
        )
        eta = request.job_id
        # As a producer writes it (ocrq.client): with the reference a re-send is built from.
        store.enqueue_many([NewJob.of(request)])
        kwargs = request.message()
        client.app.send_task(TASK_NAME, kwargs=kwargs, queue=queue, task_id=eta, countdown=40)
        budget.until(
            "the victim holding the ETA job's message",
            lambda: fully_held(r, eta),
            60,
            lambda: f"holders {holders(r)}\n{victim.text()[-2000:]}",
        )
        dead_name = holders(r)[eta]
        victim.stop(signal.SIGKILL)
        killed_at = time.monotonic()
        assert store.get([eta])[eta]["status"] == "queued"
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "lost", 8)]
        lost = lose(r, queue, 3)
        # Jobs waiting in another queue (another engine's workers): not lost, never touched.
        other_queue = f"ocr-other-{uuid.uuid4().hex[:6]}"
        other = Client(settings.model_copy(update={"queue": other_queue}))
        others = [other.submit({"path": str(p)}) for p in make_images(image_root / "other", 5)]
        rescuer = WorkerProcess(env, tmp_path / "rescuer.log", "--concurrency", "4")
        rescuer.wait_ready(90)
        rows = wait_all(store, [*ids, eta], timeout=150, budget=budget, log=rescuer)
        seconds = time.monotonic() - killed_at
    finally:
        victim.stop(signal.SIGKILL)
        if rescuer is not None:
            rescuer.stop()
    figures = report("recover", [*ids, eta], rows, store, seconds)
    log = rescuer.text()
    assert figures["done"] == 9 and figures["lost"] == 0 and figures["duplicated"] == 0
    assert all(row["attempts"] == 1 for row in rows.values()), not_final(store, ids)
    assert rows[eta]["worker"] != dead_name
    sweeps = "\n".join(line for line in log.splitlines() if "sweep" in line)
    assert "re-sent 1 job(s) dead workers had taken but not started" in log, sweeps
    # Each lost row is found once it is OCRQ_STALLED_AFTER_S old: by one sweep or a few.
    found = re.findall(r"re-sent (\d+) queued job\(s\) whose message was nowhere", log)
    assert sum(map(int, found)) == 3, log[-3000:]
    assert all(i in log for i in lost)
    assert not r.hlen(HOLDERS_KEY) and not r.hlen("unacked")  # nothing left held
    assert sorted(queue_ids(r, other_queue)) == sorted(others)
    assert {row["status"] for row in store.get(others).values()} == {"queued"}
    assert seconds < 150  # against a visibility timeout of 3600 s


def test_redis_restarted_empty_jobs_finish_by_themselves(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    """Redis restarts without its data under a running worker: the queued jobs' messages are
    gone, and the worker's sweep re-sends them; `ocrq requeue` is never run."""
    budget = Budget(400, "redis-empty")
    private = PrivateRedis(tmp_path, persist=False)
    private.start()
    database_url = private_database  # its sweep re-sends every queued row Redis lost
    store = JobStore(get_engine(database_url))
    queue = f"ocr-empty-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_BROKER_URL": private.url, "OCRQ_QUEUE": queue,
           "OCRQ_DATABASE_URL": database_url}
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "4")
    try:
        worker.wait_ready(90)
        client = Client(Settings(broker_url=private.url, database_url=database_url, queue=queue))
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "empty", 60, 3)]
        budget.until(
            "10 jobs final before the restart",
            lambda: sum(r["status"] == "done" for r in store.get(ids).values()) >= 10,
            120,
            lambda: not_final(store, ids) + worker.text()[-2000:],
            poll_s=0.1,
        )
        private.stop()
        private.start()  # empty: no append-only file
        t0 = time.monotonic()
        waiting = redis.Redis.from_url(private.url).llen(queue)
        queued = sum(r["status"] == "queued" for r in store.get(ids).values())
        rows = wait_all(store, ids, timeout=180, budget=budget, log=worker)
        seconds = time.monotonic() - t0
    finally:
        worker.stop()
        private.stop()
    figures = report("redis-empty", ids, rows, store, seconds)
    FIGURES.append(
        f"[redis-empty] queued rows at the restart {queued} (messages in Redis {waiting}), "
        f"all done {seconds:.0f} s after it, no person"
    )
    assert waiting == 0 and queued > 0
    assert figures["done"] == len(ids) and figures["lost"] == 0 and figures["duplicated"] == 0
    assert "whose message was nowhere in the broker" in worker.text()


def test_a_dead_workers_last_messages_are_put_back_at_once_and_not_copied(
    own_services: tuple[dict[str, str], str], image_root: Path
) -> None:
    """A worker takes two messages, claims one job and dies before its next heartbeat: the sweep
    that finds it dead sees both taken under OCRQ_STALLED_AFTER_S ago. Each job must end with
    one message, its original, put back at once. Before, the running job was re-sent from its
    row and its original put back by a later sweep as well: the two copies met two live
    workers and the job ran twice (test_gpus, after a kill -9); the unstarted one waited a
    sweep more. A young message of a worker with no heartbeat on record (one yet to beat) is
    left alone. The workers are stood in for by kombu's own basic_get and the holder entries
    ocrq's transport writes beside it; the sweep is the real one, on a real Redis and
    PostgreSQL."""
    service_env, database_url = own_services
    queue = f"ocr-young-{uuid.uuid4().hex[:6]}"
    settings = Settings(
        broker_url=service_env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue
    )
    store = JobStore(get_engine(database_url))
    client = Client(settings)
    r = redis.Redis.from_url(settings.broker_url)
    dead, starting = (f"w-{k}-{uuid.uuid4().hex[:6]}" for k in ("dead", "starting"))
    running, unstarted, newcomer = (
        client.submit({"path": str(p)}) for p in make_images(image_root / "young", 3)
    )
    tags = {}
    with broker_view(client.app, queue) as view:
        assert view is not None
        for _ in range(3):  # a worker's take: each now in unacked
            message = view.channel.basic_get(queue, no_ack=False)
            job_id = message.headers["id"]  # Celery's task id: the job id
            holder = starting if job_id == newcomer else dead
            r.hset(HOLDERS_KEY, message.delivery_tag, holder_entry(holder, job_id))
            tags[job_id] = message.delivery_tag
        # Killed holding them: no channel close puts them back (kombu restores what a
        # channel it closes still holds).
        view.channel.qos._delivered.clear()
    workers_table.beat(store.engine, dead)
    row = store.get([running])[running]
    assert store.claim(running, row["task"], row["source"], dead).run
    workers_table.retire(store.engine, dead)  # a job still running: its heartbeat goes stale
    ids = [running, unstarted, newcomer]
    try:
        first = recover(store, client.app, settings, stalled_after_s=60.0)
        assert first.failed is None, first
        assert first.stalled == [running] and first.orphaned == [unstarted], first
        # One copy of each, the original; nothing held but the newcomer's, nothing rebuilt.
        assert sorted(queue_ids(r, queue)) == sorted([running, unstarted])
        assert set(holders(r)) == {newcomer} and r.hexists("unacked", tags[newcomer])
        assert store.get([running])[running]["status"] == "queued"
        again = recover(store, client.app, settings, stalled_after_s=60.0)
        assert again.stalled == [] and not set(ids) & set(again.orphaned + again.lost)
        assert sorted(queue_ids(r, queue)) == sorted([running, unstarted])
    finally:
        with broker_view(client.app, queue) as view:
            assert view is not None
            view.restore(tags[newcomer])
        r.delete(queue)
        with store.engine.begin() as conn:
            conn.execute(text("DELETE FROM ocr_jobs WHERE id = ANY(:ids)"), {"ids": ids})


def test_requeue_stalled_says_each_kind_apart(
    service_env: dict[str, str], private_database: str, image_root: Path,
    tmp_path: Path,
) -> None:
    """After a kill -9 mid-drain, `ocrq requeue --stalled` printed "re-sent 71 stalled job(s)"
    with 28 of them already `done`: the messages of finished jobs a dead worker had not acked
    were counted as re-sent jobs. Each kind is counted apart: the dead worker's running job
    (re-sent), its held messages (put back: one of a job taken but not started, one of a job
    already done), the running job of a worker heard from a moment ago (left alone: "run again
    later", which then re-sends it) and one of a worker with no heartbeat on record. The dead
    workers' takes are kombu's own basic_get plus the holder entries ocrq's transport writes,
    as in the test above; the command is the real CLI, on a Redis and a database of its own."""
    server = PrivateRedis(tmp_path, persist=False)
    server.start()
    queue = f"ocr-kinds-{uuid.uuid4().hex[:6]}"
    env = {**service_env, "OCRQ_BROKER_URL": server.url, "OCRQ_DATABASE_URL": private_database,
           "OCRQ_QUEUE": queue}
    settings = Settings(broker_url=server.url, database_url=private_database, queue=queue)
    store = JobStore(get_engine(private_database))
    client = Client(settings)
    r = redis.Redis.from_url(server.url)
    dead, quiet, ghost = (f"w-{k}-{uuid.uuid4().hex[:6]}" for k in ("dead", "quiet", "ghost"))
    running, unstarted, finished, recent, unrecorded = (
        client.submit({"path": str(p)}) for p in make_images(image_root / "kinds", 5)
    )
    holder = {running: dead, unstarted: dead, finished: dead, recent: quiet}

    def ocrq_requeue(**extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "ocrq"), "requeue", "--stalled"], env={**env, **extra},
                              capture_output=True, text=True, timeout=60, check=False)

    try:
        with broker_view(client.app, queue) as view:
            assert view is not None
            for _ in range(4):  # the first four, in the order sent; the last one stays queued
                message = view.channel.basic_get(queue, no_ack=False)
                job_id = message.headers["id"]
                r.hset(HOLDERS_KEY, message.delivery_tag, holder_entry(holder[job_id], job_id))
            view.channel.qos._delivered.clear()  # killed holding them: no close puts them back
        for worker in (dead, quiet):
            workers_table.beat(store.engine, worker)
        for job_id, worker in [(running, dead), (finished, dead), (recent, quiet),
                               (unrecorded, ghost)]:
            row = store.get([job_id])[job_id]
            assert store.claim(job_id, row["task"], row["source"], worker).run
        assert store.finish(finished, status="done", text="", worker=dead)
        workers_table.retire(store.engine, dead)  # a job still running: marked dead at once

        first = ocrq_requeue()
        assert first.returncode == 0, first.stderr
        said = " ".join(first.stderr.split())
        assert "re-sent 1 running job(s) of dead workers" in said, said
        assert ("put back 2 message(s) dead workers held (1 of them of jobs already final: "
                "dropped when taken)") in said, said
        assert ("1 running job(s) belong to workers heard from less than 60 s ago "
                "(OCRQ_STALLED_AFTER_S)") in said and "run again later" in said, said
        assert "1 running job(s) name a worker with no heartbeat on record" in said, said
        assert sorted(first.stdout.split()) == sorted([running, unstarted]), first.stdout
        # All three messages are back in the queue, the final job's too (its taker drops it).
        assert sorted(queue_ids(r, queue)) == sorted([running, unstarted, finished, unrecorded])

        # The quiet worker is dead in fact: once silent for OCRQ_STALLED_AFTER_S, run again.
        time.sleep(1.5)
        later = ocrq_requeue(OCRQ_STALLED_AFTER_S="1", OCRQ_HEARTBEAT_S="0.2")
        said = " ".join(later.stderr.split())
        assert later.returncode == 0 and "re-sent 1 running job(s) of dead workers" in said, said
        assert "put back" not in said and "heard from" not in said, said
        assert later.stdout.split() == [recent], later.stdout
        again = ocrq_requeue()
        said = " ".join(again.stderr.split())
        assert "re-sent 0 running job(s) of dead workers" in said and not again.stdout, said
    finally:
        server.stop()


def test_a_backlog_longer_than_the_scan_limit_still_has_its_lost_jobs_found(
    own_services: tuple[dict[str, str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backlog longer than a sweep reads from the newest end (SCAN_LIMIT: 20,000; 5,000 here,
    to keep the test fast), and the 3 oldest jobs' messages lost as a worker took them. The
    sweep read its limit, saw that the queue went on, and looked for no lost message at all
    until the backlog drained. It reads the oldest end too: the 3 are re-sent, and nothing of
    the backlog."""
    import json

    from ocrq.core import requeue

    monkeypatch.setattr(requeue, "SCAN_LIMIT", 5000)

    service_env, database_url = own_services
    queue = f"ocr-long-{uuid.uuid4().hex[:6]}"
    settings = Settings(broker_url=service_env["OCRQ_BROKER_URL"], database_url=database_url,
                        queue=queue)  # fmt: skip
    store = JobStore(get_engine(database_url))
    r = redis.Redis.from_url(settings.broker_url)
    ids = [str(uuid.uuid4()) for _ in range(6_003)]
    ref = {"path": "/nowhere/long.png"}
    lost, waiting = ids[:3], ids[3:]
    # Rows oldest first (the lost ones in a statement of their own: older than every other),
    # 2,000 a statement; every waiting job's message in one pipeline.
    for chunk in [lost, *(waiting[at : at + 2000] for at in range(0, len(waiting), 2000))]:
        store.enqueue_many([NewJob(j, "text", ref["path"], reference=ref) for j in chunk])
    pipe = r.pipeline(transaction=False)
    for job_id in waiting:  # as kombu stores a message: the id in the headers is what is read
        pipe.lpush(queue, json.dumps({"headers": {"id": job_id}, "body": ""}))
    pipe.execute()
    assert r.llen(queue) > requeue.SCAN_LIMIT
    app = requeue.producer_app(settings)
    try:
        found = requeue.recover(store, app, settings, stalled_after_s=0.0)
    finally:
        r.delete(queue)
    assert found.failed is None and sorted(found.lost) == sorted(lost), found
