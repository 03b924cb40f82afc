"""A second copy of a running job's message is dropped, not run again (the mission: no work done
twice); a copy of a job whose worker let it go is still run.

Two copies of one job's message reach two workers when a producer sends a job twice (a retry
after a timeout, under the same id), or a sweep re-sends one beside a message still on its way.
Before, the second claim found the row `running` under a live worker, took it as that worker's
death and ran the job again, alone in its process (a retry). Now a claim that finds the job
running under another worker asks the broker whether that worker still holds its message:
then the copy is acked unrun, with no result stored; otherwise it is taken over as before.

The copies come as a bare Celery producer sends them: `job_id` in the kwargs, and each copy
under a task id of Celery's own. The workers' note of who holds which message must name the job,
not the task: under the task id it matched no row, and the second copy ran the job again.

Real `ocrq worker` processes, Redis and PostgreSQL. The first worker is frozen (SIGSTOP) while
it runs the job, so that the second copy meets it running whatever the machine's speed; each
copy goes to a queue only one worker consumes, so the copies cannot meet in one process.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

from celery import Celery

from ocrq.core.contract import TASK_NAME
from ocrq.core.db import get_engine
from ocrq.core.store import JobStore
from tests.conftest import FIGURES, WorkerProcess
from tests.test_faults import not_final, wait_all
from tests.test_liveness import slow_images
from tests.waiting import Budget


def test_a_second_copy_of_a_running_job_is_dropped_and_an_abandoned_one_is_run(
    service_env: dict[str, str], database_url: str, broker_url: str, image_root: Path,
    tmp_path: Path,
) -> None:
    # Waits: two workers ready 2 x 90, running 60, the copy dropped 60, both final 120.
    budget = Budget(480, "duplicate-copies")
    store = JobStore(get_engine(database_url))
    first_q, second_q = (f"ocr-copy-{k}-{uuid.uuid4().hex[:6]}" for k in "ab")
    app = Celery(broker=broker_url, backend=broker_url)
    # The frozen worker is never taken for dead (and its job swept to the other) in this test.
    env = {**service_env, "OCRQ_STALLED_AFTER_S": "600"}
    first = WorkerProcess(
        {**env, "OCRQ_QUEUE": first_q}, tmp_path / "first.log",
        "--concurrency", "2", "--no-supervise",
    )
    second = WorkerProcess(
        {**env, "OCRQ_QUEUE": second_q}, tmp_path / "second.log", "--concurrency", "2"
    )
    stopped = False
    try:
        first.wait_ready(min(90, budget.left()))
        second.wait_ready(min(90, budget.left()))
        # Start-up lines logged before Celery sets up logging, under --no-supervise too.
        assert "cost model:" in first.text() and "cost model:" in second.text()
        page, other = slow_images(image_root / "copies", 2, lines=40)
        job_id = str(uuid.uuid4())
        kwargs = {"image": {"path": str(page)}, "job_id": job_id}
        app.send_task(TASK_NAME, kwargs=kwargs, queue=first_q)  # a task id of Celery's own
        budget.until(
            "the first worker running the job",
            lambda: (store.get([job_id]).get(job_id) or {}).get("status") == "running",
            60,
            lambda: not_final(store, [job_id]) + first.text()[-2000:],
            poll_s=0.02,
        )
        os.kill(first.proc.pid, signal.SIGSTOP)  # mid-job, holding its message
        stopped = True
        holder = store.get([job_id])[job_id]["worker"]
        # The same job again, as a producer's retry sends it (another task id), to the other
        # worker.
        app.send_task(TASK_NAME, kwargs=kwargs, queue=second_q)
        budget.until(
            "the second worker dropping its copy",
            lambda: "this copy is dropped" in second.text(),
            60,
            lambda: second.text()[-3000:],
        )
        row = store.get([job_id])[job_id]
        assert (row["status"], row["worker"], row["attempts"]) == ("running", holder, 1)
        os.kill(first.proc.pid, signal.SIGCONT)
        stopped = False
        # A job left `running` under a worker that holds no message of it (it let it go): its
        # copy is taken over, as before, and run as a retry.
        gone = str(uuid.uuid4())
        source = str(other)
        assert store.claim(gone, "text", source, f"w-gone-{gone[:6]}").run
        app.send_task(
            TASK_NAME, kwargs={"image": {"path": source}, "job_id": gone}, queue=second_q,
            task_id=gone,
        )
        rows = wait_all(store, [job_id, gone], timeout=120, budget=budget, log=[first, second])
        result = app.AsyncResult(job_id).get(timeout=30)
    finally:
        if stopped:
            os.kill(first.proc.pid, signal.SIGCONT)
        first.stop()
        second.stop()
    # Run once, by the worker that held it; the second copy stored no result of its own.
    assert (rows[job_id]["status"], rows[job_id]["attempts"]) == ("done", 1)
    assert rows[job_id]["worker"] == holder
    assert result["status"] == "done" and result["text"] == rows[job_id]["text"]
    assert f"runs on {holder}" in second.text()
    # The abandoned one: run by the second worker, its earlier run counted.
    assert rows[gone]["status"] == "done" and rows[gone]["worker"] != holder
    assert rows[gone]["attempts"] == 2
    FIGURES.append(
        f"[duplicate-copies] second copy of a running job dropped; abandoned copy run by "
        f"{rows[gone]['worker']}"
    )
