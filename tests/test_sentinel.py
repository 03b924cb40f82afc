"""A highly available broker: Redis Sentinel, and its master killed mid-run.

Real parts only: a Redis master and its replica, three sentinels (Redis's own
`redis-server --sentinel`), a real `ocrq worker` on the CPU engine and ocrq's own producer (the
api's Client), all reaching Redis through one `sentinel://` URL. The master is killed with
SIGKILL while jobs are running; the sentinels promote the replica and everything must follow it
without a person: every job done, once.

Why three sentinels and not one: with one, a single process decides the master is down; three
with quorum 2 is the smallest group that is a real deployment's (docs/operations.md), and three
idle sentinels cost nothing on a 2-core machine (they answer a PING a second).
"""

from __future__ import annotations

import datetime as dt
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from ocrq.api.client import Client
from ocrq.core.broker_redis import broker_client
from ocrq.core.db import get_engine
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from ocrq.worker.queue_depth import QueueDepth
from tests.conftest import FIGURES, WorkerProcess
from tests.servers import PrivateRedis, PrivateSentinel
from tests.test_faults import (
    child_pids,
    final_rows,
    make_images,
    not_final,
    report,
    wait_all,
    worker_env,
)
from tests.waiting import Budget

MASTER = "ocrq-broker"


def start_group(folder: Path) -> tuple[PrivateRedis, PrivateRedis, list[PrivateSentinel]]:
    """A master, its replica, and three sentinels watching them (quorum 2)."""
    for name in ("master", "replica"):
        (folder / name).mkdir(parents=True)
    master = PrivateRedis(folder / "master", persist=False)
    master.start()
    replica = PrivateRedis(folder / "replica", persist=False, replica_of=master)
    replica.start()
    password = uuid.uuid4().hex
    sentinels = [
        PrivateSentinel(folder / f"sentinel{i}", master, MASTER, quorum=2, password=password)
        for i in range(3)
    ]
    for sentinel in sentinels:
        sentinel.start()
    return master, replica, sentinels


def group_ready(replica: PrivateRedis, sentinels: list[PrivateSentinel]) -> bool:
    """The replica in sync, and each sentinel knows it and the other two sentinels: only then
    can a failover happen."""
    import redis

    try:
        link = redis.Redis.from_url(replica.url).info("replication")["master_link_status"]
        return link == "up" and all(
            len(s.client().sentinel_slaves(MASTER)) == 1
            and len(s.client().sentinel_sentinels(MASTER)) == 2
            for s in sentinels
        )
    except redis.RedisError:
        return False


def master_port(sentinels: list[PrivateSentinel]) -> int | None:
    """The master's port as the first sentinel that answers names it."""
    import redis

    for sentinel in sentinels:
        try:
            address = sentinel.client().sentinel_get_master_addr_by_name(MASTER)
        except redis.RedisError:
            continue
        if address:
            return int(address[1])
    return None


def progress_or_stuck(store: JobStore, ids: list[str], quiet_s: float) -> Callable[[], str | None]:
    """A wait condition: "final" once every row is final; "stuck" once every row that is not
    final is `queued` and no row became final for `quiet_s` seconds; None while work goes on."""
    seen = {"final": -1, "since": time.monotonic()}

    def check() -> str | None:
        rows = store.get(ids)
        final = sum(r["status"] in ("done", "failed") for r in rows.values())
        if final == len(ids):
            return "final"
        if final != seen["final"]:
            seen.update(final=final, since=time.monotonic())
            return None
        waiting = all(r["status"] == "queued" for r in rows.values() if r["status"] != "done")
        return "stuck" if waiting and time.monotonic() - seen["since"] > quiet_s else None

    return check


def where(settings: Settings, job_ids: list[str]) -> dict[str, str]:
    """Where each job's message is on the current master: the queue, `unacked` (a worker
    holds it) or nowhere."""
    client = broker_client(settings)
    queued = client.lrange(settings.queue, 0, -1)
    held = client.hvals("unacked")
    return {
        i: "queue"
        if any(i.encode() in m for m in queued)
        else "unacked"
        if any(i.encode() in m for m in held)
        else "nowhere"
        for i in job_ids
    }


