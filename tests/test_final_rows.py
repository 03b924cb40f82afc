"""A final row stays final, with real workers: a failed job's redelivered message is acked
without running, and a job whose worker dies under it costs at most OCRQ_MAX_ATTEMPTS deaths,
however its message comes back (the stall sweep puts its row back to `queued` to re-send it).
"""

from __future__ import annotations

import contextlib
import re
import signal
import threading
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery

from ocrq.api.client import Client
from ocrq.core.db import get_engine
from ocrq.core.samples import draw_text_image
from ocrq.core.settings import Settings
from ocrq.core.store import JobStore
from tests.conftest import WorkerProcess
from tests.pdfs import image_pdf
from tests.test_faults import not_final, wait_all
from tests.test_liveness import LIVENESS, slow_images
from tests.waiting import Budget


def test_a_failed_job_redelivered_is_not_run_again(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path: Path
) -> None:
    """The job fails (its file is not an image); the file is then fixed and the very message
    sent again: the row stays failed, with its attempts, error and time, and no text."""
    budget = Budget(200, "failed-stays-failed")
    queue = f"ocr-final-{uuid.uuid4().hex[:6]}"
    env = {**service_env, "OCRQ_QUEUE": queue}
    path = image_root / f"fixed-later-{uuid.uuid4().hex[:6]}.png"
    path.write_bytes(b"not an image at all")
    store = JobStore(get_engine(database_url))
    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "4")
    try:
        worker.wait_ready(60)
        app = Celery(broker=env["OCRQ_BROKER_URL"])
        job_id = str(uuid.uuid4())

        def send() -> None:
            app.send_task(
                "ocrq.recognize",
                kwargs={"image": {"path": str(path)}, "job_id": job_id},
                queue=queue,
                task_id=job_id,
            )

        send()
        (first,) = wait_all(store, [job_id], 60, budget, worker).values()
        assert first["status"] == "failed", first
        draw_text_image(["HELLO WORLD"]).save(path)  # it would read now
        send()
        r = redis.Redis.from_url(env["OCRQ_BROKER_URL"])
        ended = re.compile(rf"Task ocrq\.recognize\[{job_id}\] (raised|succeeded)")
        budget.until(
            "the second delivery ended and acked",
            lambda: (
                len(ended.findall(worker.text())) >= 2
                and r.llen(queue) == 0
                and not [v for v in r.hgetall("unacked").values() if job_id.encode() in v]
            ),
            60,
            lambda: worker.text()[-2000:],
        )
        after = store.get([job_id])[job_id]
    finally:
        worker.stop()
    fields = ("status", "attempts", "error", "text", "finished_at", "started_at")
    assert {k: after[k] for k in fields} == {k: first[k] for k in fields}
    assert after["text"] is None and after["attempts"] == 1
    assert f"job {job_id} already failed; redelivery ignored" in worker.text()


