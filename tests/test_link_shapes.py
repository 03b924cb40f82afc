"""A job's Celery links through a real `ocrq worker` (under `prlimit --as`) and real Redis
(issue 52): only a plain signature of an allowed name, sent to an allowed queue, is applied.

Celery rebuilds a link from its dict by `subtask_type`, not by its name: a link named as an
allowed task but shaped as a group, chain or chord ran its nested tasks (3 extra ocrq jobs; a
tree of depth 3, 15; a group of 50 `billing.refund_all` landed in another app's queue), and a
plain link's `queue` sent the call to any queue. Each such job now fails without running,
saying why, nothing lands anywhere, and an allowed plain link still reaches its queue.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, signature

from ocrq.core.db import get_engine
from ocrq.core.store import JobStore
from tests.conftest import BIN, WorkerProcess
from tests.waiting import Budget

CAP = 3 * 2**30
QUEUE = f"ocr-links-{uuid.uuid4().hex[:6]}"
CALLBACKS = f"myapp-cb-{uuid.uuid4().hex[:6]}"
VICTIM = f"victimq-{uuid.uuid4().hex[:6]}"


class CappedWorker(WorkerProcess):
    def __init__(self, env: dict[str, str], log: Path, *args: str) -> None:
        self.log = log
        self.env = env
        self._fh = log.open("w")
        self.proc = subprocess.Popen(
            ["prlimit", f"--as={CAP}", "--", str(BIN / "ocrq"), "worker", *args],
            env=env, stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@pytest.fixture(scope="module")
def env(service_env: dict[str, str]) -> dict[str, str]:
    return {
        **service_env,
        "OCRQ_QUEUE": QUEUE,
        "OCRQ_LINK_TASKS": "myapp.*",
        "OCRQ_LINK_QUEUES": "myapp-cb-*",
    }


@pytest.fixture(scope="module")
def worker(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    log = tmp_path_factory.mktemp("links") / "worker.log"
    proc = CappedWorker(env, log, "--concurrency", "4").wait_ready(120)
    yield
    proc.stop()


def _plain(name: str, **options: Any) -> dict[str, Any]:
    return dict(signature(name, **options))


def _disguised(kind: str, tasks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the probe sent: an allowed name and queue, the shape of a group/chain/chord."""
    return {**_plain("myapp.done", queue=CALLBACKS), "subtask_type": kind,
            "kwargs": {"tasks": tasks}}  # fmt: skip


def _queued(client: redis.Redis, queue: str) -> int:
    """Messages in `queue`, all of kombu's priority lists of it."""
    return sum(int(client.llen(k)) for k in client.scan_iter(match=f"{queue}*", count=1000))


def test_only_a_plain_allowed_link_to_an_allowed_queue_is_applied(
    worker: None, env: dict[str, str], text_images: dict[str, Path]
) -> None:
    image = {"image": {"path": str(text_images["hello"])}}
    ocrq_ids = [str(uuid.uuid4()) for _ in range(15)]  # jobs a nested link would have made
    extra = [_plain("ocrq.recognize", queue=QUEUE, task_id=i, kwargs=image) for i in ocrq_ids]
    refunds = [_plain("billing.refund_all", queue=VICTIM) for _ in range(50)]
    tree = _disguised("group", [_disguised("group", [_disguised("group", extra[:3])])])
    links: dict[str, dict[str, Any]] = {
        "group": _disguised("group", refunds),
        "chain": _disguised("chain", extra[3:6]),
        "chord": {**_disguised("chord", extra[6:9]), "kwargs": {"header": extra[6:9],
                                                             "body": extra[9]}},
        "nested": tree,
        "routed": _plain("myapp.done", queue=VICTIM),
        "routing_key": _plain("myapp.done", queue=CALLBACKS, routing_key=VICTIM),
        "link_in_link": _plain("myapp.done", queue=CALLBACKS, link=extra[10]),
        "plain": _plain("myapp.done", queue=CALLBACKS),
    }  # fmt: skip
    producer = Celery(broker=env["OCRQ_BROKER_URL"])
    ids = {
        kind: producer.send_task(
            "ocrq.recognize", kwargs=image, queue=QUEUE,
            **({"link_error": link} if kind == "chain" else {"link": link}),
        ).id
        for kind, link in links.items()
    }  # fmt: skip
    store = JobStore(get_engine(env["OCRQ_DATABASE_URL"]))
    client = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
    budget = Budget(120, "link shapes")

    def final() -> dict[str, dict[str, Any]] | None:
        rows = store.get(list(ids.values()))
        done = len(rows) == len(ids) and all(
            r["status"] in ("done", "failed") for r in rows.values()
        )
        return {kind: rows[i] for kind, i in ids.items()} if done else None

    rows = budget.until("every job final", final, 90)
    budget.until("the plain link's call queued", lambda: _queued(client, CALLBACKS) >= 1, 30)
    assert rows["plain"]["status"] == "done", rows["plain"]
    for kind in links.keys() - {"plain"}:
        assert rows[kind]["status"] == "failed", (kind, rows[kind])
        assert rows[kind]["text"] is None, kind  # refused before any intake
    assert "a Celery group" in rows["group"]["error"]
    assert "a Celery chain" in rows["chain"]["error"]
    assert "a Celery chord" in rows["chord"]["error"]
    assert "the queue " + repr(VICTIM) in rows["routed"]["error"]
    assert "OCRQ_LINK_QUEUES" in rows["routed"]["error"]
    assert "routing_key" in rows["routing_key"]["error"]
    assert "options link" in rows["link_in_link"]["error"]
    # Nothing landed in the other app's queue, no nested ocrq job ran, one call was sent.
    assert _queued(client, VICTIM) == 0
    assert store.get(ocrq_ids) == {}
    assert _queued(client, CALLBACKS) == 1
    (raw,) = [client.lpop(k) for k in client.scan_iter(match=f"{CALLBACKS}*") if client.llen(k)]
    assert b'"task": "myapp.done"' in raw