def test_master_killed_mid_run_sentinels_promote_replica_nothing_lost_or_rerun(
    service_env: dict[str, str], private_database: str, image_root: Path, tmp_path: Path
) -> None:
    # Waits, 480 s in all: group 30, ready 90, mid-run 120, promotion 30, the rest final (240,
    # and 60 after a requeue), the later jobs 60.
    budget = Budget(480, "sentinel-failover")
    master, replica, sentinels = start_group(tmp_path)
    worker: WorkerProcess | None = None
    try:
        budget.until(
            "replica in sync and three sentinels that know each other",
            lambda: group_ready(replica, sentinels),
            30,
            lambda: "\n".join(s.log()[-1500:] for s in sentinels),
        )
        url = ";".join(f"sentinel://:{master.password}@127.0.0.1:{s.port}/0" for s in sentinels)
        ha = {
            "broker_url": url,
            "broker_master_name": MASTER,
            "broker_sentinel_password": sentinels[0].password,
        }
        # A database of its own: its sweep re-sends every queued row its Redis does not hold.
        database_url = private_database
        settings = Settings(database_url=database_url, **ha)  # type: ignore[arg-type]
        store = JobStore(get_engine(database_url))
        # Fast liveness, as the liveness tests: the sweep runs every second.
        liveness = {"heartbeat_s": "1", "stalled_after_s": "6", "stalled_sweep_s": "1"}
        # A message the failover left in `unacked` that no one will ack comes back after the
        # visibility timeout (kombu's own restore): 45 s here instead of an hour, so the test
        # can wait for it; every job here runs in a few seconds, far under it.
        env = worker_env(
            service_env, database_url=database_url, max_batch="8", visibility_timeout_s="45",
            **liveness, **ha,
        )
        worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "8")
        worker.wait_ready(min(90, budget.left()))
        client = Client(settings)  # ocrq's own producer path, as the api and `ocrq submit`
        ids = [client.submit({"path": str(p)}) for p in make_images(image_root / "ha", 100, 3)]
        t0 = dt.datetime.now(dt.UTC)
        budget.until(
            "20 jobs final before the kill",
            lambda: len(final_rows(store, ids)) >= 20,
            120,
            lambda: not_final(store, ids) + worker.text()[-2000:],
            poll_s=0.1,
        )

        master.kill()  # the fault: the broker's host dies, nothing is handed over
        killed_at = dt.datetime.now(dt.UTC)
        done_before = {i for i, r in final_rows(store, ids).items() if r["finished_at"] < killed_at}
        assert len(done_before) < len(ids), "every job finished before the kill: no fault tested"
        budget.until(
            "the sentinels to promote the replica",
            lambda: master_port(sentinels) == replica.port,
            30,
            lambda: "\n".join(s.log()[-1500:] for s in sentinels),
            poll_s=0.1,
        )
        promoted_at = dt.datetime.now(dt.UTC)
        promoted_s = (promoted_at - killed_at).total_seconds()
        requeued: list[str] = []
        outcome = budget.until(
            "every job final, or the rest queued with no progress for 30 s",
            progress_or_stuck(store, ids, quiet_s=30),
            240,
            lambda: not_final(store, ids) + worker.text()[-2000:],
            poll_s=0.5,
        )
        if outcome == "stuck":
            stuck = [i for i, r in store.get(ids).items() if r["status"] == "queued"]
            FIGURES.append(f"[sentinel-failover] stuck queued: {where(settings, stuck)}")
            marks = ("broker connection gone", "put back", "outside body", *stuck)
            seen = [
                line[:300] for line in worker.text().splitlines() if any(m in line for m in marks)
            ]
            FIGURES.extend(f"[sentinel-failover]   worker: {line}" for line in seen[:12])
            # Messages the failover lost: a pop that reached the replica without its `unacked`
            # record ("nowhere" above: the recovery sweep re-sends its `queued` row), or one
            # left in `unacked` with no one to ack it (kombu restores it after the visibility
            # timeout). Both come back with no person: wait for them, no `ocrq requeue`.
            requeued = stuck
        rows = wait_all(store, ids, timeout=min(100, budget.left()), budget=budget, log=worker)
        seconds = (dt.datetime.now(dt.UTC) - t0).total_seconds()
        after = [r["finished_at"] for r in rows.values() if r["finished_at"] >= killed_at]
        recovery_s = (min(after) - killed_at).total_seconds() if after else float("nan")
        # A job in the worker's hands at the kill finishes without Redis; the first job started
        # after the promotion came from the new master.
        resumed = [r["finished_at"] for r in rows.values() if r["started_at"] > promoted_at]
        resumed_s = (min(resumed) - killed_at).total_seconds() if resumed else float("nan")

        # The producer follows the new master too: jobs submitted after the failover finish.
        later = [client.submit({"path": str(p)}) for p in make_images(image_root / "ha2", 10)]
        later_rows = wait_all(store, later, timeout=60, budget=budget, log=worker)
        # The worker still consumes through ocrq's transport: a malformed message pushed onto
        # the new master is rejected with one line, and the worker lives on.
        broker_client(settings).lpush("ocr", b"not a message")
        budget.until(
            "the malformed message rejected",
            lambda: "rejected a malformed message" in worker.text() and worker.alive(),
            30,
            lambda: worker.text()[-2000:],
        )
        # ocrq's own reads of Redis reach the new master through the same URL.
        depth = QueueDepth(settings, ["ocr"]).depths()
        results = broker_client(settings).exists(*(f"celery-task-meta-{i}" for i in later))
    finally:
        if worker is not None:
            worker.stop()
        for sentinel in sentinels:
            sentinel.stop()
        replica.stop()
        master.kill()

    figures = report("sentinel-failover", ids, rows, store, seconds)
    failed = sum(r["status"] == "failed" for r in rows.values())
    FIGURES.append(
        f"[sentinel-failover] submitted={len(ids)} done={figures['done']} failed={failed} "
        f"lost={figures['lost']} duplicated={figures['duplicated']} rerun={figures['rerun']} "
        f"recovered_without_person=yes (stuck 30 s, then back by the sweep or the visibility "
        f"timeout: {len(requeued)}) done_before_kill={len(done_before)} "
        f"promoted_s={promoted_s:.1f} "
        f"recovery_s={recovery_s:.1f} first_started_after_promotion_done_s={resumed_s:.1f} "
        f"seconds={seconds:.1f}"
    )
    put_back = re.findall(r"reconnected: put back (\d+) message", worker.text())
    FIGURES.append(f"[sentinel-failover] left unacked, put back after reconnecting: {put_back}")
    text = worker.text()
    assert figures["done"] == len(ids), not_final(store, ids)
    assert figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["rerun"] == 0, {i: r["attempts"] for i, r in rows.items() if r["attempts"] > 1}
    assert recovery_s < 60 and resumed_s < 60
    assert all(r["status"] == "done" for r in later_rows.values())
    assert len(child_pids(worker)) == 1  # the same worker process followed the new master
    assert "Connected to" in text.split("Connection to broker lost")[-1], text[-3000:]
    assert depth == {"ocr": 0}
    assert results == len(later)  # the result backend (the broker's Redis) followed it too