def test_an_ignored_redelivery_keeps_the_batch_in_its_result(
    service_env: dict[str, str], text_images: dict[str, Path], image_root: Path, tmp_path: Path
) -> None:
    """A finished job's message delivered again is acked without running; its task result
    (Flower's result column, from the task-succeeded event) names the batch that ran the job,
    as the first delivery's did, and a document's still counts its pages. Before, the copy's
    result had neither, and Flower lost the batch."""
    budget = Budget(240, "redelivery-result")
    queue = f"ocr-again-{uuid.uuid4().hex[:6]}"
    env = {**service_env, "OCRQ_QUEUE": queue}
    pdf = image_pdf(
        [draw_text_image([w], margin=30) for w in ("HELLO WORLD", "INVOICE 2026")],
        image_root / f"again-{uuid.uuid4().hex[:6]}.pdf",
    )
    app = Celery(broker=env["OCRQ_BROKER_URL"], backend=env["OCRQ_BROKER_URL"])
    events: list[dict[str, Any]] = []
    stop = threading.Event()

    def capture() -> None:  # what Flower reads
        with app.connection() as conn:
            recv = app.events.Receiver(conn, handlers={"*": events.append})
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):  # a second without events
                    recv.capture(limit=None, timeout=1)

    def succeeded(task_id: str) -> list[str]:
        return [
            e["result"]
            for e in list(events)
            if e["type"] == "task-succeeded" and e.get("uuid") == task_id
        ]

    worker = WorkerProcess(env, tmp_path / "w.log", "--concurrency", "4")
    listener = threading.Thread(target=capture, daemon=True)
    listener.start()
    jobs = {str(uuid.uuid4()): text_images["hello"], str(uuid.uuid4()): pdf}
    try:
        worker.wait_ready(60)
        budget.until(
            "the event receiver hears the worker",
            lambda: any(e["type"] == "worker-heartbeat" for e in list(events)),
            30,
        )

        def send() -> None:
            for job_id, path in jobs.items():
                app.send_task(
                    "ocrq.recognize",
                    kwargs={"image": {"path": str(path)}, "job_id": job_id},
                    queue=queue,
                    task_id=job_id,
                )

        send()
        first = {j: app.AsyncResult(j).get(timeout=budget.left()) for j in jobs}
        send()  # the very messages again: each row is final now
        budget.until(
            "both copies ended",
            lambda: all(len(succeeded(j)) == 2 for j in jobs),
            90,
            lambda: worker.text()[-2000:],
        )
        again = {j: app.backend.get_task_meta(j, cache=False)["result"] for j in jobs}
    finally:
        stop.set()
        worker.stop()
        listener.join(30)
    image_id, doc_id = jobs
    assert worker.text().count("redelivery ignored") == 2, worker.text()[-2000:]
    batch = first[image_id]["batch_id"]
    assert batch and first[image_id]["batch_wait_s"] is not None, first
    # The backend keeps a task's first SUCCESS (Celery ignores later results for its id).
    assert again == first
    original, copy = succeeded(image_id)
    assert f"'batch_id': '{batch}'" in original, original
    assert f"'batch_id': '{batch}', 'batch_wait_s': None" in copy, copy  # it waited for none
    assert first[doc_id]["pages"] == 2, first
    assert all("'pages': 2" in shown for shown in succeeded(doc_id)), succeeded(doc_id)


def running_attempt(store: JobStore, job_id: str, attempt: int) -> bool:
    row = store.get([job_id]).get(job_id)
    return row is not None and row["status"] == "running" and row["attempts"] == attempt


def test_a_job_whose_worker_dies_costs_at_most_max_attempts(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path: Path
) -> None:
    """Its worker is killed (-9) each time it runs the job; a live worker's stall sweep re-sends
    it. With OCRQ_MAX_ATTEMPTS=2, the third delivery fails it ("gave up after 2 attempts")
    instead of running it a third time: before, the sweep's `queued` row reset the count."""
    budget = Budget(400, "poison-cap")
    queue = f"ocr-poison-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue, "OCRQ_MAX_ATTEMPTS": "2"}
    store = JobStore(get_engine(database_url))
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    (image,) = slow_images(image_root / "poison", 1, lines=40)
    workers: list[WorkerProcess] = []
    try:
        job_id = ""
        for death in (1, 2):
            worker = WorkerProcess(
                env, tmp_path / f"w{death}.log", "--concurrency", "2", "--no-supervise"
            )
            workers.append(worker)
            worker.wait_ready(60)
            if death == 1:
                job_id = client.submit({"path": str(image)})
            budget.until(
                f"the job running on worker {death} (attempt {death})",
                lambda job=job_id, n=death: running_attempt(store, job, n),
                90,
                lambda job=job_id: not_final(store, [job]) + "\n" + workers[-1].text()[-2000:],
                poll_s=0.05,
            )
            worker.stop(signal.SIGKILL)  # dies under it, as a poison input would kill it
        rescuer = WorkerProcess(env, tmp_path / "rescuer.log", "--concurrency", "2")
        workers.append(rescuer)
        rescuer.wait_ready(60)
        (row,) = wait_all(store, [job_id], 120, budget, rescuer).values()
    finally:
        for w in workers:
            w.stop(signal.SIGKILL)
    assert row["status"] == "failed", row
    assert row["attempts"] == 2 and "gave up after 2 attempts" in (row["error"] or ""), row


