"""`ocrq_queue_depth` against a real Redis with real Celery messages in it (issue 27, item 13).

Messages are sent the way producers send them (a Celery app's `send_task`, with and without a
priority, to the ocrq queue and to Celery's default one) and /metrics is scraped over HTTP; then
a real `ocrq worker --no-supervise` drains the queue and its own /metrics shows it empty.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import redis
from celery import Celery
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from ocrq.core.contract import TASK_NAME, job_kwargs
from ocrq.core.settings import Settings
from ocrq.worker.monitor import Monitor, serve
from ocrq.worker.queue_depth import priority_lists
from tests.conftest import WorkerProcess
from tests.servers import free_port
from tests.waiting import Budget


def depths(port: int) -> dict[str, float]:
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        s.labels["queue"]: s.value
        for family in text_string_to_metric_families(body)
        if family.name == "ocrq_queue_depth"
        for s in family.samples
    }


def test_queue_depth_counts_the_messages_waiting_in_redis(broker_url: str) -> None:
    queue = f"ocr-depth-{uuid.uuid4().hex[:6]}"
    settings = Settings(broker_url=broker_url, queue=queue, consume_default_queue=True)
    port = free_port()
    server = serve(Monitor(CollectorRegistry(), settings), port, "127.0.0.1")
    r = redis.Redis.from_url(broker_url)
    producer = Celery("producer", broker=broker_url)  # another app's producer, as documented
    mine: list[str] = []
    try:
        before = depths(port)
        assert before[queue] == 0 and "celery" in before
        for priority in (None, None, None, 9, 9):
            options = {} if priority is None else {"priority": priority}
            kwargs = job_kwargs({"path": "/nowhere.png"})
            producer.send_task(TASK_NAME, kwargs=kwargs, queue=queue, **options)
        # A bare send_task without queue= lands in `celery`, which workers also consume.
        for _ in range(2):
            mine.append(producer.send_task(TASK_NAME, kwargs=job_kwargs({"path": "/x"})).id)
        # Priority 9 went to a list of its own: a plain LLEN of `ocr` alone would say 3.
        assert r.llen(queue) == 3 and r.llen(priority_lists(queue)[-1]) == 2
        after = depths(port)
        assert after[queue] == 5
        assert after["celery"] == before["celery"] + 2
        r.delete(*priority_lists(queue))
        assert depths(port)[queue] == 0
    finally:
        for raw in r.lrange("celery", 0, -1):  # leave the shared default queue as found
            if json.loads(raw)["headers"]["id"] in mine:
                r.lrem("celery", 1, raw)
        r.delete(*priority_lists(queue))
        server.shutdown()
        producer.close()


def test_a_worker_exports_the_depth_of_its_queue_while_it_drains(
    service_env: dict[str, str], text_images: dict[str, Path], tmp_path: Path
) -> None:
    queue = f"ocr-depth-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {
        **service_env,
        "OCRQ_QUEUE": queue,
        "OCRQ_CONSUME_DEFAULT_QUEUE": "false",
        "OCRQ_METRICS_PORT": str(port),
    }
    producer = Celery("producer", broker=env["OCRQ_BROKER_URL"])
    images = [text_images[n] for n in ("hello", "word", "invoice")] * 2
    for i, path in enumerate(images):  # queued before any worker exists
        options = {"priority": 9} if i % 2 else {}
        kwargs = job_kwargs({"path": str(path)})
        producer.send_task(TASK_NAME, kwargs=kwargs, queue=queue, **options)
    producer.close()
    budget = Budget(240, "queue depth drain")
    worker = WorkerProcess(env, tmp_path / "worker.log", "--no-supervise", "--concurrency", "2")
    try:
        seen: list[float] = []

        def drained() -> bool:
            try:
                seen.append(depths(port)[queue])
            except (httpx.HTTPError, KeyError):
                return False
            return seen[-1] == 0

        budget.until("ocrq_queue_depth 0", drained, 200, detail=lambda: f"seen {seen[-5:]}")
        # Served from the worker's start, before its engine loaded: the backlog was seen.
        assert 0 < max(seen) <= len(images), seen
        r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
        assert sum(r.llen(name) for name in priority_lists(queue)) == 0
    finally:
        worker.stop()