def test_every_client_gets_the_master_name() -> None:
    """The worker's broker and result backend, and the producers' app, all carry the master
    name and the sentinels' password (kombu and Celery take them only as transport options)."""
    from ocrq.core.requeue import producer_app
    from ocrq.worker.broker import SENTINEL_TRANSPORT
    from ocrq.worker.celery_app import make_app

    url = "sentinel://:secret@10.0.0.1:26380/2;sentinel://10.0.0.2"
    settings = Settings(
        broker_url=url,
        broker_master_name="ocrq",
        broker_sentinel_password="s-pass",  # type: ignore[arg-type]
    )
    worker = make_app(settings).conf
    assert worker.broker_transport == SENTINEL_TRANSPORT
    assert worker.result_backend == url
    for options in (
        worker.broker_transport_options,
        worker.result_backend_transport_options,
        producer_app(settings).conf.broker_transport_options,
    ):
        assert options["master_name"] == "ocrq"
        assert options["sentinel_kwargs"]["password"] == "s-pass"
    assert worker.broker_transport_options["visibility_timeout"] == settings.visibility_timeout_s

    from ocrq.core.broker_redis import parse_sentinels

    assert parse_sentinels(url) == (
        [("10.0.0.1", 26380), ("10.0.0.2", 26379)],
        {"password": "secret", "db": 2},
    )


def test_sentinel_url_without_master_name_is_refused(service_env: dict[str, str]) -> None:
    """One line naming the missing setting, and the settings exit code, not a traceback at the
    first connection."""
    import subprocess

    from tests.conftest import BIN

    env = {**service_env, "OCRQ_BROKER_URL": "sentinel://127.0.0.1:1"}
    env.pop("OCRQ_BROKER_MASTER_NAME", None)
    proc = subprocess.run(
        [str(BIN / "ocrq"), "worker"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 78, proc.stderr[-2000:]
    assert "set OCRQ_BROKER_MASTER_NAME" in proc.stderr
    assert "Traceback" not in proc.stderr