def test_a_healthy_neighbour_of_a_poison_job_is_not_failed(
    service_env: dict[str, str], database_url: str, image_root: Path, tmp_path: Path
) -> None:
    """A poison job and a healthy one die together (kill -9 with both running). Each comes back
    as a retry, which runs alone in its worker: the worker is killed again while the poison job
    runs alone, and the healthy one, waiting its turn or done, is not charged. With
    OCRQ_MAX_ATTEMPTS=2 the poison job fails after its 2 deaths; the healthy one is done.
    Before, both ran side by side on the second worker too, and both gave up."""
    budget = Budget(480, "neighbour")
    queue = f"ocr-neighbour-{uuid.uuid4().hex[:6]}"
    env = {**service_env, **LIVENESS, "OCRQ_QUEUE": queue, "OCRQ_MAX_ATTEMPTS": "2"}
    store = JobStore(get_engine(database_url))
    client = Client(
        Settings(broker_url=env["OCRQ_BROKER_URL"], database_url=database_url, queue=queue)
    )
    images = slow_images(image_root / "neighbour", 2, lines=40)
    workers: list[WorkerProcess] = []
    try:
        first = WorkerProcess(env, tmp_path / "w1.log", "--concurrency", "2", "--no-supervise")
        workers.append(first)
        first.wait_ready(60)
        poison, healthy = (client.submit({"path": str(p)}) for p in images)
        budget.until(
            "both jobs running on the first worker",
            lambda: all(running_attempt(store, j, 1) for j in (poison, healthy)),
            90,
            lambda: not_final(store, [poison, healthy]) + "\n" + first.text()[-2000:],
            poll_s=0.05,
        )
        first.stop(signal.SIGKILL)  # death 1: both in flight, either may be the cause
        dead = store.get([healthy])[healthy]["worker"]

        def poison_runs_healthy_taken() -> bool:
            """The poison job in its second run, the healthy one claimed by this worker too
            (or done): the moment the second worker dies."""
            rows = store.get([poison, healthy])
            taken = rows[healthy]["status"] == "done" or rows[healthy]["worker"] != dead
            return running_attempt(store, poison, 2) and taken

        second = WorkerProcess(env, tmp_path / "w2.log", "--concurrency", "2", "--no-supervise")
        workers.append(second)
        second.wait_ready(60)
        budget.until(
            "the poison job running on the second worker (attempt 2), the healthy one taken",
            poison_runs_healthy_taken,
            120,
            lambda: not_final(store, [poison, healthy]) + "\n" + second.text()[-2000:],
            poll_s=0.05,
        )
        second.stop(signal.SIGKILL)  # death 2: the poison job ran alone
        beside = store.get([healthy])[healthy]
        rescuer = WorkerProcess(env, tmp_path / "rescuer.log", "--concurrency", "2")
        workers.append(rescuer)
        rescuer.wait_ready(60)
        rows = wait_all(store, [poison, healthy], 120, budget, rescuer)
    finally:
        for w in workers:
            w.stop(signal.SIGKILL)
    # At the second death the healthy job was done, or waiting with its first death only.
    assert beside["status"] == "done" or beside["attempts"] == 1, beside
    assert rows[poison]["status"] == "failed", rows[poison]
    assert "gave up after 2 attempts" in (rows[poison]["error"] or ""), rows[poison]
    assert rows[healthy]["status"] == "done" and rows[healthy]["attempts"] == 2, rows[healthy]
    assert "running it alone" in workers[1].text()
